# Images from one file: `api` (FastAPI, no torch: small, starts fast), `worker` (the engine, and
# the tools of `whisperfleet eval` and `bench`) and `storage` (the stack's own S3 server, for
# compose.local.yaml). compose.yaml builds them; by hand:
# docker build --target api -t whisperfleet-api .
# Each installs its dependencies from pyproject.toml alone (README.md, its description, empty
# until the code comes): a change to anything else reinstalls whisperfleet only.
ARG PYTHON_IMAGE=python:3.11-slim

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH \
    WHISPERFLEET_CACHE_DIR=/var/cache/whisperfleet
RUN python3 -m venv /opt/venv \
    && useradd --system --create-home whisperfleet \
    && mkdir -p /var/cache/whisperfleet && chown whisperfleet /var/cache/whisperfleet
WORKDIR /app

FROM base AS api
COPY pyproject.toml ./
RUN touch README.md && pip install .
COPY README.md ./
COPY api api
COPY worker worker
COPY engine engine
RUN pip install --no-deps .
USER whisperfleet
EXPOSE 8000
CMD ["whisperfleet", "api", "--host", "0.0.0.0", "--port", "8000"]

FROM base AS worker
# PyPI's torch for Linux is the CUDA build. For a CPU-only image, build with
# --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_INDEX_URL=
RUN pip install torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
# gpu: the engine and Triton's kernels; engine: without Triton, for a CPU-only image
ARG WORKER_EXTRAS=gpu
COPY pyproject.toml ./
RUN touch README.md && pip install ".[$WORKER_EXTRAS]"
COPY README.md ./
COPY api api
COPY worker worker
COPY engine engine
COPY tools tools
RUN pip install --no-deps .
USER whisperfleet
EXPOSE 9108
CMD ["whisperfleet", "worker", "--gpus", "all"]

FROM worker AS storage
# The stack's own S3 server (`whisperfleet stack`'s: moto behind a signature check, objects kept
# under /data), in place of SeaweedFS where no image registry is reached (compose.local.yaml).
# The worker's image has it (moto is in the engine's extra); this stage only adds /data.
USER root
RUN mkdir /data && chown whisperfleet /data
USER whisperfleet
EXPOSE 9000
CMD ["python3", "-m", "worker.local.s3_server", "-H", "0.0.0.0", "-p", "9000", "--data", "/data"]
