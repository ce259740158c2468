"""Request dependencies as named `Annotated` aliases."""

from __future__ import annotations

from typing import Annotated

from celery import Celery
from fastapi import Depends, Request

from api.errors import ApiError
from worker.contract.jobs import DEFAULT_TENANT, JobRecord, JobStore
from worker.contract.settings import Settings
from worker.storage import Storage


def _settings(request: Request) -> Settings:
    return request.app.state.settings


def _store(request: Request) -> JobStore:
    return request.app.state.store


def _storage(request: Request) -> Storage:
    return request.app.state.storage


def _queue(request: Request) -> Celery:
    return request.app.state.celery


def _tenant() -> str:
    """The caller's tenant. The local stack is open: everyone is `default` until API keys."""
    return DEFAULT_TENANT


SettingsDep = Annotated[Settings, Depends(_settings)]
StoreDep = Annotated[JobStore, Depends(_store)]
StorageDep = Annotated[Storage, Depends(_storage)]
QueueDep = Annotated[Celery, Depends(_queue)]
TenantDep = Annotated[str, Depends(_tenant)]


def _owned_job(job_id: str, tenant: TenantDep, store: StoreDep) -> JobRecord:
    record = store.get(job_id)
    if record is None or record.tenant != tenant:
        raise ApiError(404, "not_found", f"no job {job_id}")
    return record


OwnedJobDep = Annotated[JobRecord, Depends(_owned_job)]
