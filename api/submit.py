"""Taking a job in: the one path from a request to a queued job, for every route that makes one.

In order: Redis answers (else 503 before a byte is stored); an `Idempotency-Key` already used
answers its first job (`api.idempotency`); the tenant's limits (429 with Retry-After); the
input, uploaded (streamed into storage, `api.upload`) or named (`s3://`, inside the tenant's
sources, its first bytes inspected where it lies); the options; then the record and the
message. Whatever fails on the way is undone: nothing of a refused job stays.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Annotated

from botocore.exceptions import ClientError
from celery import Celery
from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool

from api.deps import QueueDep, SettingsDep, StorageDep, StoreDep, TenantDep, TenantsDep
from api.errors import ApiError
from api.idempotency import Idempotency, fingerprint
from api.upload import FORM_FIELDS, Discard, Upload, receive_upload
from worker.contract.dispatch import dispatch
from worker.contract.jobs import JobInput, JobRecord, JobStore, input_key, new_job_id
from worker.contract.options import JobCreate, SourceJob
from worker.contract.settings import Settings
from worker.contract.tenants import Limits, TenantError, Tenants, parse_source
from worker.contract.uploads import HEAD_BYTES, Inspector
from worker.storage import ObjectWriter, Storage
from worker.webhooks.delivery import WebhookRefused, destination

log = logging.getLogger(__name__)

Parse = Callable[[dict[str, str]], JobCreate]
MISSING = ("NoSuchKey", "NoSuchBucket", "404", "AccessDenied", "403")


@dataclass
class Submitter:
    request: Request
    settings: Settings
    store: JobStore
    storage: Storage
    queue: Celery
    tenants: Tenants
    tenant: str
    limits: Limits | None = field(default=None, init=False)  # read by `_begin`
    job_id: str = field(default="", init=False)  # a new job's, with its place taken by `_begin`

    async def upload(
        self, parse: Parse = JobCreate.parse, fields: frozenset[str] = FORM_FIELDS
    ) -> JobRecord:
        """A job from a multipart upload whose fields `parse` reads (the job API's, or
        OpenAI's): fields sent before the file are checked before any of it is stored."""
        claim = await self._begin()
        if claim is not None and not claim.ours:  # a retry: read the body, store nothing
            upload = await self._receive(Discard(), parse, fields)
            parse(upload.fields)  # every field checked (and read) as for a first request
            return await self._replay(claim, upload.fields, upload.digest)
        job_id = self.job_id
        writer, record = self.storage.writer(input_key(self.tenant, job_id)), None
        try:
            upload = await self._receive(writer, parse, fields)
            job = await self._resolve(parse(upload.fields), upload.head.sniffed.kind)
            head = upload.head
            record = self._record(
                job_id,
                job,
                JobInput(
                    kind=job.input,
                    bytes=upload.size,
                    filename=upload.filename,
                    format=head.sniffed.format,
                    frames=head.npy.frames if head.npy else None,
                ),
            )
            await self._enqueue(
                record, claim, fingerprint(self._route, upload.fields, upload.digest)
            )
        except BaseException:
            await run_in_threadpool(
                _withdraw, self.tenant, job_id, writer, self.store, record, claim
            )
            raise
        return record

    async def source(self, job: SourceJob) -> JobRecord:
        """A job on an object already in storage, named by `s3://` URI."""
        claim = await self._begin()
        fields = job.model_dump(exclude_unset=True)
        if claim is not None and not claim.ours:
            return await self._replay(claim, fields)
        record = None
        try:
            bucket, key = _source(job.source, self.limits)
            try:
                size, first = await run_in_threadpool(self.storage.head, key, bucket, HEAD_BYTES)
            except ClientError as e:
                code = e.response.get("Error", {}).get("Code", "")
                if code == "InvalidRange":  # an empty object
                    size, first = 0, b""
                elif code in MISSING:
                    raise ApiError(
                        422, "source_not_found", f"{job.source}: no such object, or not readable"
                    ) from e
                else:
                    raise
            if size == 0:
                raise ApiError(422, "invalid_audio", f"{job.source} is empty")
            head = Inspector(self.settings.max_upload_bytes, self.settings.max_audio_s).judge(
                first, size
            )
            job = await self._resolve(job, head.sniffed.kind)
            record = self._record(
                self.job_id,
                job,
                JobInput(
                    kind=job.input,
                    bytes=size,
                    filename=key.rpartition("/")[2],
                    format=head.sniffed.format,
                    frames=head.npy.frames if head.npy else None,
                ),
                source=job.source,
            )
            await self._enqueue(record, claim, fingerprint(self._route, fields))
        except BaseException:
            await run_in_threadpool(
                _withdraw, self.tenant, self.job_id, None, self.store, record, claim
            )
            raise
        return record

    @property
    def _route(self) -> str:
        return self.request.url.path

    async def _begin(self) -> _Claim | None:
        """Redis answers, the key (if any) is claimed or found claimed, and a new request is
        within the tenant's limits."""
        await run_in_threadpool(self.store.redis.ping)
        claim = None
        if key := self.request.headers.get("idempotency-key"):
            idem = Idempotency(self.store.redis, self.tenant, key, self.settings.idempotency_ttl_s)
            claim = _Claim(idem, await run_in_threadpool(idem.claim))
            if not claim.ours:
                return claim
        try:
            await run_in_threadpool(self._within_limits)
        except BaseException:
            if claim is not None:
                await run_in_threadpool(claim.idem.release)
            raise
        return claim

    def _within_limits(self) -> None:
        self.limits = limits = self.tenants.limits(self.tenant)
        now = time.time()
        counter = f"whisperfleet:rate:{self.tenant}:{int(now // 60)}"
        with self.store.redis.pipeline() as pipe:
            pipe.incr(counter)
            pipe.expire(counter, 120)
            count, _ = pipe.execute()
        if count > limits.jobs_per_minute:
            raise ApiError(
                429,
                "rate_limited",
                f"over {limits.jobs_per_minute} jobs a minute for this tenant",
                {"Retry-After": str(60 - int(now) % 60)},
            )
        self.job_id = new_job_id()  # its place among the tenant's jobs in flight, if one is free
        if not self.store.reserve(self.tenant, self.job_id, limits.jobs_in_flight):
            raise ApiError(
                429,
                "too_many_jobs",
                f"{limits.jobs_in_flight} jobs of this tenant are queued or running; wait for "
                "some to finish",
                {"Retry-After": "5"},
            )

    async def _receive(self, sink, parse: Parse, fields: frozenset[str]) -> Upload:
        def before_file(sent: dict[str, str]) -> None:
            parse(sent).resolve(self.settings, None)

        return await receive_upload(
            self.request,
            sink,
            self.settings.max_upload_bytes,
            self.settings.max_audio_s,
            fields,
            before_file,
        )

    async def _resolve(self, job: JobCreate, kind) -> JobCreate:
        job = job.resolve(self.settings, kind)
        if job.webhook:
            try:
                allowed = self.limits.webhook_networks  # the tenant's, or the fleet's
                await run_in_threadpool(destination, job.webhook, allowed)
            except WebhookRefused as e:
                raise ApiError(422, "invalid_webhook", str(e)) from e
        return job

    def _record(self, job_id: str, job: JobCreate, input: JobInput, source=None) -> JobRecord:
        return JobRecord(
            id=job_id,
            tenant=self.tenant,
            model=job.model,
            options=job.options,
            priority=job.priority,
            input=input,
            source=source,
            webhook=job.webhook,
        )

    async def _enqueue(self, record: JobRecord, claim: _Claim | None, print_: str) -> None:
        await run_in_threadpool(self.store.create, record)
        await run_in_threadpool(dispatch, self.queue, self.store, record)
        if claim is not None:
            await run_in_threadpool(claim.idem.settle, print_, record.id)
            claim.settled = True

    async def _replay(self, claim: _Claim, fields: dict, digest: str = "") -> JobRecord:
        job_id = await claim.idem.replay(fingerprint(self._route, fields, digest))
        record = await run_in_threadpool(self.store.get, job_id)
        if record is None:  # deleted since
            raise ApiError(404, "not_found", f"no job {job_id}")
        return record


def _submitter(
    request: Request,
    settings: SettingsDep,
    store: StoreDep,
    storage: StorageDep,
    queue: QueueDep,
    tenants: TenantsDep,
    tenant: TenantDep,
) -> Submitter:
    return Submitter(request, settings, store, storage, queue, tenants, tenant)


SubmitterDep = Annotated[Submitter, Depends(_submitter)]  # for every route that makes a job


@dataclass
class _Claim:
    idem: Idempotency
    ours: bool
    settled: bool = False


def _source(uri: str, limits: Limits) -> tuple[str, str]:
    try:
        bucket, key = parse_source(uri)
    except TenantError as e:
        raise ApiError(422, "invalid_source", str(e)) from e
    if not limits.may_read(bucket, key):
        raise ApiError(
            403,
            "source_not_allowed",
            f"{uri} is outside the sources this tenant may read (`whisperfleet tenants set`)",
        )
    return bucket, key


def _withdraw(
    tenant: str,
    job_id: str,
    writer: ObjectWriter | None,
    store: JobStore,
    record: JobRecord | None,
    claim: _Claim | None,
) -> None:
    """Undo a submission that was refused or failed halfway, best effort: its record if one
    may have been written (a message already sent for it is then dropped by the worker), its
    place among the tenant's jobs in flight, the input it stored, its claim on an
    Idempotency-Key. What cannot be undone now, with Redis or
    storage away, is left to the orphan sweeper (worker.jobs.orphans) or, for a record, to the
    worker, which fails a job whose input is gone; a claim and a place lapse."""
    steps = []
    if record is not None:  # first: a job without its record is never run
        steps.append(("record", partial(store.delete, record)))
    steps.append(("place in flight", partial(store.release, tenant, job_id)))
    if writer is not None:
        steps.append(("input", writer.abort))
    if claim is not None and not claim.settled:
        steps.append(("idempotency key", claim.idem.release))
    for what, undo in steps:
        try:
            undo()
        except Exception as e:
            log.warning("job %s: its %s could not be withdrawn: %s", job_id, what, e)
