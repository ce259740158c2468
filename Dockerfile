# Two images from one file: `api` (FastAPI, no torch: small, starts fast) and `worker` (the
# engine, and the tools of `whisperfleet eval` and `bench`). compose.yaml builds both; by hand:
# docker build --target api -t whisperfleet-api .
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
COPY pyproject.toml README.md ./
COPY api api
COPY worker worker
COPY engine engine
RUN pip install .
USER whisperfleet
EXPOSE 8000
CMD ["whisperfleet", "api", "--host", "0.0.0.0", "--port", "8000"]

FROM base AS worker
# PyPI's torch for Linux is the CUDA build. For a CPU-only image, build with
# --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_INDEX_URL=
RUN pip install torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
COPY pyproject.toml README.md ./
COPY api api
COPY worker worker
COPY engine engine
COPY tools tools
RUN pip install '.[gpu]'
USER whisperfleet
EXPOSE 9108
CMD ["whisperfleet", "worker", "--gpus", "all"]
