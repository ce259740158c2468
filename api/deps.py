"""Request dependencies as named `Annotated` aliases, and the reads the routes share."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated

from celery import Celery
from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from api.errors import ApiError
from worker.contract.jobs import DEFAULT_TENANT, JobRecord, JobStore
from worker.contract.results import TranscriptResult
from worker.contract.settings import Settings
from worker.contract.tenants import Tenants
from worker.storage import Storage, gone

BEARER = {"WWW-Authenticate": "Bearer"}


def _settings(request: Request) -> Settings:
    return request.app.state.settings


def _store(request: Request) -> JobStore:
    return request.app.state.store


def _storage(request: Request) -> Storage:
    return request.app.state.storage


def _queue(request: Request) -> Celery:
    return request.app.state.celery


def _tenants(request: Request) -> Tenants:
    return request.app.state.tenants


SettingsDep = Annotated[Settings, Depends(_settings)]
StoreDep = Annotated[JobStore, Depends(_store)]
StorageDep = Annotated[Storage, Depends(_storage)]
QueueDep = Annotated[Celery, Depends(_queue)]
TenantsDep = Annotated[Tenants, Depends(_tenants)]
bearer = HTTPBearer(auto_error=False, description="an API key: `whisperfleet keys create`")


async def _tenant(
    settings: SettingsDep,
    tenants: TenantsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Security(bearer)],
) -> str:
    """The caller's tenant, from its API key; everyone is `default` where auth is `none`."""
    if settings.auth == "none":
        return DEFAULT_TENANT
    if credentials is None:
        raise ApiError(401, "unauthorized", "send an API key: Authorization: Bearer <key>", BEARER)
    key = await run_in_threadpool(tenants.lookup, credentials.credentials)
    if key is None:
        raise ApiError(401, "invalid_key", "the API key is unknown or revoked", BEARER)
    return key.tenant


TenantDep = Annotated[str, Depends(_tenant)]


def _owned_job(job_id: str, tenant: TenantDep, store: StoreDep) -> JobRecord:
    """The job, if it is the caller's: another tenant's answers exactly as an unknown id."""
    record = store.get(job_id)
    if record is None or record.tenant != tenant:
        shown = job_id if len(job_id) <= 64 else f"{job_id[:61]}..."  # never echo megabytes
        raise ApiError(404, "not_found", f"no job {shown}")
    return record


OwnedJobDep = Annotated[JobRecord, Depends(_owned_job)]


@contextmanager
def result_gone_as_410(job: JobRecord) -> Iterator[None]:
    """A storage call for a succeeded job's result that finds no object answers 410
    `result_gone` (deleted, by hand or a lifecycle rule, or lost by the storage), not 500."""
    try:
        yield
    except Exception as e:
        if gone(e):
            raise ApiError(
                410,
                "result_gone",
                f"job {job.id} succeeded, but its result is no longer in storage (deleted, or "
                "lost by the storage); submit the job again",
            ) from None
        raise


async def stored_result(storage: Storage, job: JobRecord) -> TranscriptResult:
    """A succeeded job's stored result."""
    with result_gone_as_410(job):
        stored = await run_in_threadpool(storage.get, job.result_key)
    return TranscriptResult.model_validate_json(stored)
