#!/usr/bin/env bash
# The compose stack end to end: build each image once, start the stack, then check what it
# promises, each step timed:
#   - a clip transcribed through the API (tiny.en's real weights);
#   - a backfill of a storage prefix (two clips put there first);
#   - Redis restarted: a job acknowledged (202) while no worker ran is still queued, and runs;
#   - storage restarted: what was written before is read back, and new results are written;
#   - `docker compose stop` drains the worker: a job running then finishes, run once, and the
#     worker exits 0;
#   - the worker's process killed (kill -9) as a CUDA fault ends it: its container comes back
#     and a job submitted while it was down succeeds; then every container's main process
#     killed at once: all come back and the stack transcribes again, nothing lost.
# Stops the stack at the end (volumes stay).
#   scripts/compose_check.sh           # GPU worker
#   scripts/compose_check.sh --cpu     # the same worker on the CPU
#   scripts/compose_check.sh --local   # no image registry: compose.local.yaml (CPU worker),
#                                      # its base images made first (scripts/compose_images.sh)
# COMPOSE="docker-compose" for Compose v1.
set -euo pipefail
cd "$(dirname "$0")/.."
COMPOSE=${COMPOSE:-docker compose}
URL=http://127.0.0.1:8000
CLIP=tests/data/en_jfk.flac
WORDS="ask not what your country can do for you"
# the drain's job: the clip this many times over, seconds of work for the worker
PROFILE=() WORKER=worker UP=() LOCAL='' TIMES=30
for arg; do
  case $arg in
    --cpu) PROFILE=(--profile cpu) WORKER=worker-cpu UP=(--scale worker=0) TIMES=3 ;;
    --local) PROFILE=(--profile cpu) WORKER=worker-cpu UP=(--scale worker=0) TIMES=3 LOCAL=1 ;;
    *) echo "usage: $0 [--cpu | --local]" >&2; exit 2 ;;
  esac
done
trap 'echo "compose check failed at line $LINENO" >&2' ERR
compose() { $COMPOSE "${PROFILE[@]}" "$@"; }
json() { python3 -c "import json, sys; print(json.load(sys.stdin)$1)"; }
started=$SECONDS at=$SECONDS
took() { printf '== %s: %d s\n' "$1" $((SECONDS - at)); at=$SECONDS; }

scripts/compose_env.sh
if [[ -n $LOCAL ]]; then
  scripts/compose_images.sh
  export COMPOSE_FILE=compose.yaml:compose.local.yaml
  took "base images"
fi
# One build per image: the services that share one would each build it, at once (Docker's
# classic builder shares no work between builds), so one service each, one at a time.
BUILD=(api "$WORKER")
[[ -n $LOCAL ]] && BUILD+=(storage) # the worker's image and /data: after the worker
COMPOSE_PARALLEL_LIMIT=1 $COMPOSE "${PROFILE[@]}" build "${BUILD[@]}"
took "build (${BUILD[*]})"

long=$(mktemp --suffix .wav)
trap 'compose stop; rm -f "$long"' EXIT
ready() {
  for _ in $(seq 300); do curl -sf "$URL/readyz" >/dev/null && return; sleep 1; done
  compose logs --tail 30
  echo "the API is not ready" >&2
  return 1
}
up() { compose up -d --no-build "${UP[@]}" && ready; }
up
took "up"

# the API asks for a key: make one, as an operator would
KEY=$(compose exec -T api whisperfleet keys create --tenant compose-check --name compose_check.sh)
AUTH=(-H "Authorization: Bearer $KEY")
[[ $(curl -s -o /dev/null -w '%{http_code}' "$URL/v1/jobs") == 401 ]]
get() { curl -sf "${AUTH[@]}" "$URL$1"; }
submit() { curl -sf "${AUTH[@]}" -F "file=@${1:-$CLIP}" "$URL/v1/jobs" | json "['id']"; }
wait_status() { # ID STATUS...: wait until the job has one of them (10 min at most)
  local id=$1 now
  shift
  for _ in $(seq 3000); do
    now=$(get "/v1/jobs/$id" | json "['status']")
    [[ " $* " == *" $now "* ]] && return
    case $now in failed | cancelled) get "/v1/jobs/$id"; echo; return 1 ;; esac
    sleep 0.2
  done
  echo "job $id: $now, not $*" >&2
  return 1
}
wait_text() { wait_status "$1" succeeded && get "/v1/jobs/$1/result?format=text"; }
healthy() { # SERVICE: wait until its container passes its healthcheck
  local container
  container=$(compose ps -q "$1")
  for _ in $(seq 120); do
    [[ $(docker inspect -f '{{.State.Health.Status}}' "$container") == healthy ]] && return
    sleep 0.5
  done
  echo "$1 is not healthy" >&2
  return 1
}

echo "job 1 (the first loads the model):"
first=$(submit)
text=$(wait_text "$first")
echo "$text"
grep -qi "$WORDS" <<<"$text"
took "transcription"

