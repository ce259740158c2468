"""`whisperfleet`, the command line (`main`): the stack, the API, workers, webhooks, the
scanner and beat, keys and tenants, local transcription, eval and bench; the backfill client
(`backfills`) and the process supervisor (`supervisor`) beside it.

The top of the worker's layers: it may import every subsystem, and `tools` for eval and
bench. `python -m worker.cli` runs it as the `whisperfleet` command does.
"""
