#!/usr/bin/env bash
# Write .env for compose.yaml: random keys for the stack's object storage (compose refuses to
# start without them; whisperfleet refuses the embedded store's public default keys for any
# other store). Keeps an existing .env.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -f .env ]]; then
  echo ".env exists; keeping it"
  exit 0
fi
umask 077
key() { python3 -c "import secrets; print(secrets.token_hex($1))"; }
printf 'STORAGE_ACCESS_KEY=%s\nSTORAGE_SECRET_KEY=%s\n' "$(key 10)" "$(key 20)" > .env
echo "wrote .env (storage keys; keep it out of version control)"
