"""OpenAI's speech-to-text endpoints, as a synchronous facade over the job queue.

`POST /v1/audio/transcriptions` and `POST /v1/audio/translations` take OpenAI's multipart form,
queue an ordinary job at `interactive` priority (the same path as `POST /v1/jobs`: limits,
Idempotency-Key, storage) and wait for it: the transcript in the `response_format` asked for,
or, past `WHISPERFLEET_SYNC_TIMEOUT_S`, 202 with the job as the job API shows it and a
`Location` to poll. The official `openai` Python client works against it unchanged.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Header, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from api.deps import stored_result
from api.errors import ApiError, error_answers
from api.schemas import JobPublic, text_results
from api.submit import Submitter, SubmitterDep
from worker.contract.formats import WRITERS
from worker.contract.jobs import TERMINAL, JobRecord, JobStatus, JobStore
from worker.contract.options import (
    PROMPT_MAX_CHARS,
    JobCreate,
    JobOptions,
    OptionError,
    Task,
    values,
)
from worker.contract.results import TranscriptResult, TranscriptWord

TRANSCRIBE, TRANSLATE = values(Task)
router = APIRouter(prefix="/v1/audio", tags=["openai"])

OPENAI_MODEL = "whisper-1"  # OpenAI's name for Whisper: here, the server's default model
FORMATS = tuple(WRITERS)  # json, verbose_json, text, srt, vtt
GRANULARITIES = "timestamp_granularities[]"
# whisperfleet's options a client may add to OpenAI's fields (the SDKs' `extra_body`)
EXTRA_FIELDS = frozenset(
    {
        "vad",
        "hallucination_silence_threshold",
        "diarize",
        "speakers",
        "min_speakers",
        "max_speakers",
    }
)
# a job that failed for its input answers 422 (the client raises UnprocessableEntityError);
# any other failure (internal, poison, expired, ...) answers 500 with the job's own code
INPUT_ERRORS = frozenset(
    {"invalid_audio", "invalid_spectrogram", "too_long", "invalid_option", "unknown_model"}
)
# the openai client retries 409 and 5xx: a finished job answers the same however often it is
# asked, and each retry would upload the file and queue a new job
NO_RETRY = {"x-should-retry": "false"}
POLL_FIRST_S, POLL_MAX_S = 0.05, 0.25


class OpenAITranscription(BaseModel):
    """`response_format=json`"""

    text: str


class OpenAISegment(BaseModel):
    id: int
    seek: int = Field(description="the segment's start in 10 ms frames")
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float | None
    compression_ratio: float | None
    no_speech_prob: float | None
    speaker: str | None = Field(None, description="with diarize: who spoke it")
    words: list[TranscriptWord] | None = Field(
        None, description="with timestamp_granularities[]=word: its words, timed"
    )


class OpenAIVerbose(BaseModel):
    """`response_format=verbose_json`: OpenAI's TranscriptionVerbose / TranslationVerbose."""

    task: Task
    language: str | None = Field(
        description="the language's English name, lower case: `english` (null: a model that "
        "cannot tell)"
    )
    duration: float = Field(description="seconds of audio")
    text: str
    segments: list[OpenAISegment]
    words: list[TranscriptWord] | None = Field(
        None, description="with timestamp_granularities[]=word: every word, timed"
    )


@dataclass
class _Form:
    """OpenAI's form fields read into a job; `response_format` and the timestamp
    granularities are kept here, as they are not options of the job."""

    task: Task
    response_format: str = "json"

    @property
    def fields(self) -> frozenset[str]:
        names = {"model", "prompt", "response_format", "temperature", GRANULARITIES, "stream"}
        names |= EXTRA_FIELDS
        return frozenset(names | {"language"} if self.task == TRANSCRIBE else names)

    def parse(self, sent: dict[str, str]) -> JobCreate:
        fields = dict(sent)
        fmt = fields.pop("response_format", "json")
        if fmt not in FORMATS:
            raise OptionError(
                "invalid_option", f"response_format {fmt[:40]!r}: expected {', '.join(FORMATS)}"
            )
        granularities = {g.strip() for g in fields.pop(GRANULARITIES, "").split(",") if g.strip()}
        if granularities - {"segment", "word"}:
            raise OptionError(
                "invalid_option",
                f"timestamp_granularities[] {sorted(granularities)[:4]}: expected segment, word",
            )
        if granularities and fmt != "verbose_json":
            raise OptionError(
                "invalid_option",
                "timestamp_granularities[] needs response_format=verbose_json",
            )
        if fields.pop("stream", "false").lower() != "false":
            raise OptionError("invalid_option", "stream: streamed transcripts are not available")
        if fields.get("model") == OPENAI_MODEL:
            del fields["model"]  # the server's default model
        self.response_format = fmt
        words = {"word_timestamps": True} if "word" in granularities else {}
        job = JobCreate.parse({**fields, **words, "task": self.task, "priority": "interactive"})
        job._undo_translate = "transcribe the audio at /v1/audio/transcriptions instead"
        return job


