"""Backfills over REST: start one on a prefix, follow it, list, cancel, retry its failures.

The scanner does the work (`worker.backfills.scanner`); these routes write and read its records, and
enter a backfill's schedule for `whisperfleet beat`. Scoped to the tenant as jobs are.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Annotated

from botocore.exceptions import ClientError
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from api.bodies import read_model
from api.deps import SettingsDep, StorageDep, StoreDep, TenantDep, TenantsDep
from api.errors import ApiError, error_answers
from api.idempotency import Idempotency, fingerprint
from api.schemas import BackfillCounts, BackfillList, BackfillPublic, BackfillRun
from worker.backfills.scanner import drop_queued, schedule, unschedule
from worker.contract.backfills import (
    BackfillCreate,
    BackfillError,
    BackfillRecord,
    BackfillStore,
    TooManyBackfills,
    new_backfill_id,
    rate,
    split_prefix,
)
from worker.contract.settings import Settings

router = APIRouter(prefix="/v1/backfills", tags=["backfills"])
ERRORS = error_answers(401, 404, 503)
MISSING = ("NoSuchBucket", "NoSuchKey", "404", "AccessDenied", "403")


def _backfills(request: Request) -> BackfillStore:
    return request.app.state.backfills


BackfillsDep = Annotated[BackfillStore, Depends(_backfills)]


def _owned(backfill_id: str, tenant: TenantDep, backfills: BackfillsDep) -> BackfillRecord:
    """The backfill, if it is the caller's: another tenant's answers as an unknown id."""
    record = backfills.get(backfill_id)
    if record is None or record.tenant != tenant:
        shown = backfill_id if len(backfill_id) <= 64 else f"{backfill_id[:61]}..."
        raise ApiError(404, "not_found", f"no backfill {shown}")
    return record


OwnedBackfillDep = Annotated[BackfillRecord, Depends(_owned)]


def public(backfills: BackfillStore, record: BackfillRecord) -> BackfillPublic:
    counts = backfills.counts(record)
    if record.state != "active":
        status = record.state
    elif record.retrying or record.run.scanned_at is None:
        status = "scanning"
    elif counts.in_flight or counts.run_ended < counts.run_created:
        status = "running"
    else:
        status = "waiting" if record.spec.schedule else "running"  # the last harvest is due
    run = record.run
    return BackfillPublic(
        id=record.id,
        status=status,
        spec=record.spec,
        output=record.output,
        created_at=record.created_at,
        finished_at=record.finished_at,
        run=BackfillRun(
            number=run.number,
            started_at=run.started_at,
            scanned_at=run.scanned_at,
            listed=run.listed,
            excluded=run.excluded,
            skipped=run.skipped,
            created=counts.run_created,
            ended=counts.run_ended,
        ),
        counts=BackfillCounts(
            created=counts.created,
            in_flight=counts.in_flight,
            succeeded=counts.succeeded,
            failed=counts.failed,
            cancelled=counts.cancelled,
            retried=counts.retried,
        ),
        audio_hours=round(counts.audio_s / 3600, 4),
        **rate(record, counts),
        failed_by_code={k: v for k, v in counts.failed_by_code.items() if v > 0},
        failures=backfills.failures(record.id),
        runs_skipped=record.runs_skipped,
        problem=counts.problem,
    )


@router.post(
    "",
    status_code=201,
    response_model=BackfillPublic,
    responses=error_answers(401, 403, 409, 413, 422, 429, 503),
    openapi_extra={
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": BackfillCreate.model_json_schema()}},
        },
    },
)
async def create_backfill(
    request: Request,
    tenant: TenantDep,
    tenants: TenantsDep,
    backfills: BackfillsDep,
    storage: StorageDep,
    settings: SettingsDep,
) -> BackfillPublic:
    """Transcribe every audio object under `source` (and, with a `schedule`, again at each
    scheduled time, the objects that arrived since): each object once, as a `bulk` job made
    while the bulk queue has room; rendered copies and a manifest go under `output`. With an
    `Idempotency-Key`, a retry answers the backfill the first request started."""
    spec = await read_model(request, BackfillCreate)  # the caller is known: read its body
    idem = None
    print_ = fingerprint(request.url.path, spec.model_dump(mode="json", exclude_unset=True))
    if key := request.headers.get("idempotency-key"):
        idem = Idempotency(backfills.redis, tenant, key, settings.idempotency_ttl_s)
        if not await run_in_threadpool(idem.claim):
            backfill_id = await idem.replay(print_)
            record = await run_in_threadpool(backfills.get, backfill_id)
            if record is None:
                raise ApiError(404, "not_found", f"no backfill {backfill_id}")
            return await run_in_threadpool(public, backfills, record)
    try:
        record = await run_in_threadpool(
            _create, spec, request, tenant, tenants, backfills, storage, settings
        )
    except BaseException:
        if idem is not None:
            await run_in_threadpool(idem.release)
        raise
    if idem is not None:
        await run_in_threadpool(idem.settle, print_, record.id)
    return await run_in_threadpool(public, backfills, record)


def _create(spec, request, tenant, tenants, backfills, storage, settings) -> BackfillRecord:
    spec = spec.resolve(settings, tenants.limits(tenant))
    if backfills.active_count(tenant) >= settings.backfill_max_active:  # before any write
        raise _too_many(settings)
    backfill_id = new_backfill_id()
    output = spec.output or f"s3://{settings.s3_bucket}/backfills/{tenant}/{backfill_id}/"
    if output.startswith(spec.source) or spec.source.startswith(output):
        raise ApiError(
            422,
            "invalid_option",
            "output and source overlap: the outputs would be listed as the archive's objects",
        )
    bucket, prefix = split_prefix(spec.source)
    _storage_call(storage.listing, "source_not_found", spec.source, bucket, prefix, None, 1)
    # the manifest's empty first part: the output is writable before anything is made
    bucket, prefix = split_prefix(output)
    first = f"{prefix}_manifest/{0:09d}.jsonl"
    _storage_call(
        storage.put, "output_not_found", output, first, b"", "application/x-ndjson", bucket
    )
    record = BackfillRecord(id=backfill_id, tenant=tenant, spec=spec, output=output)
    if spec.schedule:
        schedule(request.app.state.backfill_celery, record)
    try:
        backfills.create(record, settings.backfill_max_active)
    except BaseException as e:  # best effort; an entry left behind is removed when it fires
        if spec.schedule:
            unschedule(request.app.state.backfill_celery, record.id)
        storage.delete(first, bucket)
        if isinstance(e, TooManyBackfills):  # another start took the last place meanwhile
            raise _too_many(settings) from e
        raise
    return record


def _too_many(settings: Settings) -> ApiError:
    return ApiError(
        429,
        "too_many_backfills",
        f"{settings.backfill_max_active} backfills of this tenant are active; wait for one to "
        "finish, or cancel one",
        {"Retry-After": "60"},
    )


def _storage_call(call, code: str, uri: str, *args):
    """A check of a bucket the tenant named: missing or refused is the tenant's 422."""
    try:
        return call(*args)
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") in MISSING:
            raise ApiError(422, code, f"{uri}: no such bucket, or not allowed") from e
        raise


