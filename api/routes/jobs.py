from __future__ import annotations

import json
import logging
from enum import StrEnum

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from api.deps import OwnedJobDep, QueueDep, SettingsDep, StorageDep, StoreDep, TenantDep
from api.errors import ApiError, ErrorBody
from api.schemas import JobPublic
from api.upload import receive_upload
from worker.contract.dispatch import dispatch
from worker.contract.formats import WRITERS
from worker.contract.jobs import (
    JobError,
    JobInput,
    JobOptions,
    JobRecord,
    JobStatus,
    input_key,
    new_job_id,
)
from worker.contract.languages import LANGUAGES
from worker.contract.settings import Settings

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
ERRORS = {code: {"model": ErrorBody} for code in (404, 409, 413, 422, 503)}


ResultFormat = StrEnum("ResultFormat", {name: name for name in WRITERS})


def _job_fields(
    fields: dict[str, str], settings: Settings, kind: str
) -> tuple[str, JobOptions, str]:
    """Validate the form fields: (model, options, priority)."""
    model = fields.get("model") or settings.default_model
    if model not in settings.models:
        available = ", ".join(settings.models)
        raise ApiError(422, "unknown_model", f"unknown model {model!r}; available: {available}")
    language = (fields.get("language") or "").lower() or None
    if language is not None and language not in LANGUAGES:
        raise ApiError(
            422, "invalid_option", f"unknown language {language!r}; expected an ISO 639-1 code"
        )
    choices = {
        "task": ("transcribe", "translate"),
        "priority": ("interactive", "bulk"),
        "mode": ("sequential", "chunked"),
        "input": ("audio", "spectrogram"),
    }
    chosen = {}
    for name, allowed in choices.items():
        chosen[name] = fields.get(name) or allowed[0]
        if chosen[name] not in allowed:
            expected = " or ".join(allowed)
            raise ApiError(422, "invalid_option", f"{name} {chosen[name]!r}: expected {expected}")
    if fields.get("input") and chosen["input"] != kind:
        code = "invalid_spectrogram" if chosen["input"] == "spectrogram" else "invalid_audio"
        raise ApiError(422, code, f"declared input={chosen['input']}, but the file is {kind}")
    options = JobOptions(
        language=language,
        task=chosen["task"],
        mode=chosen["mode"],
        prompt=fields.get("prompt") or None,
    )
    return model, options, chosen["priority"]


@router.post("", status_code=202, response_model=JobPublic, responses=ERRORS)
async def create_job(
    request: Request,
    settings: SettingsDep,
    store: StoreDep,
    storage: StorageDep,
    queue: QueueDep,
    tenant: TenantDep,
) -> JobPublic:
    """Upload audio or a .npy log-mel spectrogram (multipart field `file`) and queue it.

    Form fields: `model`, `language` (ISO 639-1; omit to detect), `task` (transcribe or
    translate), `mode` (sequential or chunked, for long audio), `prompt` (text as if it came
    before the audio), `priority` (interactive or bulk), `input` (audio or spectrogram;
    recognised from the file when omitted).
    """
    job_id = new_job_id()
    key = input_key(tenant, job_id)
    upload = await receive_upload(
        request, storage.writer(key), settings.max_upload_bytes, settings.max_spectrogram_frames
    )
    kind = upload.sniffed.kind
    try:
        model, options, priority = _job_fields(upload.fields, settings, kind)
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
            kind=kind,
            bytes=upload.size,
            filename=upload.filename,
            format=upload.sniffed.format,
            frames=upload.frames,
        ),
    )
    await run_in_threadpool(store.create, record)
    try:
        await run_in_threadpool(dispatch, queue, store, record)
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
    """The transcript of a succeeded job: `json` (whisperfleet's result), `verbose_json`
    (OpenAI's shape), `text`, `srt` or `vtt`."""
    if job.status is not JobStatus.succeeded:
        why = f": {job.error.message}" if job.error else ""
        raise ApiError(409, "not_ready", f"job {job.id} is {job.status}{why}")
    result = json.loads(await run_in_threadpool(storage.get, job.result_key))
    writer = WRITERS[format]
    return Response(writer.render(result), media_type=writer.media_type)
