"""A job's way through a worker process: Celery's message (`tasks`), running it and storing
its result (`execute`), an input that killed a worker run alone in a process of its own
(`quarantine`), cancels seen and progress written (`looks`), the lease that lets another
worker take over a dead one's jobs (`leases`), objects no job will read removed (`orphans`),
and what a worker process runs beside its jobs (`lifecycle`: Celery's signals).

Imports `worker.contract`, the shared modules, `worker.core` (the client side of the engine
core) and `worker.webhooks`; the engine only for its input errors.
"""
