from __future__ import annotations

import logging
from enum import StrEnum
from functools import partial

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from api.deps import OwnedJobDep, QueueDep, SettingsDep, StorageDep, StoreDep, TenantDep
from api.errors import ApiError, ErrorBody
from api.schemas import JobPublic
from api.upload import receive_upload
from worker.contract.dispatch import dispatch
from worker.contract.formats import WRITERS
from worker.contract.jobs import JobInput, JobRecord, JobStatus, JobStore, input_key, new_job_id
from worker.contract.options import JobCreate
from worker.contract.results import TranscriptResult
from worker.storage import ObjectWriter

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/jobs", tags=["jobs"])
ERRORS = {code: {"model": ErrorBody} for code in (404, 409, 413, 422, 503)}
RESULT = {
    "model": TranscriptResult,
    "description": "the transcript in the format asked for: `json` as described here, "
    "`verbose_json` in OpenAI's shape, `text`, `srt` and `vtt` as text",
    "content": {
        w.media_type: {"schema": {"type": "string"}}
        for w in WRITERS.values()
        if w.media_type != WRITERS["json"].media_type
    },
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
    responses=ERRORS,
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"multipart/form-data": {"schema": _form_schema()}},
        }
    },
)
async def create_job(
    request: Request,
    settings: SettingsDep,
    store: StoreDep,
    storage: StorageDep,
    queue: QueueDep,
    tenant: TenantDep,
) -> JobPublic:
    """Upload audio or a .npy log-mel spectrogram (multipart field `file`) and queue it.

    The other form fields are the job's options (the request body's schema lists them, with
    their values and defaults): `model`, `language`, `task`, `mode`, `prompt`, `timestamps`
    (false: each 30 s window is one segment), `seed`, `priority`, `input`; an empty field counts as
    omitted. Refused with 422 before anything is queued, the upload deleted: an unknown field
    (`invalid_request`), a bad value (`invalid_option`), a model the server does not serve
    (`unknown_model`), `task=translate` or a `language` other than `en` on an English-only
    model (`invalid_option`), a declared `input` the file is not (`invalid_audio` /
    `invalid_spectrogram`).
    """
    job_id = new_job_id()
    writer, record = storage.writer(input_key(tenant, job_id)), None
    await run_in_threadpool(store.redis.ping)  # Redis away: 503 before a byte is stored
    try:
        upload = await receive_upload(
            request, writer, settings.max_upload_bytes, settings.max_audio_s
        )
        head = upload.head
        job = JobCreate.parse(upload.fields).resolve(settings, head.sniffed.kind)
        record = JobRecord(
            id=job_id,
            tenant=tenant,
            model=job.model,
            options=job.options,
            priority=job.priority,
            input=JobInput(
                kind=job.input,
                bytes=upload.size,
                filename=upload.filename,
                format=head.sniffed.format,
                frames=head.npy.frames if head.npy else None,
            ),
        )
        await run_in_threadpool(store.create, record)
        await run_in_threadpool(dispatch, queue, store, record)
    except BaseException:
        await run_in_threadpool(_withdraw, job_id, writer, store if record else None)
        raise
    return JobPublic.from_record(record)


def _withdraw(job_id: str, writer: ObjectWriter, store: JobStore | None) -> None:
    """Undo a submission that was refused or failed halfway, best effort: its record if one
    may have been written (a message already sent for it is then dropped by the worker), and
    whatever of its input was stored. What cannot be undone now, with Redis or storage away,
    is left to the orphan sweeper (worker.orphans) or, for a record, to the worker, which
    fails a job whose input is gone."""
    steps = [("input", writer.abort)]
    if store is not None:  # first: a job without its record is never run
        steps.insert(0, ("record", partial(store.delete, job_id)))
    for what, undo in steps:
        try:
            undo()
        except Exception as e:
            log.warning("job %s: its %s could not be withdrawn: %s", job_id, what, e)


@router.get("/{job_id}", response_model=JobPublic, responses=ERRORS)
def read_job(job: OwnedJobDep) -> JobPublic:
    """The job's record: poll `status` until succeeded, failed or cancelled."""
    return JobPublic.from_record(job)


@router.get("/{job_id}/result", responses={200: RESULT, **ERRORS})
async def read_result(
    job: OwnedJobDep, storage: StorageDep, format: ResultFormat = ResultFormat.json
) -> Response:
    """The transcript of a succeeded job: `json` (whisperfleet's result), `verbose_json`
    (OpenAI's shape), `text`, `srt` or `vtt`."""
    if job.status is not JobStatus.succeeded:
        why = f": {job.error.message}" if job.error else ""
        raise ApiError(409, "not_ready", f"job {job.id} is {job.status}{why}")
    stored = await run_in_threadpool(storage.get, job.result_key)
    writer = WRITERS[format]
    return Response(
        writer.render(TranscriptResult.model_validate_json(stored)), media_type=writer.media_type
    )
