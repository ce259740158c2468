from __future__ import annotations

import json
import logging
from enum import StrEnum

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.concurrency import run_in_threadpool

from api.deps import OwnedJobDep, QueueDep, SettingsDep, StorageDep, StoreDep, TenantDep
from api.errors import ApiError, ErrorBody
from api.schemas import JobPublic
from api.upload import receive_upload
from worker.jobs import (
    TASK_NAME,
    JobError,
    JobInput,
    JobOptions,
    JobRecord,
    JobStatus,
    input_key,
    new_job_id,
)
from worker.languages import LANGUAGES

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
ERRORS = {code: {"model": ErrorBody} for code in (404, 409, 413, 422, 503)}


class ResultFormat(StrEnum):
    json = "json"
    text = "text"


def _job_fields(fields: dict[str, str], settings) -> tuple[str, JobOptions, str, str]:
    """Validate the form fields: (model, options, priority, input kind)."""
    model = fields.get("model") or settings.default_model
    if model not in settings.models:
        available = ", ".join(settings.models)
        raise ApiError(422, "unknown_model", f"unknown model {model!r}; available: {available}")
    language = fields.get("language") or None
    if language is not None and language.lower() not in LANGUAGES:
        raise ApiError(
            422, "invalid_option", f"unknown language {language!r}; expected an ISO 639-1 code"
        )
    task = fields.get("task") or "transcribe"
    if task not in ("transcribe", "translate"):
        raise ApiError(422, "invalid_option", f"task {task!r}: expected transcribe or translate")
    priority = fields.get("priority") or "interactive"
    if priority not in ("interactive", "bulk"):
        raise ApiError(
            422, "invalid_option", f"priority {priority!r}: expected interactive or bulk"
        )
    kind = fields.get("input") or "audio"
    if kind != "audio":
        raise ApiError(422, "invalid_option", f"input {kind!r}: only audio is supported yet")
    return model, JobOptions(language=language and language.lower(), task=task), priority, kind


@router.post("", status_code=202, response_model=JobPublic, responses=ERRORS)
async def create_job(
    request: Request,
    settings: SettingsDep,
    store: StoreDep,
    storage: StorageDep,
    queue: QueueDep,
    tenant: TenantDep,
) -> JobPublic:
    """Upload audio (multipart field `file`) and queue its transcription.

    Form fields: `model`, `language` (ISO 639-1; omit to detect), `task` (transcribe or
    translate), `priority` (interactive or bulk).
    """
    job_id = new_job_id()
    key = input_key(tenant, job_id)
    upload = await receive_upload(request, storage.writer(key), settings.max_upload_bytes)
    try:
        model, options, priority, kind = _job_fields(upload.fields, settings)
    except ApiError:
        await run_in_threadpool(storage.delete, key)
        raise
    record = JobRecord(
        id=job_id,
        tenant=tenant,
        model=model,
        options=options,
        priority=priority,
        input=JobInput(
            kind=kind, bytes=upload.size, filename=upload.filename, format=upload.sniffed.format
        ),
    )
    await run_in_threadpool(store.create, record)
    try:
        await run_in_threadpool(queue.send_task, TASK_NAME, args=[job_id], queue=priority)
    except Exception as e:
        log.exception("job %s could not be queued", job_id)
        error = JobError(code="unavailable", message=f"the job could not be queued: {e}")
        await run_in_threadpool(store.transition, job_id, JobStatus.failed, error=error)
        raise ApiError(503, "unavailable", "the queue is unavailable; try again") from e
    return JobPublic.from_record(record)


@router.get("/{job_id}", response_model=JobPublic, responses=ERRORS)
def read_job(job: OwnedJobDep) -> JobPublic:
    """The job's record: poll `status` until succeeded, failed or cancelled."""
    return JobPublic.from_record(job)


@router.get("/{job_id}/result", responses=ERRORS)
async def read_result(
    job: OwnedJobDep, storage: StorageDep, format: ResultFormat = ResultFormat.json
) -> Response:
    """The transcript of a succeeded job: `json` (text, language, duration, segments) or `text`."""
    if job.status is not JobStatus.succeeded:
        why = f": {job.error.message}" if job.error else ""
        raise ApiError(409, "not_ready", f"job {job.id} is {job.status}{why}")
    result = json.loads(await run_in_threadpool(storage.get, job.result_key))
    if format is ResultFormat.text:
        return PlainTextResponse(result["text"] + "\n")
    return JSONResponse(result)
