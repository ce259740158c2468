"""The Celery application, configured from the one settings object.

One worker process per GPU runs Celery's threads pool: many jobs in flight, one engine per
process (forking after CUDA starts breaks CUDA, and a model per prefork child cannot batch).
Everything a worker needs is configured here, so `celery -A worker.app worker` runs the same
worker as `whisperfleet worker`.
"""

from __future__ import annotations

from celery import Celery
from kombu import Queue

from worker.contract.jobs import QUEUES, TASK_NAME
from worker.contract.settings import CPU_CONCURRENCY, Settings, get_settings


def create_app(settings: Settings) -> Celery:
    # worker.jobs.lifecycle: what a worker process runs besides its jobs, from Celery's signals
    include = ["worker.jobs.tasks", "worker.jobs.lifecycle"]
    app = Celery("whisperfleet", broker=settings.redis_url, include=include)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,  # results live in object storage, state in the job record
        # Ack only after the result and the record are durable; a worker killed mid-job
        # leaves its message to be redelivered (the result put is conditional, so this is safe).
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        # a job that failed for good (bad input, poison, retries spent) is rejected, not
        # requeued: its record says why (worker.jobs.tasks)
        task_acks_on_failure_or_timeout=False,
        worker_prefetch_multiplier=1,
        task_queues=[Queue(name) for name in QUEUES],
        task_default_queue=QUEUES[0],
        task_routes={TASK_NAME: {"queue": QUEUES[0]}},
        # Always look at `interactive` before `bulk` (kombu's default rotates between them).
        # An unacked message comes back after the visibility timeout; leases and the
        # reconciler take over a dead worker's jobs long before that (worker.jobs.leases).
        broker_transport_options={
            "queue_order_strategy": "priority",
            "visibility_timeout": settings.visibility_timeout_s,
        },
        broker_connection_retry_on_startup=True,
        worker_pool="threads",
        worker_concurrency=settings.worker_concurrency or CPU_CONCURRENCY,
        worker_hijack_root_logger=False,
    )
    return app


app = create_app(get_settings())
