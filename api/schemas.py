"""What the REST API returns; distinct from the worker's job record (no tenant, no keys)."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel

from worker.contract.jobs import JobError, JobInput, JobRecord, JobStatus, Progress
from worker.contract.options import JobOptions, Priority


class JobPublic(BaseModel):
    id: str
    status: JobStatus
    model: str
    options: JobOptions
    priority: Priority
    input: JobInput
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    attempts: int
    progress: Progress
    error: JobError | None

    @classmethod
    def from_record(cls, record: JobRecord) -> JobPublic:
        return cls.model_validate(record.model_dump(exclude={"tenant"}))


class Health(BaseModel):
    status: str
    checks: dict[str, str] = {}