@router.get("", response_model=BackfillList, responses=ERRORS)
def list_backfills(
    tenant: TenantDep,
    backfills: BackfillsDep,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    cursor: Annotated[
        str | None, Query(max_length=64, pattern=r"^[0-9]{17}:bf_[0-9a-f]{24}$")
    ] = None,
) -> BackfillList:
    """The tenant's backfills, newest first; pass `next_cursor` back as `cursor`."""
    records, next_cursor = backfills.page(tenant, limit, cursor)
    return BackfillList(data=[public(backfills, r) for r in records], next_cursor=next_cursor)


@router.get("/{backfill_id}", response_model=BackfillPublic, responses=ERRORS)
def read_backfill(record: OwnedBackfillDep, backfills: BackfillsDep) -> BackfillPublic:
    """Where the backfill stands: counts by state, audio hours, rate, ETA, failures."""
    return public(backfills, record)


@router.get(
    "/{backfill_id}/manifest",
    responses={
        200: {
            "description": "JSON lines, one per ended job (key, job_id, status, error, "
            "audio_s, results), in the order they ended; a retried object has a later line",
            "content": {"application/x-ndjson": {"schema": {"type": "string"}}},
        },
        **ERRORS,
    },
)
def read_manifest(record: OwnedBackfillDep, storage: StorageDep) -> StreamingResponse:
    """The manifest so far: its parts under the output prefix, one after the other."""
    bucket, prefix = split_prefix(record.output)

    def parts() -> Iterator[bytes]:
        after = None
        while True:
            objects, more = storage.listing(bucket, f"{prefix}_manifest/", after)
            for o in objects:
                yield storage.get(o["Key"], bucket)
            if not more or not objects:
                return
            after = objects[-1]["Key"]

    return StreamingResponse(parts(), media_type="application/x-ndjson")


@router.delete("/{backfill_id}", response_model=BackfillPublic, responses=ERRORS)
async def cancel_backfill(
    record: OwnedBackfillDep,
    request: Request,
    backfills: BackfillsDep,
    store: StoreDep,
    settings: SettingsDep,
) -> BackfillPublic:
    """Cancel: no more jobs are made, no more runs scheduled, its queued jobs are cancelled;
    running ones finish (and are in the manifest). A finished backfill is answered as it is;
    a cancelled one's cancel is done again, to its end: one cut short (the schedule store away,
    503) left beat's entry and queued jobs behind."""
    if record.state in ("active", "cancelled"):

        def cancel(r: BackfillRecord) -> BackfillRecord:
            if r.state != "active":
                return r
            return r.model_copy(update={"state": "cancelled", "finished_at": datetime.now(UTC)})

        record = await run_in_threadpool(backfills.update, record.id, cancel)
        await run_in_threadpool(unschedule, request.app.state.backfill_celery, record.id)
        await run_in_threadpool(
            drop_queued, backfills, store, record.id, settings.cancelled_retention_s
        )
    return await run_in_threadpool(public, backfills, record)


@router.post(
    "/{backfill_id}/retry",
    status_code=202,
    response_model=BackfillPublic,
    responses=error_answers(401, 404, 409, 503),
)
def retry_backfill(record: OwnedBackfillDep, backfills: BackfillsDep) -> BackfillPublic:
    """Run the backfill's failed objects again, each as a new job (at the scanner's pace);
    a done backfill becomes active until they end."""
    if record.state == "cancelled":
        raise ApiError(409, "backfill_cancelled", "a cancelled backfill is not retried")

    def retry(r: BackfillRecord) -> BackfillRecord:
        if r.state == "cancelled":
            raise BackfillError("cancelled")
        return r.model_copy(update={"retrying": True, "state": "active", "finished_at": None})

    try:
        record = backfills.retry(record.id, retry)
    except BackfillError as e:
        raise ApiError(409, "backfill_cancelled", "a cancelled backfill is not retried") from e
    return public(backfills, record)