def _form_schema(task: Task) -> dict:
    """The multipart body for OpenAPI (the route streams the body itself, so FastAPI cannot
    describe it)."""
    options = JobOptions.model_fields
    properties = {
        "file": {
            "type": "string",
            "format": "binary",
            "description": "audio (WAV, FLAC, OGG, MP3, MP4/M4A, WebM, AAC), or a .npy "
            "log-mel spectrogram",
        },
        "model": {
            "type": "string",
            "default": OPENAI_MODEL,
            "description": f"`{OPENAI_MODEL}` (the server's default model) or a model the "
            "server serves",
        },
        "language": {"type": "string", "description": options["language"].description},
        "prompt": {
            "type": "string",
            "maxLength": PROMPT_MAX_CHARS,
            "description": options["prompt"].description,
        },
        "response_format": {"type": "string", "enum": list(FORMATS), "default": "json"},
        "temperature": {
            "type": "number",
            "minimum": 0,
            "maximum": 1,
            "description": options["temperature"].description,
        },
        GRANULARITIES: {
            "type": "array",
            "items": {"type": "string", "enum": ["segment", "word"]},
            "description": "`segment` (always given) and `word` (`words` in the answer, at "
            "its top level and in each segment); needs response_format=verbose_json",
        },
    }
    extra = JobOptions.model_json_schema()["properties"]
    properties |= {name: extra[name] for name in sorted(EXTRA_FIELDS)}  # beside OpenAI's
    if task == TRANSLATE:
        del properties["language"]
    return {"type": "object", "properties": properties, "required": ["file"]}


def _route_doc(task: Task) -> dict:
    answer = OpenAITranscription | OpenAIVerbose
    return {
        "responses": {
            200: {
                "model": answer,
                "description": "the transcript in `response_format`: `json` ({text}), "
                "`verbose_json` (with segments, language and duration), `text`, `srt` or `vtt`",
                "content": text_results(),
            },
            202: {
                "model": JobPublic,
                "description": "the job did not finish within the server's wait "
                "(`WHISPERFLEET_SYNC_TIMEOUT_S`): poll `Location` (GET /v1/jobs/{id}), then "
                "read GET /v1/jobs/{id}/result",
                "headers": {"Location": {"schema": {"type": "string"}}},
            },
            **error_answers(401, 403, 409, 413, 422, 429, 500, 503),
        },
        "openapi_extra": {
            "requestBody": {
                "required": True,
                "content": {"multipart/form-data": {"schema": _form_schema(task)}},
            }
        },
    }


IdempotencyKey = Annotated[
    str | None,
    Header(description="a retry with the same key and request waits for the first job"),
]


@router.post("/transcriptions", **_route_doc(TRANSCRIBE))
async def create_transcription(
    request: Request,
    submit: SubmitterDep,
    idempotency_key: IdempotencyKey = None,
) -> Response:
    """OpenAI's transcription endpoint: the audio's text in its own language. Fields: `file`,
    `model` (`whisper-1`: the default model), `language`, `prompt`, `response_format` (json,
    verbose_json, text, srt, vtt), `temperature`, `timestamp_granularities[]` (segment, word);
    and whisperfleet's own `vad`, `hallucination_silence_threshold`, `diarize`, `speakers`,
    `min_speakers`, `max_speakers` (docs/api.md; `extra_body` in OpenAI's SDKs).

    Waits for the job (queued at `interactive` priority); past the server's wait, 202 with
    the job and a `Location` to poll. A job that fails for its input answers 422 with the
    job's code (`invalid_audio`, `too_long`, ...); a cancelled one 409 `job_cancelled`."""
    return await _facade(request, submit, _Form(TRANSCRIBE))


@router.post("/translations", **_route_doc(TRANSLATE))
async def create_translation(
    request: Request,
    submit: SubmitterDep,
    idempotency_key: IdempotencyKey = None,
) -> Response:
    """OpenAI's translation endpoint: the audio's speech translated into English text, by a
    multilingual model (an English-only model answers 422 `invalid_option`). Fields as for
    transcriptions, without `language` (detected)."""
    return await _facade(request, submit, _Form(TRANSLATE))


async def _facade(request: Request, submit: Submitter, form: _Form) -> Response:
    record = await submit.upload(parse=form.parse, fields=form.fields)
    record = await _wait(request, submit.store, record, submit.settings.sync_timeout_s)
    if record.status is JobStatus.succeeded:
        return _render(await stored_result(submit.storage, record), form.response_format)
    if record.status is JobStatus.failed:
        code = record.error.code if record.error else "internal"
        why = record.error.message if record.error else "no reason recorded"
        status = 422 if code in INPUT_ERRORS else 500
        raise ApiError(status, code, f"job {record.id} failed: {why}", NO_RETRY)
    if record.status is JobStatus.cancelled:
        raise ApiError(409, "job_cancelled", f"job {record.id} was cancelled", NO_RETRY)
    return JSONResponse(
        JobPublic.from_record(record).model_dump(mode="json"),
        status_code=202,
        headers={"Location": f"/v1/jobs/{record.id}"},
    )


async def _wait(request: Request, store: JobStore, record: JobRecord, timeout: float):
    """The job's record once it is terminal, or as it is after `timeout` seconds (or when the
    client has gone: the job stays queued, its result readable through the job API)."""
    deadline = time.monotonic() + timeout
    delay = POLL_FIRST_S
    while record.status not in TERMINAL:
        left = deadline - time.monotonic()
        if left <= 0 or await request.is_disconnected():
            break
        await asyncio.sleep(min(delay, left))
        delay = min(delay * 1.5, POLL_MAX_S)
        found = await run_in_threadpool(store.get, record.id)
        if found is None:  # deleted meanwhile (DELETE /v1/jobs/{id})
            raise ApiError(404, "not_found", f"job {record.id} was deleted", NO_RETRY)
        record = found
    return record


def _render(result: TranscriptResult, fmt: str) -> Response:
    if fmt == "json":
        return JSONResponse(OpenAITranscription(text=result.text).model_dump())
    writer = WRITERS[fmt]
    return Response(writer.render(result), media_type=writer.media_type)
