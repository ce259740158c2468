"""Backfills: the scanner (`scanner`) lists archive prefixes, makes bulk jobs while the queue
has room, and writes each run's manifest; `whisperfleet beat` sends scheduled runs. The
records it works from are `worker.contract.backfills`.

Imports `worker.contract` and the shared modules; no torch.
"""
