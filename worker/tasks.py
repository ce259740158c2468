"""The transcription task: one job id in, one result object and a terminal record out.

The task takes an id and checks the world itself: a redelivered message may find its job
finished, failed, or running under another worker's lease, and is then dropped. The record's
moves live in the task's hooks, next to the task (Celery's `on_success` / `on_failure` /
`on_retry`): succeeded once the result is stored, failed with a reason (bad input, a poison
job, retries spent: the message is rejected, never requeued), queued again for a transient
error (storage, Redis or the engine away: Celery's own backoff with jitter). The lease is
released only after the record moved, and the message is acked after both.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from functools import cached_property

import redis
from botocore.exceptions import BotoCoreError, ClientError
from celery import Task
from celery.exceptions import Reject
from celery.signals import task_received
from celery.utils.log import get_task_logger

from engine import AudioError, OptionsError, SpectrogramError
from worker.app import app
from worker.batching import EngineFailed, Ticket
from worker.contract.formats import WRITERS
from worker.contract.jobs import (
    TASK_NAME,
    TERMINAL,
    JobError,
    JobRecord,
    JobStatus,
    JobStore,
    Progress,
    TransitionError,
)
from worker.contract.settings import get_settings
from worker.engines import Engines, UnknownModel
from worker.failpoints import failpoint
from worker.leases import Leases, poison
from worker.logs import current_job
from worker.metrics import JOBS
from worker.storage import Storage

log = get_task_logger(__name__)

# worth another try later; anything else fails the job
TRANSIENT = (BotoCoreError, ClientError, redis.ConnectionError, redis.TimeoutError, EngineFailed)
# input the worker cannot run: the job fails with this code and the error's message
BAD_INPUT = {
    AudioError: "invalid_audio",
    SpectrogramError: "invalid_spectrogram",
    OptionsError: "invalid_option",
    UnknownModel: "unknown_model",
}
WORKER_ID = f"{socket.gethostname()}:{os.getpid()}"


class JobFailed(Exception):
    """The job cannot succeed, for the reason given. (Picklable, as Celery needs its task
    errors to be: args are the constructor's.)"""

    def __init__(self, code: str, message: str):
        super().__init__(code, message)

    @property
    def error(self) -> JobError:
        return JobError(code=self.args[0], message=self.args[1])

    def __str__(self) -> str:
        return self.args[1]


@dataclass(frozen=True)
class Stored:
    """What a run that stored its result returns, for `on_success`."""

    duration: float  # seconds of audio


class JobTask(Task):
    """Per-process resources, created on first use (Celery's DatabaseTask pattern), and the
    hooks that move the job's record."""

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

    def on_success(self, retval: Stored | None, task_id, args, kwargs) -> None:
        if retval is None:  # the delivery was dropped
            return self._release(args[0])
        job_id, progress = args[0], Progress(done_s=retval.duration, total_s=retval.duration)
        try:
            self.store.transition(job_id, JobStatus.succeeded, progress=progress, error=None)
        except TransitionError as e:  # it ended otherwise meanwhile; its result stays stored
            log.warning("job %s: %s", job_id, e)
        except redis.RedisError as e:
            # not acked: the message comes back, and its run keeps the stored result
            raise Reject(e, requeue=True) from e
        log.info("job %s succeeded", job_id)
        JOBS.labels("succeeded").inc()
        self._release(job_id)
        failpoint("before_ack")

    def on_failure(self, exc, task_id, args, kwargs, einfo) -> None:
        job_id = args[0]
        if isinstance(exc, JobFailed):
            error = exc.error
        elif isinstance(exc, TRANSIENT):  # Celery re-raises the last error once retries are spent
            message = f"gave up after {self.max_retries} retries: {type(exc).__name__}"
            error = JobError(code="unavailable", message=message)
        else:  # a bug, not the input's fault: recorded rather than left running
            log.error("job %s: unexpected error", job_id, exc_info=einfo.exc_info)
            error = JobError(code="internal", message="the worker failed on this job")
        log.info("job %s failed (%s): %s", job_id, error.code, error.message)
        try:
            self.store.transition(job_id, JobStatus.failed, error=error)
            JOBS.labels("failed").inc()
        except TransitionError as e:
            log.warning("job %s: %s", job_id, e)
        self._release(job_id)

    def on_retry(self, exc, task_id, args, kwargs, einfo) -> None:
        job_id = args[0]
        log.warning("job %s: transient error, retried later: %s", job_id, exc)
        record = self.store.get(job_id)
        if record is not None and record.status is JobStatus.running:
            self.store.transition(job_id, JobStatus.queued)
        self.store.mark_sent(job_id)
        JOBS.labels("retried").inc()
        self._release(job_id)

    def _release(self, job_id: str) -> None:
        """Drop the job's lease if this delivery took it (other threads of this worker may
        hold the lease of a job whose duplicate delivery this is)."""
        if getattr(self.request, "leased", False):
            self.leases.release(job_id)

    def claim(self, job_id: str) -> JobRecord | None:
        """The job's record, now running under this worker's lease; None: drop the delivery."""
        record = self.store.get(job_id)
        if record is None:
            log.warning("job %s has no record; dropping its message", job_id)
            return None
        if record.status in TERMINAL:
            log.info("job %s is already %s; dropping this delivery", job_id, record.status)
            JOBS.labels("dropped").inc()
            return None
        if not self.leases.acquire(job_id):
            holder = self.leases.holder(job_id)
            log.info("job %s is running on %s; dropping this delivery", job_id, holder)
            JOBS.labels("dropped").inc()
            return None
        self.request.leased = True
        record = self.store.get(job_id)
        if record is None or record.status in TERMINAL:
            return None
        if error := poison(record, get_settings().max_attempts):
            raise JobFailed(error.code, error.message)
        record = self.store.transition(job_id, JobStatus.running, worker=WORKER_ID)
        log.info("job %s started (attempt %d)", job_id, record.attempts)
        return record

    def process(self, record: JobRecord) -> Stored:
        """Read the input, transcribe it among the other jobs', store the result once."""

        def on_wait(ticket: Ticket) -> None:
            """Every few seconds while the engine has the job: its progress (the heartbeat
            thread renews its lease). Redis being away does not stop the job."""
            try:
                progress = Progress(done_s=ticket.done_s, total_s=ticket.total_s)
                self.store.set_progress(record.id, progress)
            except redis.RedisError as e:
                log.warning("job %s: progress not recorded (%s); still running", record.id, e)

        try:
            data = self.storage.get(record.input_key)
            result = self.engines.transcribe(
                record.model,
                data,
                record.options,
                urgent=record.priority == "interactive",
                on_wait=on_wait,
            )
        except ClientError as e:
            if e.response["Error"]["Code"] in ("NoSuchKey", "404"):
                raise JobFailed("not_found", "the job's input object is missing") from e
            raise
        except EngineFailed as e:
            if e.retry:
                raise
            raise JobFailed("internal", "the engine failed on this job") from e
        except tuple(BAD_INPUT) as e:
            code = next(c for kind, c in BAD_INPUT.items() if isinstance(e, kind))
            raise JobFailed(code, str(e)) from e
        body = WRITERS["json"].render(result).encode()  # the json format is the stored object
        if not self.storage.put_once(record.result_key, body, "application/json"):
            log.info("job %s: a result was stored by an earlier delivery; keeping it", record.id)
        failpoint("after_result")
        return Stored(duration=result.duration)


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


@app.task(
    bind=True,
    base=JobTask,
    name=TASK_NAME,
    autoretry_for=TRANSIENT,
    retry_backoff=True,  # 1, 2, 4 ... s with full jitter, at most retry_backoff_max
    retry_backoff_max=30,
    retry_jitter=True,
    max_retries=8,
    throws=(JobFailed,),  # an expected failure: logged without a traceback
)
def transcribe(self: JobTask, job_id: str) -> Stored | None:
    current_job.set(job_id)  # every log line of this thread names the job
    record = self.claim(job_id)
    if record is None:
        return None
    failpoint("after_start")
    return self.process(record)
