"""The transcription task: one job id in, one result object and a terminal record out.

The task takes an id and checks the world itself: a redelivered message may find its job
finished, failed, or running under another worker's lease, and is then dropped; a takeover or
a retry looks for a result an earlier run stored before anything else, and keeps it. A job
whose last start never ended (its worker died under it) runs in the quarantine lane
(`worker.jobs.quarantine`). The record's moves live in the task's hooks, next to the task (Celery's
`on_success` / `on_failure` / `on_retry`): succeeded once the result is stored, failed with a
reason (bad input, poison, expired: the message is rejected, never requeued), queued again
for a transient error (storage, Redis or the engine away: Celery's own backoff with jitter,
until the job's age runs out). The lease is released only after the record moved, and the
message is acked after both. Where Redis is away for a move, the message is put back, never
acked away: its next delivery finds the stored result. A job cancelled while it runs (the API
moved its record to `cancelled`) stops: no move, its lease released, its message acked; a
queued job's delivery finds its record cancelled and is dropped.
"""

from __future__ import annotations

import logging
import os
import socket
from functools import cached_property

import redis
from celery import Task
from celery.exceptions import Reject
from celery.signals import task_received

from worker.app import app
from worker.contract.jobs import (
    TASK_NAME,
    TERMINAL,
    JobRecord,
    JobStatus,
    JobStore,
    Progress,
    TransitionError,
)
from worker.contract.settings import get_settings
from worker.core.process import EngineCore, shared_core
from worker.failpoints import failpoint
from worker.jobs.execute import (
    TRANSIENT,
    JobCancelled,
    JobFailed,
    Stored,
    discard,
    execute,
    stored_result,
    was_cancelled,
)
from worker.jobs.leases import Leases, expired, poison
from worker.jobs.looks import Looks
from worker.jobs.quarantine import Died, Quarantine, Unavailable
from worker.logs import current_job
from worker.metrics import JOB_STAGE, JOBS
from worker.storage import MIN_CONNECTIONS, Storage
from worker.webhooks.delivery import notify

log = logging.getLogger(__name__)  # not get_task_logger: its parent, "celery", is quiet

WORKER_ID = f"{socket.gethostname()}:{os.getpid()}"


