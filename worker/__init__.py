"""Everything behind the API's queues, one folder per subsystem. Each may import only the
ones named beside it (`tests/test_layers.py` checks this from the code, and that no imports
run in a circle):

- `contract/`: the light types the API and the worker share (settings, job records, options,
  results, tenants, backfills); imports nothing else of `worker/`.
- `app.py`, `storage.py`, `metrics.py`, `logs.py`, `failpoints.py`: what every subsystem
  uses (the Celery app, the S3 client, Prometheus metrics, log lines, fault injection for the
  tests); import `contract/`.
- `core/`: the engine core, the one process that holds the models and imports torch; imports
  the above and `engine`.
- `jobs/`: a job's way through a worker process, from Celery's message to its stored result;
  imports the above, `core/`'s client side and `webhooks/`.
- `backfills/`: the scanner, which turns archive prefixes into bulk jobs on schedules.
- `webhooks/`: delivering finished jobs' webhooks.
- `local/`: the embedded stack of a laptop and the tests (Redis, the S3 server).
- `cli/`: `whisperfleet`, every command; may import any of them.

`backfills/`, `webhooks/` and `local/` import only `contract/` and the shared modules. The
API (`api/`) imports `contract/`, the shared modules, `backfills/` and `webhooks/`.
"""
