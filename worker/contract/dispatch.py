"""Sending a job's message: the one way the API, retries and the reconciler enqueue a job.

Light (no torch, no FastAPI). The message is marked sent after it is published: if Redis loses
the mark, it may have lost the message too, and the reconciler sends it again (a duplicate is
dropped at delivery); if it keeps the mark, the message was kept before it.
"""

from __future__ import annotations

from celery import Celery

from worker.contract.jobs import TASK_NAME, JobRecord, JobStore


def dispatch(app: Celery, store: JobStore, record: JobRecord, countdown: float | None = None):
    app.send_task(TASK_NAME, args=[record.id], queue=record.priority, countdown=countdown)
    store.mark_sent(record.id)
