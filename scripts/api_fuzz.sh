#!/usr/bin/env bash
# schemathesis against the served OpenAPI document: moto's S3 server, the API with keys on,
# a key for a tenant allowed the s3:// prefix of the document's example (a real clip), no
# worker (jobs stay queued: the door is under test). Every check: no 5xx, every answer as the
# document says (status, content type, body schema, headers), and the rest of schemathesis'
# checks but two that contradict the API's contract: positive_data_acceptance (a schema can
# say "binary", not "audio": random bytes are refused, 422 invalid_audio) and use_after_free
# (DELETE on a queued job cancels it and keeps its record `cancelled` for a while, as
# documented; a second DELETE forgets it).
#   scripts/api_fuzz.sh [max examples per operation, default 100]
# Needs the test extra plus schemathesis (pip install schemathesis). Redis db 11, flushed.
set -euo pipefail
cd "$(dirname "$0")/.."
EXAMPLES=${1:-100}
PY=${PYTHON:-.venv/bin/python}
S3_PORT=$($PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
API_PORT=$($PY -c "import socket; s=socket.socket(); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])")
LOGS=$(mktemp -d -t whisperfleet-fuzz.XXXXXX)
export WHISPERFLEET_REDIS_URL=redis://127.0.0.1:6379/11
export WHISPERFLEET_S3_ENDPOINT_URL=http://127.0.0.1:$S3_PORT
export WHISPERFLEET_S3_PUBLIC_ENDPOINT_URL=$WHISPERFLEET_S3_ENDPOINT_URL
export WHISPERFLEET_AUTH=keys WHISPERFLEET_MAX_UPLOAD_BYTES=4194304 WHISPERFLEET_MAX_AUDIO_S=60
export WHISPERFLEET_TENANT_JOBS_PER_MINUTE=100000 WHISPERFLEET_TENANT_JOBS_IN_FLIGHT=100000

$PY -m worker.local.s3_server -H 127.0.0.1 -p "$S3_PORT" >"$LOGS/s3.log" 2>&1 &
S3=$!
trap 'kill $S3 $API 2>/dev/null || true' EXIT
redis-cli -n 11 flushdb >/dev/null
KEY=$($PY - <<'PY'
import boto3, redis
from worker.contract.settings import Settings
from worker.contract.tenants import Tenants
from worker.storage import Storage
import time
s = Settings()
for _ in range(100):
    try:
        Storage(s).ensure_bucket(); break
    except Exception:
        time.sleep(0.1)
st = Storage(s)
# the object the document's example names, so that jobs are made and their routes followed
st.client.create_bucket(Bucket="archive")
st.client.put_object(Bucket="archive", Key="acme/call-0042.flac", Body=open("tests/data/en_jfk.flac", "rb").read())
tenants = Tenants(redis.Redis.from_url(s.redis_url), s)
key, _ = tenants.create_key("acme")
tenants.update("acme", sources=["s3://archive/acme/"])
print(key)
PY
)
$PY -m worker.cli api --port "$API_PORT" >"$LOGS/api.log" 2>&1 &
API=$!
for _ in $(seq 100); do curl -sf "http://127.0.0.1:$API_PORT/healthz" >/dev/null && break; sleep 0.2; done

echo "schemathesis $($PY -m pip show schemathesis 2>/dev/null | sed -n 's/^Version: //p'), $EXAMPLES examples per operation; logs in $LOGS"
set +e
${SCHEMATHESIS:-.venv/bin/schemathesis} run "http://127.0.0.1:$API_PORT/openapi.json" \
  -H "Authorization: Bearer $KEY" --checks all --exclude-checks positive_data_acceptance,use_after_free \
  --max-examples "$EXAMPLES" \
  --generation-deterministic --report junit --report-dir "$LOGS"
status=$?
set -e
echo "5xx in the API log: $(grep -c '" 5[0-9][0-9] ' "$LOGS/api.log" || true)"
exit $status
