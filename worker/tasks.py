"""The transcription task: one job id in, one result object and a terminal record out.

The task re-reads the record and checks the world itself: a redelivered message may find its
job finished, failed, or running under another worker's lease, and is then dropped. Bad input
fails only that job, with a reason; transient storage or Redis trouble is retried with backoff
and jitter. The message is acked when the task returns, after the result and the record are
durable.
"""

from __future__ import annotations

import json
import os
import random
import socket
from functools import cached_property

import redis
from botocore.exceptions import BotoCoreError, ClientError
from celery import Task
from celery.signals import task_received
from celery.utils.log import get_task_logger

from engine.audio import AudioError
from engine.inputs import SpectrogramError
from engine.longform import OptionsError
from worker.app import app
from worker.batching import EngineFailed, Ticket
from worker.contract.jobs import TASK_NAME, TERMINAL, JobError, JobStatus, JobStore, Progress
from worker.contract.settings import get_settings
from worker.engines import Engines, UnknownModel
from worker.failpoints import failpoint
from worker.leases import Leases
from worker.logs import current_job
from worker.metrics import JOBS
from worker.storage import Storage

log = get_task_logger(__name__)

TRANSIENT = (BotoCoreError, redis.ConnectionError, redis.TimeoutError, EngineFailed)
WORKER_ID = f"{socket.gethostname()}:{os.getpid()}"


class JobTask(Task):
    """Per-process resources, created on first use (Celery's DatabaseTask pattern)."""

    @cached_property
    def store(self) -> JobStore:
        return JobStore(redis.Redis.from_url(get_settings().redis_url))

    @cached_property
    def leases(self) -> Leases:
        return Leases(self.store.redis, WORKER_ID, get_settings().lease_s)

    @cached_property
    def storage(self) -> Storage:
        return Storage(get_settings())

    @cached_property
    def engines(self) -> Engines:
        return Engines(get_settings())


@task_received.connect
def _received(request, **_: object) -> None:
    """A worker took the message off its queue: its job is no longer waiting there. Cleared
    here, not when the task starts, so a worker that dies holding messages it has not started
    (they sit in Redis's unacked set until the visibility timeout) leaves their jobs to the
    reconciler."""
    if request.name == TASK_NAME:
        try:
            transcribe.store.mark_received(request.args[0])
        except redis.RedisError as e:
            log.warning("job %s: receipt not recorded (%s)", request.args[0], e)


@app.task(bind=True, base=JobTask, name=TASK_NAME, max_retries=8)
def transcribe(self: JobTask, job_id: str) -> None:
    current_job.set(job_id)  # every log line of this thread names the job
    record = self.store.get(job_id)
    if record is None:
        log.warning("job %s has no record; dropping its message", job_id)
        return
    if record.status in TERMINAL:
        log.info("job %s is already %s; dropping this delivery", job_id, record.status)
        JOBS.labels("dropped").inc()
        return
    if not self.leases.acquire(job_id):
        holder = self.leases.holder(job_id)
        log.info("job %s is running on %s; dropping this delivery", job_id, holder)
        JOBS.labels("dropped").inc()
        return
    try:
        _run(self, job_id)
    finally:
        self.leases.release(job_id)


def _run(self: JobTask, job_id: str) -> None:
    settings = get_settings()
    record = self.store.get(job_id)
    if record is None or record.status in TERMINAL:
        return
    if record.attempts >= settings.max_attempts:
        reason = f"the job was started {record.attempts} times without finishing"
        self.store.transition(
            job_id, JobStatus.failed, error=JobError(code="poison", message=reason)
        )
        return
    record = self.store.transition(job_id, JobStatus.running, worker=WORKER_ID)
    log.info("job %s started (attempt %d)", job_id, record.attempts)
    failpoint("after_start")

    def fail(code: str, message: str) -> None:
        log.info("job %s failed (%s): %s", job_id, code, message)
        self.store.transition(job_id, JobStatus.failed, error=JobError(code=code, message=message))
        JOBS.labels("failed").inc()

    def on_wait(ticket: Ticket) -> None:
        """Every few seconds while the engine has the job: its progress (the heartbeat thread
        renews its lease). Redis being away does not stop the job."""
        try:
            progress = Progress(done_s=ticket.done_s, total_s=ticket.total_s)
            self.store.set_progress(job_id, progress)
        except redis.RedisError as e:
            log.warning("job %s: progress not recorded (%s); still running", job_id, e)

    try:
        data = self.storage.get(record.input_key)
        try:
            result = self.engines.transcribe(
                record.model,
                data,
                record.options,
                urgent=record.priority == "interactive",
                on_wait=on_wait,
            )
        except AudioError as e:
            return fail("invalid_audio", str(e))
        except SpectrogramError as e:
            return fail("invalid_spectrogram", str(e))
        except OptionsError as e:
            return fail("invalid_option", str(e))
        except UnknownModel as e:
            return fail("unknown_model", str(e))
        body = json.dumps(result.to_dict(), ensure_ascii=False).encode()
        if not self.storage.put_once(record.result_key, body, "application/json"):
            log.info("job %s: a result was stored by an earlier delivery; keeping it", job_id)
        failpoint("after_result")
        progress = Progress(done_s=result.duration, total_s=result.duration)
        self.store.transition(job_id, JobStatus.succeeded, progress=progress, error=None)
        log.info("job %s succeeded", job_id)
        JOBS.labels("succeeded").inc()
        failpoint("before_ack")
    except TRANSIENT + (ClientError,) as e:
        if isinstance(e, ClientError) and e.response["Error"]["Code"] in ("NoSuchKey", "404"):
            return fail("not_found", f"the job's input object {record.input_key} is missing")
        if isinstance(e, EngineFailed) and not e.retry:
            return fail("internal", str(e))
        if self.request.retries >= self.max_retries:
            return fail("unavailable", f"gave up after {self.max_retries} retries: {e}")
        # exponential backoff with full jitter, so retries of many jobs do not arrive together
        countdown = random.uniform(0, min(2**self.request.retries, 30))
        log.warning("job %s: transient error, retrying in %.1f s: %s", job_id, countdown, e)
        if self.store.get(job_id).status is JobStatus.running:
            self.store.transition(job_id, JobStatus.queued)
        self.store.mark_sent(job_id)
        JOBS.labels("retried").inc()
        raise self.retry(exc=e, countdown=countdown) from e
    except Exception as e:  # a bug, not the input's fault: record it rather than hang the job
        log.exception("job %s: unexpected error", job_id)
        fail("internal", f"{type(e).__name__}: {e}")