prefix="compose-check/$(date +%s)/"
for clip in tests/data/en_jfk.flac tests/data/fr_fleurs_000.flac; do
  compose exec -T api python3 -c 'import sys
from worker.contract.settings import Settings
from worker.storage import Storage
Storage(Settings()).put(sys.argv[1], sys.stdin.buffer.read(), "audio/flac")' \
    "$prefix${clip##*/}" < "$clip"
done
bucket=$(compose exec -T api python3 -c \
  'from worker.contract.settings import Settings; print(Settings().s3_bucket)')
compose exec -T api whisperfleet tenants set compose-check \
  --source "s3://$bucket/compose-check/" >/dev/null
backfill=$(curl -sf "${AUTH[@]}" -H 'Content-Type: application/json' \
  -d "{\"source\": \"s3://$bucket/$prefix\", \"formats\": [\"text\"]}" \
  "$URL/v1/backfills" | json "['id']")
for _ in $(seq 300); do
  [[ $(get "/v1/backfills/$backfill" | json "['status']") == "done" ]] && break
  sleep 1
done
counts=$(get "/v1/backfills/$backfill" | json "['counts']")
echo "backfill $backfill: $counts"
[[ $(get "/v1/backfills/$backfill" | json "['counts']['succeeded']") == 2 ]]
manifest=$(get "/v1/backfills/$backfill/manifest")
took "backfill"

echo "Redis restarted while a job waits in its queue (no worker running):"
compose stop "$WORKER"
queued=$(submit)
compose restart redis
compose start "$WORKER"
grep -qi "$WORDS" <<<"$(wait_text "$queued")"
[[ $(get "/v1/jobs/$first" | json "['status']") == succeeded ]]
took "Redis restart"

echo "storage restarted: results and the manifest read back, a new result written:"
compose restart storage
healthy storage
[[ $(get "/v1/jobs/$first/result?format=text") == "$text" ]]
[[ $(get "/v1/backfills/$backfill/manifest") == "$manifest" ]]
grep -qi "$WORDS" <<<"$(wait_text "$(submit)")"
took "storage restart"

echo "docker compose stop with a job running: the worker drains"
compose exec -T "$WORKER" python3 -c 'import io, sys, numpy, soundfile
audio, rate = soundfile.read(io.BytesIO(sys.stdin.buffer.read()))
out = io.BytesIO()
soundfile.write(out, numpy.tile(audio, int(sys.argv[1])), rate, format="WAV")
sys.stdout.buffer.write(out.getvalue())' "$TIMES" < "$CLIP" > "$long"
running=$(submit "$long")
wait_status "$running" running
worker=$(compose ps -q "$WORKER")
compose stop
code=$(docker inspect -f '{{.State.ExitCode}}' "$worker")
echo "worker exit code $code"
[[ $code == 0 ]]
up
wait_status "$running" succeeded
[[ $(get "/v1/jobs/$running" | json "['attempts']") == 1 ]]
took "stop drains"

worker=$(compose ps -q "$WORKER")
restarts=$(docker inspect -f '{{.RestartCount}}' "$worker")
echo "killing the worker's process (kill -9), as a CUDA fault ends it"
compose exec -T "$WORKER" sh -c 'kill -9 $(cat /proc/1/task/1/children)'
job=$(submit)
echo "job submitted while the worker is down:"
wait_text "$job"
now=$(docker inspect -f '{{.RestartCount}} {{.State.Status}}' "$worker")
echo "worker container restarts: $restarts -> ${now% *}, state ${now#* }"
[[ ${now% *} -gt $restarts ]]
took "worker killed"

echo "every container's main process killed at once (kill -9):"
containers=$(compose ps -q)
declare -A before
for c in $containers; do
  before[$c]=$(docker inspect -f '{{.RestartCount}}' "$c")
  kill -9 "$(docker inspect -f '{{.State.Pid}}' "$c")"
done
STATE='{{.Name}} {{.RestartCount}} {{.State.Status}} {{with .State.Health}}{{.Status}}{{end}}'
# the container read last: restarted since, running, and healthy where it has a healthcheck
back() { [[ $count -gt ${before[$c]} && $state == running && ${health:-healthy} == healthy ]]; }
for c in $containers; do
  for _ in $(seq 120); do
    read -r name count state health < <(docker inspect -f "$STATE" "$c")
    back && break
    sleep 0.5
  done
  echo "$name: restarts ${before[$c]} -> $count, $state ${health:-}"
  back
done
ready
for id in "$first" "$queued" "$running" "$job"; do
  [[ $(get "/v1/jobs/$id" | json "['status']") == succeeded ]]
done
[[ $(get "/v1/jobs/$first/result?format=text") == "$text" ]]
grep -qi "$WORDS" <<<"$(wait_text "$(submit)")"
took "every container killed"

echo "compose check passed in $((SECONDS - started)) s"
