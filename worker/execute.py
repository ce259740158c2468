"""Running one job: read its input, transcribe it among the other jobs' inputs, store its
result once. The task runs it in the worker process; the quarantine lane runs it in a process
of its own (`worker.quarantine`). A result stored by an earlier run is kept: a job whose result
exists always ends `succeeded`."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import redis
from botocore.exceptions import BotoCoreError, ClientError

from engine import AudioError, InputTooLong, OptionsError, SpectrogramError
from worker.batching import EngineFailed, Ticket
from worker.contract.formats import WRITERS
from worker.contract.jobs import JobError, JobRecord, JobStore, Progress
from worker.contract.results import TranscriptResult
from worker.engines import Engines, UnknownModel
from worker.failpoints import failpoint
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


@dataclass(frozen=True)
class Stored:
    """A run whose result is stored (by it, or by an earlier run of the job)."""

    duration: float  # seconds of audio


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
    return Stored(duration=TranscriptResult.model_validate_json(body).duration)


def execute(record: JobRecord, store: JobStore, storage: Storage, engines: Engines) -> Stored:
    """Run a job that has started (its record `running`, its lease held); the task looked for
    a result stored by an earlier run first (`stored_result`)."""
    failpoint("after_start")

    def on_wait(ticket: Ticket) -> None:
        """Every few seconds while the engine has the job: its progress (the heartbeat
        thread renews its lease). Redis being away does not stop the job."""
        try:
            store.set_progress(record.id, Progress(done_s=ticket.done_s, total_s=ticket.total_s))
        except redis.RedisError as e:
            log.warning("job %s: progress not recorded (%s); still running", record.id, e)

    try:
        data = storage.get(record.input_key)
        result = engines.transcribe(
            record.model,
            data,
            record.options,
            urgent=record.priority == "interactive",
            on_wait=on_wait,
        )
    except ClientError as e:
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
    body = WRITERS["json"].render(result).encode()  # the json format is the stored object
    if not storage.put_once(record.result_key, body, "application/json"):
        log.info("job %s: a result was stored by an earlier run; keeping it", record.id)
    failpoint("after_result")
    return Stored(duration=result.duration)