class JobTask(Task):
    """Per-process resources, created on first use (Celery's DatabaseTask pattern), and the
    hooks that move the job's record."""

    threads = MIN_CONNECTIONS  # the worker's job threads, as its pool has them: set at worker_init

    @cached_property
    def store(self) -> JobStore:
        settings = get_settings()
        return JobStore(
            redis.Redis.from_url(settings.redis_url), retention_s=settings.job_retention_s
        )

    @cached_property
    def leases(self) -> Leases:
        return Leases(self.store.redis, WORKER_ID, get_settings().lease_s)

    @cached_property
    def looks(self) -> Looks:
        return Looks(self.store)

    @cached_property
    def storage(self) -> Storage:
        return Storage(get_settings(), threads=self.threads)  # a connection for each

    @cached_property
    def engines(self) -> EngineCore:
        return EngineCore(get_settings(), connect=shared_core())

    @cached_property
    def quarantine(self) -> Quarantine:
        return Quarantine(get_settings())

    def on_success(self, retval: Stored | None, task_id, args, kwargs) -> None:
        job_id = args[0]
        if retval is not None:  # else the delivery was dropped
            progress = Progress(done_s=retval.duration, total_s=retval.duration)
            try:
                record = self.store.transition(
                    job_id, JobStatus.succeeded, progress=progress, error=None
                )
                log.info("job %s succeeded", job_id)
                JOBS.labels("succeeded").inc()
                notify(app, record)  # its webhook, if it names one (worker.webhooks.delivery)
            except TransitionError as e:  # it ended otherwise meanwhile; its result stays
                log.warning("job %s: %s", job_id, e)
                # unless it was cancelled: the cancel won, and no result of it may stay
                if retval.result_key and was_cancelled(self.store, job_id):
                    discard(self.storage, job_id, retval.result_key)
            except redis.RedisError as e:
                self._put_back(job_id, e)
            self._release(job_id)
            failpoint("before_ack")
        self._release(job_id)

    def on_failure(self, exc, task_id, args, kwargs, einfo) -> None:
        job_id = args[0]
        if isinstance(exc, JobFailed):
            error = exc.error
        else:  # a bug, not the input's fault: recorded rather than left running
            log.error("job %s: unexpected error", job_id, exc_info=einfo.exc_info)
            error = JobFailed("internal", "the worker failed on this job").error
        log.info("job %s failed (%s): %s", job_id, error.code, error.message)
        try:
            record = self.store.transition(job_id, JobStatus.failed, error=error)
            JOBS.labels("failed").inc()
            notify(app, record)
        except TransitionError as e:
            log.warning("job %s: %s", job_id, e)
        except redis.RedisError as e:
            self._put_back(job_id, e)
        self._release(job_id)

    def on_retry(self, exc, task_id, args, kwargs, einfo) -> None:
        """The retry's message is sent; the job waits for it, queued."""
        job_id = args[0]
        log.warning("job %s: transient error, retried later: %s", job_id, exc)
        try:
            record = self.store.get(job_id)
            if record is not None and record.status is JobStatus.running:
                self.store.transition(job_id, JobStatus.queued)
            self.store.mark_sent(job_id)
        except (redis.RedisError, TransitionError) as e:  # the retry's delivery still runs it
            log.warning("job %s: not marked queued (%s)", job_id, e)
        JOBS.labels("retried").inc()
        self._release(job_id)

    def retry(self, *args, **kwargs):
        """Celery rejects a message whose retry it cannot send (Redis away), which drops the
        job; put the message back instead: it is delivered again once Redis answers."""
        try:
            return super().retry(*args, **kwargs)
        except Reject as e:
            if e.requeue:
                raise
            self._put_back(self.request.args[0], e.reason)

    def _put_back(self, job_id: str, error: object) -> None:
        """Redis is away: reject the message back to its queue rather than ack it."""
        log.warning("job %s: Redis unavailable (%s); its message goes back", job_id, error)
        self._release(job_id)
        raise Reject(error, requeue=True)

    def _release(self, job_id: str) -> None:
        """Drop the job's lease if this delivery took it (other threads of this worker may
        hold the lease of a job whose duplicate delivery this is). With Redis away it is only
        no longer renewed, and lapses."""
        if getattr(self.request, "leased", False):
            self.request.leased = False
            try:
                self.leases.release(job_id)
            except redis.RedisError as e:
                log.warning("job %s: lease not released (%s); it lapses", job_id, e)

    def claim(self, job_id: str) -> JobRecord | None:
        """The job's record under this worker's lease; None: drop the delivery."""
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
        return None if record is None or record.status in TERMINAL else record

    def start(self, record: JobRecord) -> JobRecord | None:
        """Move the job to `running`; a start that finds it running already (its last start
        never ended: its worker died under it) sends it to the quarantine lane. None: it was
        cancelled since the claim looked (drop the delivery)."""
        changes = {"worker": WORKER_ID}
        if record.status is JobStatus.running:
            changes["quarantined"] = True
        try:
            record = self.store.transition(record.id, JobStatus.running, **changes)
        except TransitionError as e:  # only a terminal record refuses `running`
            log.info("job %s: %s; dropping this delivery", record.id, e)
            JOBS.labels("dropped").inc()
            return None
        lane = " in quarantine" if record.quarantined else ""
        log.info("job %s started%s (attempt %d)", record.id, lane, record.attempts)
        if record.attempts == 1:  # accepted to started; a retry's wait is not the queue's
            waited = (record.started_at - record.created_at).total_seconds()
            JOB_STAGE.labels("queue", record.priority).observe(waited)
        return record

    def cancelled(self, record: JobRecord) -> None:
        """The job was cancelled while it ran: its record says so already, so nothing moves;
        returning None releases its lease and acks its message (`on_success`). A quarantined
        run's result is deleted here: its process, killed, may have stored one unlooked at."""
        if record.quarantined:
            discard(self.storage, record.id, record.result_key)
        log.info("job %s cancelled while running; stopped", record.id)
        JOBS.labels("cancelled").inc()

    def run_quarantined(self, record: JobRecord) -> Stored:
        try:
            return self.quarantine.run(record, lambda: was_cancelled(self.store, record.id))
        except Died as e:
            record = self.store.count_quarantine_death(record.id)
            log.warning("job %s: %s (%d)", record.id, e, record.quarantine_deaths)
            if error := poison(record, get_settings().max_attempts):
                raise JobFailed(error.code, error.message) from e
            raise


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
    # transient errors, and a quarantined run that died, are tried again until the job's
    # age runs out (MAX_JOB_AGE_S): not counted away
    autoretry_for=(*TRANSIENT, Died, Unavailable),
    retry_backoff=True,  # 1, 2, 4 ... s with full jitter, at most retry_backoff_max
    retry_backoff_max=30,
    retry_jitter=True,
    max_retries=None,
    throws=(JobFailed,),  # an expected failure: logged without a traceback
)
def transcribe(self: JobTask, job_id: str) -> Stored | None:
    current_job.set(job_id)  # every log line of this thread names the job
    record = self.claim(job_id)
    if record is None:
        return None
    if record.attempts and (stored := stored_result(self.storage, record)):
        log.info("job %s: its result was stored by an earlier run; keeping it", job_id)
        return stored
    if error := expired(record, get_settings().max_job_age_s):
        raise JobFailed(error.code, error.message)
    record = self.start(record)
    if record is None:
        return None
    try:
        if record.quarantined:
            return self.run_quarantined(record)
        return execute(record, self.store, self.storage, self.engines, self.looks)
    except JobCancelled:
        return self.cancelled(record)
