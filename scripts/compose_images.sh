#!/usr/bin/env bash
# The base images compose.local.yaml names, for machines that reach no image registry: made from
# Debian's mirror and the host's pip instead. Each is made only if missing (`docker rmi` one to
# make it again). Needs a running dockerd and mmdebstrap (scripts/docker_install.sh), as root.
#   whisperfleet-local/python:3.11       Debian bookworm (mmdebstrap, with its security updates)
#                                        with python3 and its venv module
#   whisperfleet-local/redis:7           ... with Debian's redis-server 7.0
#   whisperfleet-local/torch:2.13.0-cpu  ... with torch in /opt/venv: the wheel the host's pip finds
#                                        for torch==2.13.0, the CPU build on machines like CI's
#                                        (TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
#                                        where PyPI's, the CUDA build, would be found)
# The host's CA certificates go into the base (pip's too): pip in the builds trusts what the
# host trusts, a proxy's CA included.
set -euo pipefail
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PYTHON=whisperfleet-local/python:3.11
REDIS=whisperfleet-local/redis:7
TORCH=whisperfleet-local/torch:2.13.0-cpu
CA=/etc/ssl/certs/ca-certificates.crt

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
missing() { ! docker image inspect "$1" >/dev/null 2>&1; }
took() { echo "$1: $((SECONDS - start)) s"; }

if missing "$PYTHON"; then
  start=$SECONDS
  # mmdebstrap: debootstrap's successor in Debian, twice as fast here (apt downloads at once)
  mmdebstrap --quiet --variant=minbase --include=python3,python3-venv,ca-certificates \
    --customize-hook="upload $CA $CA" \
    --customize-hook="printf '[global]\ncert = %s\n' $CA > \"\$1/etc/pip.conf\"" \
    bookworm - "deb $MIRROR bookworm main" "deb $MIRROR bookworm-updates main" \
    "deb $MIRROR-security bookworm-security main" \
    | docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$PYTHON" >/dev/null
  took "$PYTHON (mmdebstrap)"
fi

if missing "$REDIS"; then
  start=$SECONDS
  # the official image's layout: data in /data (compose.yaml's volume), run as redis
  docker build -q -t "$REDIS" - >/dev/null <<EOF
FROM $PYTHON
RUN apt-get update -q && apt-get install -y -q --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* && mkdir /data && chown redis:redis /data
WORKDIR /data
USER redis
EXPOSE 6379
CMD ["redis-server"]
EOF
  took "$REDIS"
fi

if missing "$TORCH"; then
  start=$SECONDS
  wheels=$tmp/wheels
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
    -d "$wheels" torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
  # in the Dockerfile's venv, whose `python3 -m venv /opt/venv` keeps what is there
  docker build -q -t "$TORCH" -f - "$wheels" >/dev/null <<EOF
FROM $PYTHON
COPY *.whl /tmp/
RUN python3 -m venv /opt/venv && /opt/venv/bin/pip install -q --no-cache-dir /tmp/*.whl \
    && rm /tmp/*.whl
EOF
  took "$TORCH"
fi
