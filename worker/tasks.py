"""The transcription task: one job id in, one result object and a terminal record out.

The task re-reads the record and checks the world itself (a redelivered message may find its
job finished or failed already); bad input fails only that job, with a reason; transient
storage or Redis trouble is retried.
"""

from __future__ import annotations

import json
import time
from functools import cached_property

import redis
from botocore.exceptions import BotoCoreError, ClientError
from celery import Task
from celery.utils.log import get_task_logger

from engine.audio import AudioError
from engine.inputs import SpectrogramError
from engine.longform import OptionsError
from worker.app import app
from worker.engines import Engines, UnknownModel
from worker.jobs import TASK_NAME, TERMINAL, JobError, JobStatus, JobStore, Progress
from worker.settings import get_settings
from worker.storage import Storage

log = get_task_logger(__name__)

PROGRESS_EVERY_S = 2.0
TRANSIENT = (BotoCoreError, redis.ConnectionError, redis.TimeoutError)


class JobTask(Task):
    """Per-process resources, created on first use (Celery's DatabaseTask pattern)."""

    @cached_property
    def store(self) -> JobStore:
        return JobStore(redis.Redis.from_url(get_settings().redis_url))

    @cached_property
    def storage(self) -> Storage:
        return Storage(get_settings())

    @cached_property
    def engines(self) -> Engines:
        return Engines(get_settings())


@app.task(bind=True, base=JobTask, name=TASK_NAME, max_retries=8)
def transcribe(self: JobTask, job_id: str) -> None:
    record = self.store.get(job_id)
    if record is None:
        log.warning("job %s has no record; dropping its message", job_id)
        return
    if record.status in TERMINAL:
        log.info("job %s is already %s; nothing to do", job_id, record.status)
        return
    if record.attempts >= get_settings().max_attempts:
        reason = f"the job was started {record.attempts} times without finishing"
        self.store.transition(
            job_id, JobStatus.failed, error=JobError(code="poison", message=reason)
        )
        return
    record = self.store.transition(job_id, JobStatus.running)

    def fail(code: str, message: str) -> None:
        log.info("job %s failed (%s): %s", job_id, code, message)
        self.store.transition(job_id, JobStatus.failed, error=JobError(code=code, message=message))

    last_report = 0.0

    def report(_: int, done_s: float, total_s: float) -> None:
        nonlocal last_report
        if time.monotonic() - last_report > PROGRESS_EVERY_S:
            last_report = time.monotonic()
            self.store.set_progress(job_id, Progress(done_s=done_s, total_s=total_s))

    try:
        data = self.storage.get(record.input_key)
        try:
            result = self.engines.transcribe(record.model, data, record.options, report)
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
        progress = Progress(done_s=result.duration, total_s=result.duration)
        self.store.transition(job_id, JobStatus.succeeded, progress=progress, error=None)
    except TRANSIENT + (ClientError,) as e:
        if isinstance(e, ClientError) and e.response["Error"]["Code"] in ("NoSuchKey", "404"):
            return fail("not_found", f"the job's input object {record.input_key} is missing")
        log.warning("job %s: transient error, retrying: %s", job_id, e)
        self.store.transition(job_id, JobStatus.queued)
        raise self.retry(exc=e, countdown=min(2**self.request.retries, 30)) from e
    except Exception as e:  # a bug, not the input's fault: record it rather than hang the job
        log.exception("job %s: unexpected error", job_id)
        fail("internal", f"{type(e).__name__}: {e}")
