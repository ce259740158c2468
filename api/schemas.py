"""What the REST API returns; distinct from the worker's job record (no tenant, no keys)."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from worker.contract.backfills import BackfillCreate
from worker.contract.formats import WRITERS
from worker.contract.jobs import (
    BackfillRef,
    JobError,
    JobInput,
    JobRecord,
    JobStatus,
    Progress,
)
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
    backfill: BackfillRef | None = Field(
        None, description="the backfill (and its run) that made it, if one did"
    )

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


class BackfillCounts(BaseModel):
    """Its jobs, over all its runs."""

    created: int = Field(description="jobs made")
    in_flight: int = Field(description="jobs queued or running")
    succeeded: int
    failed: int = Field(description="failed and not retried")
    cancelled: int
    retried: int = Field(description="failed jobs run again by `retry`")


class BackfillRun(BaseModel):
    """The current (or last) pass over the prefix."""

    number: int
    started_at: datetime
    scanned_at: datetime | None = Field(description="when its listing was read to the end")
    listed: int = Field(description="keys read from the listing")
    excluded: int = Field(description="... left out by the patterns")
    skipped: int = Field(
        description="... whose job existed (an earlier run, or another backfill with the "
        "same model and options)"
    )
    created: int = Field(description="jobs this run made")
    ended: int = Field(description="... of which ended")


class BackfillFailure(BaseModel):
    source: str | None
    job_id: str
    code: str
    message: str


class BackfillPublic(BaseModel):
    id: str
    status: Literal["scanning", "running", "waiting", "done", "cancelled"] = Field(
        description="scanning: listing (or retrying) and making jobs; running: listed, jobs "
        "in flight; waiting: its run is over, the next comes on schedule; done; cancelled"
    )
    spec: BackfillCreate
    output: str = Field(description="where the rendered copies and the manifest go")
    created_at: datetime
    finished_at: datetime | None
    run: BackfillRun
    counts: BackfillCounts
    audio_hours: float = Field(description="of the jobs that succeeded, all runs")
    files_per_s: float = Field(description="jobs ended a second, this run")
    audio_s_per_s: float = Field(description="seconds of audio transcribed a second, this run")
    eta_s: float | None = Field(description="until this run's jobs end; null while listing")
    failed_by_code: dict[str, int]
    failures: list[BackfillFailure] = Field(
        description="the latest, newest first; all are in the manifest"
    )
    runs_skipped: int = Field(description="scheduled times that found the last run listing")
    problem: str | None = Field(
        description="what keeps the scanner from going on with it now (storage refusing, "
        "say); it is tried again until this clears"
    )


class BackfillList(BaseModel):
    data: list[BackfillPublic] = Field(description="newest first")
    next_cursor: str | None
