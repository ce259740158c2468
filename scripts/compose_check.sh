#!/usr/bin/env bash
# The compose stack end to end: build and start it, transcribe a real clip through the API, then
# kill the worker's process as a CUDA fault would and check that its container is restarted and
# that a job submitted while it was down succeeds. Stops the stack at the end (volumes stay).
#   scripts/compose_check.sh          # GPU worker
#   scripts/compose_check.sh --cpu    # the same worker on the CPU
# COMPOSE="docker-compose" for Compose v1.
set -euo pipefail
cd "$(dirname "$0")/.."
COMPOSE=${COMPOSE:-docker compose}
URL=http://127.0.0.1:8000
CLIP=tests/data/en_jfk.flac
if [[ ${1:-} == --cpu ]]; then
  PROFILE=(--profile cpu) WORKER=worker-cpu UP=(--scale worker=0)
else
  PROFILE=() WORKER=worker UP=()
fi
compose() { $COMPOSE "${PROFILE[@]}" "$@"; }
json() { python3 -c "import json, sys; print(json.load(sys.stdin)$1)"; }
trap 'compose stop' EXIT

scripts/compose_env.sh
compose up -d --build "${UP[@]}"
printf 'waiting for the API '
for _ in $(seq 300); do curl -sf "$URL/readyz" >/dev/null && break; printf '.'; sleep 1; done
echo
curl -sf "$URL/readyz" >/dev/null || { compose logs --tail 30; exit 1; }

# the API asks for a key: make one, as an operator would
KEY=$(compose exec -T api whisperfleet keys create --tenant compose-check --name compose_check.sh)
AUTH=(-H "Authorization: Bearer $KEY")
[[ $(curl -s -o /dev/null -w '%{http_code}' "$URL/v1/jobs") == 401 ]]

submit() { curl -sf "${AUTH[@]}" -F "file=@$CLIP" "$URL/v1/jobs" | json "['id']"; }
wait_text() {
  for _ in $(seq 600); do
    case $(curl -sf "${AUTH[@]}" "$URL/v1/jobs/$1" | json "['status']") in
      succeeded) curl -sf "${AUTH[@]}" "$URL/v1/jobs/$1/result?format=text"; return ;;
      failed | cancelled) curl -sf "${AUTH[@]}" "$URL/v1/jobs/$1"; echo; return 1 ;;
    esac
    sleep 1
  done
  echo "job $1 did not finish" >&2
  return 1
}

echo "job 1 (the first loads the model):"
wait_text "$(submit)"

container=$(compose ps -q "$WORKER")
restarts=$(docker inspect -f '{{.RestartCount}}' "$container")
echo "killing the worker's process (kill -9), as a CUDA fault ends it"
compose exec -T "$WORKER" sh -c 'kill -9 $(cat /proc/1/task/1/children)'
job=$(submit)
echo "job 2, submitted while the worker is down:"
wait_text "$job"
now=$(docker inspect -f '{{.RestartCount}} {{.State.Status}}' "$container")
echo "worker container restarts: $restarts -> ${now% *}, state ${now#* }"
[[ ${now% *} -gt $restarts ]]
