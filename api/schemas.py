"""What the REST API returns; distinct from the worker's job record (no tenant, no keys)."""

from __future__ import annotations

from datetime import datetime

from pydantic import BaseModel, Field

from worker.contract.formats import WRITERS
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
    source: str | None = Field(description="the s3:// input it was submitted with, if any")
    webhook: str | None

    @classmethod
    def from_record(cls, record: JobRecord) -> JobPublic:
        return cls.model_validate(record.model_dump(include=set(cls.model_fields)))


class JobList(BaseModel):
    data: list[JobPublic] = Field(description="newest first")
    next_cursor: str | None = Field(
        description="pass as `cursor` for the next page; null: this was the last"
    )


class ResultUrl(BaseModel):
    url: str = Field(description="a presigned GET of the stored json result")
    expires_at: datetime


class Health(BaseModel):
    status: str
    checks: dict[str, str] = {}


def text_results() -> dict[str, dict]:
    """OpenAPI `content` of the result formats that are text (srt, vtt, plain text), each
    under its media type; the JSON ones are described by their models."""
    return {
        w.media_type: {"schema": {"type": "string"}}
        for w in WRITERS.values()
        if w.media_type != WRITERS["json"].media_type
    }
