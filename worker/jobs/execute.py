"""Running one job: read its input, transcribe it among the other jobs' inputs, store its
result once. The task runs it in the worker process; the quarantine lane runs it in a process
of its own (`worker.jobs.quarantine`). A result stored by an earlier run is kept: a job whose result
exists always ends `succeeded`, unless it was cancelled: a cancelled job's run stops, and no
result of it may stay (the API deletes the job's objects when it cancels; a result the run
stores after that, the run deletes)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis
from botocore.exceptions import BotoCoreError, ClientError

from engine import AudioError, InputTooLong, OptionsError, SpectrogramError
from worker import metrics
from worker.contract.formats import WRITERS
from worker.contract.jobs import JobError, JobRecord, JobStore
from worker.contract.results import TranscriptResult
from worker.core.calls import Cancelled, EngineFailed, UnknownModel
from worker.core.process import EngineCore
from worker.failpoints import failpoint
from worker.jobs.looks import Looks, cancelled
from worker.storage import Storage

log = logging.getLogger(__name__)

# worth another try later; anything else fails the job
TRANSIENT = (BotoCoreError, ClientError, redis.ConnectionError, redis.TimeoutError, EngineFailed)
# input the worker cannot run: the job fails with this code and the error's message
BAD_INPUT = {  # the first that matches: an input too long is invalid audio too
    InputTooLong: "too_long",
    AudioError: "invalid_audio",
    SpectrogramError: "invalid_spectrogram",
    OptionsError: "invalid_option",
    UnknownModel: "unknown_model",
}


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


class JobCancelled(Exception):
    """The job was cancelled while it ran: the run stopped, and stored nothing that stays."""


@dataclass(frozen=True)
class Stored:
    """A run whose result is stored (by it, or by an earlier run of the job)."""

    duration: float  # seconds of audio
    result_key: str | None = None  # where (deleted if the job turns out cancelled)


def was_cancelled(store: JobStore, job_id: str) -> bool:
    """Whether the job was cancelled (or deleted), by one read; Redis away: not known, no."""
    try:
        return cancelled(store.get(job_id))
    except redis.RedisError as e:
        log.warning("job %s: record not read (%s); taken as not cancelled", job_id, e)
        return False


def _missing(error: ClientError) -> bool:
    return error.response["Error"]["Code"] in ("NoSuchKey", "404")


def stored_result(storage: Storage, record: JobRecord) -> Stored | None:
    """The job's result, if a run stored it already."""
    try:
        body = storage.get(record.result_key)
    except ClientError as e:
        if _missing(e):
            return None
        raise
    duration = TranscriptResult.model_validate_json(body).duration
    return Stored(duration=duration, result_key=record.result_key)


def execute(
    record: JobRecord, store: JobStore, storage: Storage, engines: EngineCore, looks: Looks
) -> Stored:
    """Run a job that has started (its record `running`, its lease held); the task looked for
    a result stored by an earlier run first (`stored_result`). While the engine has it, the
    process's `looks` learn whether it was cancelled and record its progress."""
    failpoint("after_start")
    try:
        bucket, key = record.input_location
        with metrics.stage("fetch", record.priority):
            data = storage.get(key, bucket)
        with looks.running(record.id) as on_wait:
            result = engines.transcribe(
                record.model,
                data,
                record.options,
                urgent=record.priority == "interactive",
                on_wait=on_wait,
                wait_s=looks.every_s,
            )
    except Cancelled:
        raise JobCancelled(record.id) from None
    except ClientError as e:
        if _missing(e) and was_cancelled(store, record.id):  # the API deleted its input
            raise JobCancelled(record.id) from None
        if _missing(e):
            raise JobFailed("not_found", "the job's input object is missing") from e
        raise
    except EngineFailed as e:
        if e.retry:
            raise
        raise JobFailed("internal", "the engine failed on this job") from e
    except tuple(BAD_INPUT) as e:
        code = next(c for kind, c in BAD_INPUT.items() if isinstance(e, kind))
        raise JobFailed(code, str(e)) from e
    if was_cancelled(store, record.id):  # since the last look
        raise JobCancelled(record.id)
    body = WRITERS["json"].render(result).encode()  # the json format is the stored object
    with metrics.stage("store", record.priority):
        first = storage.put_once(record.result_key, body, "application/json")
    if not first:
        log.info("job %s: a result was stored by an earlier run; keeping it", record.id)
    failpoint("after_result")
    # Cancelled after the look above: the API may have deleted the job's objects before the
    # put, so the put's result goes here. Cancelled after this look: the API deletes it.
    if was_cancelled(store, record.id):
        discard(storage, record.id, record.result_key)
        log.info("job %s was cancelled as its result was stored: deleted", record.id)
        raise JobCancelled(record.id)
    return Stored(duration=result.duration, result_key=record.result_key)


def discard(storage: Storage, job_id: str, result_key: str) -> None:
    """Delete the result of a job that was cancelled: none may stay. (Storage away: it stays,
    and the log says so.)"""
    try:
        storage.delete(result_key)
    except (BotoCoreError, ClientError) as e:
        log.error("job %s was cancelled, but its result %s stays: %s", job_id, result_key, e)
