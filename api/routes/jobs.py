from __future__ import annotations

import logging
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Annotated, Literal

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from api.bodies import read_json
from api.deps import (
    OwnedJobDep,
    QueueDep,
    SettingsDep,
    StorageDep,
    StoreDep,
    TenantDep,
    result_gone_as_410,
    stored_result,
)
from api.errors import ApiError, error_answers
from api.schemas import JobList, JobPublic, ResultUrl, text_results
from api.submit import SubmitterDep
from worker.contract.formats import WRITERS, Granularity, GranularityError
from worker.contract.jobs import TERMINAL, JobError, JobRecord, JobStatus, TransitionError
from worker.contract.options import JobCreate, SourceJob
from worker.contract.results import TranscriptResult
from worker.webhooks.delivery import notify

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
ERRORS = error_answers(401, 404, 409, 422, 503)
SUBMIT_ERRORS = error_answers(401, 403, 409, 413, 422, 429, 503)
# where a new job's id goes next (OpenAPI links: clients and schemathesis follow them)
LINKS = {
    name: {"operationId": f"jobs-{operation}", "parameters": {"job_id": "$response.body#/id"}}
    for name, operation in (
        ("ReadJob", "read_job"),
        ("ReadResult", "read_result"),
        ("DeleteJob", "delete_job"),
    )
}
RESULT = {
    "model": TranscriptResult | ResultUrl,
    "description": "the transcript in the format asked for: `json` as described here, "
    "`verbose_json` in OpenAI's shape, `text`, `srt` and `vtt` as text; with `download=url`, "
    "a presigned URL of the stored json result",
    "content": text_results(),
}


ResultFormat = StrEnum("ResultFormat", {name: name for name in WRITERS})


def _form_schema() -> dict:
    """The multipart body for OpenAPI: `file`, then JobCreate's fields (the route streams the
    body itself, so FastAPI cannot describe it)."""
    schema = JobCreate.model_json_schema()
    file = {"type": "string", "format": "binary", "description": "audio, or a .npy spectrogram"}
    schema["properties"] = {"file": file, **schema["properties"]}
    schema["required"] = ["file"]
    return schema


@router.post(
    "",
    status_code=202,
    response_model=JobPublic,
    responses={202: {"links": LINKS}, **SUBMIT_ERRORS},
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {
                "multipart/form-data": {"schema": _form_schema()},
                "application/json": {"schema": SourceJob.model_json_schema()},
            },
        },
    },
)
async def create_job(
    request: Request,
    submit: SubmitterDep,
    idempotency_key: Annotated[
        str | None,
        Header(
            description="a retry with the same key and request answers the first job; with "
            "another request, 409 `idempotency_conflict` (kept 24 h)"
        ),
    ] = None,
) -> JobPublic:
    """Queue a job: upload audio or a .npy log-mel spectrogram (multipart field `file`), or
    name an object in storage (JSON `{"source": "s3://bucket/key", ...}`, inside the sources
    the tenant may read).

    The other fields are the job's options (the request body's schemas list them, with their
    values and defaults): `model`, `language`, `task`, `mode`, `prompt`, `timestamps`,
    `word_timestamps`, `vad`, `diarize` (with `speakers`, or `min_speakers` / `max_speakers`),
    `temperature`, `seed`, `priority`, `input`, `webhook`; an empty form field counts as
    omitted. Refused with 422 before anything is queued, the upload deleted: an unknown field
    (`invalid_request`), a bad value (`invalid_option`), a model the server does not serve
    (`unknown_model`), `task=translate` or a `language` other than `en` on an English-only
    model (`invalid_option`), a declared `input` the file is not (`invalid_audio` /
    `invalid_spectrogram`), a webhook on a private address (`invalid_webhook`).
    """
    kind = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if kind == "application/json":
        record = await submit.source(await _source_job(request))
    else:
        record = await submit.upload()
    return JobPublic.from_record(record)


async def _source_job(request: Request) -> SourceJob:
    fields = await read_json(request)
    if not isinstance(fields, dict) or "source" not in fields:
        raise ApiError(
            422,
            "invalid_request",
            'expected a JSON object with "source": "s3://bucket/key" (or a multipart upload)',
        )
    if not isinstance(fields["source"], str):
        raise ApiError(422, "invalid_source", "source: expected a string, s3://bucket/key")
    return SourceJob.parse(fields)


@router.get("", response_model=JobList, responses=ERRORS)
def list_jobs(
    tenant: TenantDep,
    store: StoreDep,
    status: JobStatus | None = None,
    created_after: Annotated[
        str | None,
        Query(
            max_length=64,
            json_schema_extra={"format": "date-time"},
            description="ISO 8601; UTC when it has no zone",
        ),
    ] = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    cursor: Annotated[str | None, Query(max_length=64, pattern=r"^[0-9]{17}:[0-9a-f]{32}$")] = None,
) -> JobList:
    """The tenant's jobs, newest first, `limit` at a time: pass `next_cursor` back as
    `cursor` for the next page (jobs added meanwhile do not shift it)."""
    page = store.page(tenant, limit, cursor, _time(created_after), status)
    return JobList(data=[JobPublic.from_record(r) for r in page.records], next_cursor=page.cursor)


