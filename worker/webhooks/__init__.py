"""Webhooks (`delivery`): a finished job's notification, checked against the tenant's
networks, signed and posted with retries by `whisperfleet webhooks`.

Imports `worker.contract` and the shared modules; no torch.
"""
