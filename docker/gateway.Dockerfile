# syntax=docker/dockerfile:1
# The gateway without torch or vLLM: `swiftkv serve` with remote pools (vLLM server Deployments) or with
# Ray Serve pools on a KubeRay cluster (WITH_RAY=1, the default). Build from the repository root:
#   docker build -f docker/gateway.Dockerfile -t swiftkv/gateway:0.1.0 .
# Measured as a pip install into a fresh Python 3.11 venv: 377 MB without Ray, 725 MB with ray[serve].
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ARG WITH_RAY=1
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY requirements/constraints-cpu.txt requirements/constraints-cpu.txt
COPY docker/requirements-gateway.txt docker/requirements-gateway-ray.txt docker/
RUN pip install -c requirements/constraints-cpu.txt -r docker/requirements-gateway.txt \
    && if [ "$WITH_RAY" = 1 ]; then pip install -c requirements/constraints-cpu.txt -r docker/requirements-gateway-ray.txt; fi
COPY pyproject.toml README.md ./
COPY swiftkv_core swiftkv_core
COPY services services
# --no-deps: the package's own dependencies include torch, which the gateway never imports
RUN pip install --no-deps .

FROM ${PYTHON_IMAGE}
RUN useradd --uid 1000 --user-group --create-home --home-dir /home/swiftkv swiftkv \
    && mkdir -p /var/lib/swiftkv /models && chown 1000:1000 /var/lib/swiftkv /models
COPY --from=build /opt/venv /opt/venv
COPY deploy/ray/swiftkv_ray_app.py /opt/swiftkv/swiftkv_ray_app.py
ENV PATH=/opt/venv/bin:$PATH PYTHONPATH=/opt/swiftkv PYTHONUNBUFFERED=1 SWIFTKV_DATA_DIR=/var/lib/swiftkv
USER 1000:1000
WORKDIR /home/swiftkv
EXPOSE 8000
ENTRYPOINT ["swiftkv"]
CMD ["serve"]