def _time(text: str | None) -> datetime | None:
    """An ISO 8601 time; only that (a number is not a time here, whatever pydantic thinks)."""
    if text is None:
        return None
    try:
        when = datetime.fromisoformat(text)
    except ValueError as e:
        raise ApiError(
            422, "invalid_request", f"created_after {text!r}: expected an ISO 8601 time"
        ) from e
    return when if when.tzinfo else when.replace(tzinfo=UTC)


@router.get("/{job_id}", response_model=JobPublic, responses=ERRORS)
def read_job(job: OwnedJobDep) -> JobPublic:
    """The job's record: poll `status` until succeeded, failed or cancelled."""
    return JobPublic.from_record(job)


@router.get(
    "/{job_id}/result",
    responses={200: RESULT, **ERRORS, **error_answers(410)},
)
async def read_result(
    job: OwnedJobDep,
    storage: StorageDep,
    settings: SettingsDep,
    format: ResultFormat = ResultFormat.json,
    granularity: Annotated[
        Granularity,
        Query(
            description="srt and vtt: a cue per segment, or per word (a job run with "
            "word_timestamps)"
        ),
    ] = "segment",
    download: Literal["url"] | None = None,
) -> Response:
    """The transcript of a succeeded job: `json` (whisperfleet's result), `verbose_json`
    (OpenAI's shape), `text`, `srt` or `vtt` (`granularity=word`: a cue per word); with
    `download=url`, a presigned URL of the stored `json` result instead. A failed job answers
    409 `job_failed` with its reason, a cancelled one `job_cancelled`, one not yet done
    `not_ready`; a succeeded one whose result storage no longer has, 410 `result_gone`."""
    if job.status is JobStatus.failed:
        why = job.error.message if job.error else "no reason recorded"
        code = job.error.code if job.error else "internal"
        raise ApiError(409, "job_failed", f"job {job.id} failed ({code}): {why}")
    if job.status is JobStatus.cancelled:
        raise ApiError(409, "job_cancelled", f"job {job.id} was cancelled")
    if job.status is not JobStatus.succeeded:
        raise ApiError(
            409, "not_ready", f"job {job.id} is {job.status}; poll GET /v1/jobs/{job.id}"
        )
    if download is not None:
        if granularity != "segment":
            raise ApiError(422, "invalid_request", "download=url serves the stored json result")
        return await run_in_threadpool(_download, job, storage, settings, format)
    result = await stored_result(storage, job)
    writer = WRITERS[format]
    try:
        body = writer.render(result, granularity)
    except GranularityError as e:
        raise ApiError(422, "invalid_request", str(e)) from None
    return Response(body, media_type=writer.media_type)


def _download(job: JobRecord, storage, settings, format: ResultFormat) -> Response:
    if settings.s3_public_endpoint_url is None:
        raise ApiError(
            409,
            "download_unavailable",
            "this server gives no download URLs (WHISPERFLEET_S3_PUBLIC_ENDPOINT_URL is not "
            "set); read the result here",
        )
    if format is not ResultFormat.json:
        raise ApiError(
            422,
            "invalid_request",
            "download=url serves the stored json result; other formats are rendered here",
        )
    with result_gone_as_410(job):  # else a URL to nothing: the client meets storage's 404
        storage.head(job.result_key)
    ttl = settings.result_url_ttl_s
    url = storage.presign(job.result_key, settings.s3_public_endpoint_url, ttl)
    expires = datetime.now(UTC) + timedelta(seconds=ttl)
    return JSONResponse(ResultUrl(url=url, expires_at=expires).model_dump(mode="json"))


@router.delete(
    "/{job_id}",
    status_code=200,
    response_model=JobPublic,
    responses={
        204: {"description": "the finished job, its input and result are deleted"},
        **ERRORS,
    },
)
async def delete_job(
    job: OwnedJobDep, store: StoreDep, storage: StorageDep, queue: QueueDep, settings: SettingsDep
) -> Response:
    """Cancel a queued or running job (200, the record `cancelled`: a queued job never runs, a
    running one is aborted at the worker's next step), deleting the objects it made (its
    uploaded input, any result; never an `s3://` source); the record is kept
    `WHISPERFLEET_CANCELLED_RETENTION_S`. On a finished job: deletes its objects and its
    record (204; then 404)."""
    if job.status not in TERMINAL:
        try:
            error = JobError(code="cancelled", message="cancelled by the client")
            job = await run_in_threadpool(
                store.transition, job.id, JobStatus.cancelled, error=error
            )
        except TransitionError:  # it ended meanwhile: deleted as a finished job
            job = await run_in_threadpool(store.get, job.id) or job
        else:
            await run_in_threadpool(_delete_objects, storage, job)
            await run_in_threadpool(store.expire, job.id, settings.cancelled_retention_s)
            await run_in_threadpool(notify, queue, job)
            return JSONResponse(JobPublic.from_record(job).model_dump(mode="json"))
    await run_in_threadpool(_delete_objects, storage, job)
    await run_in_threadpool(store.delete, job)
    return Response(status_code=204)


def _delete_objects(storage, job: JobRecord) -> None:
    for key in job.owned_keys:
        storage.delete(key)
