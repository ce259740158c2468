#!/usr/bin/env bash
# Start the local stack, submit a real speech clip through the REST API, poll, print the text.
# Needs `whisperfleet` on PATH (pip install -e '.[engine]'), curl, and Redis (started if installed).
set -euo pipefail
cd "$(dirname "$0")/.."
PORT=${PORT:-8000}
URL="http://127.0.0.1:$PORT"
CLIP=${1:-tests/data/en_jfk.flac}
LOG=$(mktemp -t whisperfleet-stack.XXXXXX.log)

json() { python3 -c "import json, sys; print(json.load(sys.stdin)$1)"; }

whisperfleet stack --port "$PORT" >"$LOG" 2>&1 &
STACK=$!
# the stack's log goes once it has served; kept, and named, when something failed
trap 'status=$?; kill -TERM $STACK 2>/dev/null; wait $STACK 2>/dev/null || true
      if [ $status -eq 0 ]; then rm -f "$LOG"; else echo "stack log kept: $LOG" >&2; fi' EXIT

# ready: Redis, storage and a worker with its model loaded (the first start converts it)
printf 'starting the stack (log: %s) ' "$LOG"
for _ in $(seq 300); do
  if curl -sf "$URL/readyz" >/dev/null; then break; fi
  if ! kill -0 $STACK 2>/dev/null; then echo; tail -20 "$LOG"; exit 1; fi
  printf '.'; sleep 1
done
curl -sf "$URL/readyz" >/dev/null || { echo; curl -s "$URL/readyz"; echo; tail -20 "$LOG"; exit 1; }
echo " ready"

echo "POST $URL/v1/jobs  file=@$CLIP"
JOB=$(curl -sf -F "file=@$CLIP" "$URL/v1/jobs")
ID=$(echo "$JOB" | json "['id']")
echo "job $ID queued; polling"
for _ in $(seq 300); do
  STATUS=$(curl -sf "$URL/v1/jobs/$ID" | json "['status']")
  case "$STATUS" in
    succeeded) break ;;
    failed|cancelled) curl -sf "$URL/v1/jobs/$ID"; echo; exit 1 ;;
  esac
  sleep 0.5
done
echo "GET $URL/v1/jobs/$ID/result?format=text"
curl -sf "$URL/v1/jobs/$ID/result?format=text"
