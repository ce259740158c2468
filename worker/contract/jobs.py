"""The job contract: record, states, storage keys and queues, kept in Redis.

Light on purpose (no torch, no FastAPI): the API writes records, the worker moves them.
States: queued -> running -> succeeded | failed, plus cancelled; a record in a terminal state
never changes again. Transitions are compare-and-set (WATCH/MULTI), so two deliveries of one
message cannot both move a job.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from enum import StrEnum

import redis
from pydantic import BaseModel, Field

from worker.contract.options import InputKind, JobOptions, Priority, values

QUEUES = values(Priority)  # consumed in this order: interactive work goes first
TASK_NAME = "whisperfleet.transcribe"
DEFAULT_TENANT = "default"
RECENT_FAILURES = 50  # kept on a backfill, with their reasons; all are in its manifest


class JobStatus(StrEnum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


TERMINAL = frozenset({JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled})
TRANSITIONS: dict[JobStatus, frozenset[JobStatus]] = {
    # queued -> succeeded: a worker whose lease lapsed (Redis away, storage frozen) finished
    # after its job was queued again; its result, the only one (conditional put), stands
    JobStatus.queued: frozenset(
        {JobStatus.running, JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled}
    ),
    # running -> running: a redelivery after a worker died mid-job starts a new attempt;
    # running -> queued: a transient error, retried later
    JobStatus.running: frozenset(
        {
            JobStatus.running,
            JobStatus.queued,
            JobStatus.succeeded,
            JobStatus.failed,
            JobStatus.cancelled,
        }
    ),
}


class JobError(BaseModel):
    code: str  # e.g. invalid_audio, unknown_model, poison, internal
    message: str


class JobInput(BaseModel):
    kind: InputKind
    bytes: int
    filename: str | None = None  # as the client named it; never used in a storage key
    format: str  # as sniffed from the header: wav, flac, ogg, mp3, mp4, webm, aac, npy
    frames: int | None = None  # spectrogram frames (100 per second), from the .npy header


class Progress(BaseModel):
    done_s: float = 0.0
    total_s: float | None = None


class BackfillRef(BaseModel):
    """The backfill (and its run) that made a job (worker.contract.backfills)."""

    id: str
    run: int


class JobRecord(BaseModel):
    id: str
    tenant: str = DEFAULT_TENANT
    status: JobStatus = JobStatus.queued
    model: str
    options: JobOptions = Field(default_factory=JobOptions)
    priority: Priority = "interactive"
    input: JobInput
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    started_at: datetime | None = None
    finished_at: datetime | None = None
    attempts: int = 0  # starts
    # A start that never ended (its worker died under it, for whatever reason) sends the job
    # to the quarantine lane, where it runs alone; deaths there are evidence against the job.
    quarantined: bool = False
    quarantine_deaths: int = 0
    worker: str | None = None  # the worker that ran (or runs) the latest attempt
    # the input named by the client (s3://bucket/key): read, never written or deleted; None:
    # the input was uploaded, and is the job's own object (`input_key`)
    source: str | None = None
    webhook: str | None = None  # posted the record on the terminal state (worker.webhooks.delivery)
    backfill: BackfillRef | None = None  # its end is counted on the backfill
    progress: Progress = Field(default_factory=Progress)
    error: JobError | None = None

    @property
    def input_key(self) -> str:
        return input_key(self.tenant, self.id)

    @property
    def input_location(self) -> tuple[str | None, str]:
        """(bucket, key) of the input: the tenant's source, or (None: the job bucket) the
        uploaded object."""
        if self.source is None:
            return None, self.input_key
        bucket, _, key = self.source.removeprefix("s3://").partition("/")
        return bucket, key

    @property
    def owned_keys(self) -> list[str]:
        """The objects this job created, deleted with it: never a tenant's own source."""
        own = [self.result_key]
        return own if self.source else [self.input_key, *own]

    @property
    def listed_as(self) -> str:
        """Its member in the tenant's list: sorted by creation, then id."""
        return f"{int(self.created_at.timestamp() * 1e6):017d}:{self.id}"

    @property
    def result_key(self) -> str:
        return result_key(self.tenant, self.id)


# KEYS: the active set, then records; ARGV: now, then (record as read, as it is to be, job id)
# for each record: written, and its job's place among the active ones renewed, if unchanged
# a place among a tenant's jobs in flight, taken only while there is one (KEYS: its set of
# jobs in flight, its places taken; ARGV: the job's id, the limit, now, when the place lapses)
_RESERVE = """
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', ARGV[3])
if redis.call('SCARD', KEYS[1]) + redis.call('ZCARD', KEYS[2]) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[1])
return 1
"""
# how long a place taken for a job being submitted is held (its upload) unless the job is made
RESERVATION_S = 3600.0

_SET_PROGRESS = """
local written = 0
for i = 2, #KEYS do
  local at = 3 * i - 4
  if redis.call('get', KEYS[i]) == ARGV[at] then
    redis.call('set', KEYS[i], ARGV[at + 1])
    redis.call('zadd', KEYS[1], ARGV[1], ARGV[at + 2])
    written = written + 1
  end
end
return written
"""


def watched(client: redis.Redis, key: str, work):
    """A compare-and-set on `key`: `work(pipe)` reads (the pipeline is watching `key`), calls
    `pipe.multi()` and queues its writes, which then run only if nobody changed `key` in
    between; else it runs again. Returns what `work` returned; a `work` that queues nothing
    writes nothing."""
    with client.pipeline() as pipe:
        while True:
            try:
                pipe.watch(key)
                result = work(pipe)
                if pipe.explicit_transaction:
                    pipe.execute()
                return result
            except redis.WatchError:
                continue


# A backfill job's end is marked in hash `<prefix>:ended:<first 4 characters of its id>`:
# 65,536 small hashes, each Redis's compact encoding while it holds at most 128 fields
# (hash-max-listpack-entries): about 40 bytes an object up to some 8 million objects.
ENDED_BUCKET = 4


def backfill_key(prefix: str, backfill_id: str, part: str = "") -> str:
    """Where a backfill's record (part "") and its counters, sets and lists live."""
    return f"{prefix}:backfill:{backfill_id}" + (f":{part}" if part else "")


def new_job_id() -> str:
    return uuid.uuid4().hex


def input_key(tenant: str, job_id: str) -> str:
    return f"jobs/{tenant}/{job_id}/input"


def result_key(tenant: str, job_id: str) -> str:
    return f"jobs/{tenant}/{job_id}/result.json"


class TransitionError(RuntimeError):
    """The job is not in a state that allows the requested move."""


@dataclass(frozen=True)
class Read:
    """A record as stored (the bytes a compare-and-set by value compares) and as parsed."""

    raw: bytes
    record: JobRecord


@dataclass(frozen=True)
class Page:
    records: list[JobRecord]
    cursor: str | None  # where the next page starts; None: this was the last


class JobStore:
    """Job records as JSON strings under `whisperfleet:job:<id>`.

    Beside them, for the reconciler: `:active`, the jobs not yet terminal (a sorted set, scored
    by when each was last looked at), and `:sent`, the jobs whose message waits in a queue (set
    after the message is published, cleared when a worker receives it). A queued job missing
    from `:sent` for long has lost its message (Redis lost it, or its receiver died).
    For each tenant: `:tenant:<t>:jobs`, its jobs by creation (a sorted set of `listed_as`
    members, all scored 0, read by lexical range: a cursor is a member, so pages stay
    correct while jobs are added), and `:tenant:<t>:inflight`, its jobs not yet terminal
    (a backfill's are left out: they count against the bulk queue's bound, and would
    otherwise take the tenant's in-flight limit from its own interactive jobs).
    A backfill's job is counted on its backfill (`backfill_key`) in the transaction that makes
    it and in the one that ends it, so each is counted once.
    """

    def __init__(
        self, client: redis.Redis, prefix: str = "whisperfleet", retention_s: float | None = None
    ):
        """retention_s: how long a record stays once it ends (None: until deleted), set in the
        transaction that ends it. A backfill's job is let go by its scanner instead, once it
        wrote the job into the backfill's manifest."""
        self.redis = client
        self.prefix = prefix
        self.retention_s = retention_s
        self.active, self.sent = f"{prefix}:active", f"{prefix}:sent"
        self._set_progress = client.register_script(_SET_PROGRESS)
        self._reserve = client.register_script(_RESERVE)

    def _key(self, job_id: str) -> str:
        return f"{self.prefix}:job:{job_id}"

    def _listing(self, tenant: str) -> str:
        return f"{self.prefix}:tenant:{tenant}:jobs"

    def _inflight(self, tenant: str) -> str:
        return f"{self.prefix}:tenant:{tenant}:inflight"

    def _reserved(self, tenant: str) -> str:
        return f"{self.prefix}:tenant:{tenant}:reserved"

    def reserve(self, tenant: str, job_id: str, limit: int) -> bool:
        """Take a place for `job_id` among the tenant's at most `limit` jobs in flight, if one
        is free: the check and the count in one step, so that parallel submissions cannot
        all pass a check that each would fail counted together. `create` turns the place
        into the job's; `release` gives it back; a place neither does lapses after
        RESERVATION_S (a submitter that died)."""
        now = time.time()
        keys = [self._inflight(tenant), self._reserved(tenant)]
        return bool(self._reserve(keys, [job_id, limit, now, now + RESERVATION_S]))

    def release(self, tenant: str, job_id: str) -> None:
        self.redis.zrem(self._reserved(tenant), job_id)

    def create(self, record: JobRecord) -> None:
        """Store a new job's record and its index entries, all or nothing; TransitionError if
        the id is taken (a backfill's ids are derived, and may be found again)."""
        key = self._key(record.id)

        def write(pipe) -> None:
            if pipe.exists(key):
                raise TransitionError(f"job {record.id} already exists")
            pipe.multi()
            pipe.set(key, record.model_dump_json())
            pipe.zadd(self.active, {record.id: time.time()})
            pipe.zadd(self._listing(record.tenant), {record.listed_as: 0})
            if (ref := record.backfill) is None:
                pipe.sadd(self._inflight(record.tenant), record.id)
                pipe.zrem(self._reserved(record.tenant), record.id)
            else:  # bounded by the bulk queue's bound, not the tenant's limit
                counts = backfill_key(self.prefix, ref.id, "counts")
                pipe.sadd(backfill_key(self.prefix, ref.id, "inflight"), record.id)
                pipe.hincrby(counts, "created", 1)
                pipe.hincrby(counts, f"run:{ref.run}:created", 1)

        watched(self.redis, key, write)

    def delete(self, record: JobRecord) -> None:
        """Forget a job: one that was never accepted (its submission failed halfway), or one
        deleted with its objects. A message still queued for it is dropped by the worker,
        which finds no record."""
        with self.redis.pipeline() as pipe:
            pipe.delete(self._key(record.id))
            pipe.zrem(self.active, record.id)
            pipe.hdel(self.sent, record.id)
            pipe.zrem(self._listing(record.tenant), record.listed_as)
            pipe.srem(self._inflight(record.tenant), record.id)
            if record.backfill is not None:  # its object is done again by a later run
                pipe.srem(backfill_key(self.prefix, record.backfill.id, "inflight"), record.id)
                pipe.hdel(*self._ended_mark(record.id))
            pipe.execute()

    def in_flight(self, tenant: str) -> int:
        """The tenant's jobs not yet terminal."""
        return self.redis.scard(self._inflight(tenant))

    def expire(self, job_id: str, after_s: float, client=None) -> None:
        """Let a terminal record go `after_s` from now (the tenant's list forgets it when it
        finds it gone); `client`: a pipeline to queue it on."""
        (client or self.redis).expire(self._key(job_id), max(1, int(after_s)))

    def forget_listed(self, created_before: datetime) -> int:
        """Drop every tenant list's entries of jobs created before `created_before`, by when
        their records are gone (`Settings.record_lifetime_s`): a list is read newest first and
        drops the gone records it meets, but a tenant that never reads its list would keep
        an entry of every job it ever made. How many were dropped."""
        older = f"({int(created_before.timestamp() * 1e6):017d}"
        dropped = 0
        for key in self.redis.scan_iter(match=self._listing("*"), count=1000):
            dropped += self.redis.zremrangebylex(key, "-", older)
        return dropped

    def _ended_mark(self, job_id: str) -> tuple[str, str]:
        """Where a backfill job's end is marked: its hash and field."""
        return f"{self.prefix}:ended:{job_id[:ENDED_BUCKET]}", job_id[ENDED_BUCKET:]

    def ended(self, job_ids: list[str]) -> list[bool]:
        """Whether each of these backfill jobs succeeded or failed, its record kept or not (a
        backfill's records go once harvested; this mark stays, so a rerun still skips the
        object). A cancelled or expired one is not marked: once its record goes, a later run
        makes its job again."""
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.hexists(*self._ended_mark(job_id))
            return [bool(found) for found in pipe.execute()]

    def page(
        self,
        tenant: str,
        limit: int,
        cursor: str | None = None,
        created_after: datetime | None = None,
        status: JobStatus | None = None,
        scan: int = 2000,
    ) -> Page:
        """The tenant's jobs, newest first: at most `limit`, after `cursor` (a page's own),
        created after `created_after`, in `status`. At most `scan` entries are looked at per
        call, so a rare status ends a page early, with a cursor to go on from."""
        listing = self._listing(tenant)
        high = f"({cursor}" if cursor else "+"
        low = "-"
        if created_after is not None:  # ';' sorts after ':': past every id of that microsecond
            low = f"({int(created_after.timestamp() * 1e6):017d};"
        records: list[JobRecord] = []
        looked = 0
        while len(records) < limit and looked < scan:
            batch = min(max(limit - len(records), 50), scan - looked)
            members = [m.decode() for m in self.redis.zrevrangebylex(listing, high, low, 0, batch)]
            if not members:
                return Page(records, None)
            looked += len(members)
            raws = self.redis.mget([self._key(m.partition(":")[2]) for m in members])
            gone = [m for m, raw in zip(members, raws, strict=True) if raw is None]
            if gone:  # records that expired, or were deleted between the two reads
                self.redis.zrem(listing, *gone)
            for member, raw in zip(members, raws, strict=True):
                if raw is None:
                    continue
                record = JobRecord.model_validate_json(raw)
                if status is None or record.status is status:
                    records.append(record)
                    if len(records) == limit:
                        return Page(records, member)
            high = f"({members[-1]}"
        more = self.redis.zrevrangebylex(listing, high, low, 0, 1)
        return Page(records, high[1:] if more else None)

    def exist(self, job_ids: list[str]) -> list[bool]:
        """Whether each job has a record, in one round trip."""
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in job_ids:
                pipe.exists(self._key(job_id))
            return [bool(n) for n in pipe.execute()]

    def mark_sent(self, job_id: str) -> None:
        self.redis.hset(self.sent, job_id, time.time())

    def mark_received(self, job_id: str) -> None:
        """A worker took the job's message: no longer sent, and looked at now (a worker that
        took it but has not started it yet is given `stale_after_s` before a resend)."""
        with self.redis.pipeline() as pipe:
            pipe.hdel(self.sent, job_id)
            pipe.zadd(self.active, {job_id: time.time()}, xx=True)
            pipe.execute()

    def is_sent(self, job_id: str) -> bool:
        return bool(self.redis.hexists(self.sent, job_id))

    def stale(self, older_than_s: float, limit: int = 1000) -> list[str]:
        """Active jobs not looked at for `older_than_s`, oldest first."""
        ids = self.redis.zrangebyscore(
            self.active, "-inf", time.time() - older_than_s, start=0, num=limit
        )
        return [i.decode() for i in ids]

    def touch(self, job_id: str) -> None:
        """Looked at now (only while still active)."""
        self.redis.zadd(self.active, {job_id: time.time()}, xx=True)

    def get(self, job_id: str) -> JobRecord | None:
        raw = self.redis.get(self._key(job_id))
        return JobRecord.model_validate_json(raw) if raw is not None else None

    def get_many(self, job_ids: list[str]) -> list[JobRecord | None]:
        """The records of `job_ids` (None where there is none), in one round trip."""
        return [read and read.record for read in self.read_many(job_ids)]

    def read_many(self, job_ids: list[str]) -> list[Read | None]:
        """The records of `job_ids` as stored and as parsed (None: gone), in one round trip."""
        raws = self.redis.mget([self._key(i) for i in job_ids]) if job_ids else []
        return [Read(r, JobRecord.model_validate_json(r)) if r is not None else None for r in raws]

    def _update(self, job_id: str, change) -> JobRecord:
        """Apply `change(record) -> record` as a compare-and-set on the stored record."""
        key = self._key(job_id)

        def write(pipe) -> JobRecord:
            raw = pipe.get(key)
            if raw is None:
                raise TransitionError(f"job {job_id} does not exist")
            before = JobRecord.model_validate_json(raw)
            updated = change(before)
            pipe.multi()
            ends = updated.status in TERMINAL and before.status not in TERMINAL
            if ends and self.retention_s and updated.backfill is None:
                pipe.set(key, updated.model_dump_json(), ex=max(1, int(self.retention_s)))
            else:  # a terminal record keeps the expiry its retention gave it
                keep = before.status in TERMINAL and updated.status in TERMINAL
                pipe.set(key, updated.model_dump_json(), keepttl=keep)
            if updated.status in TERMINAL:
                pipe.zrem(self.active, job_id)
                pipe.hdel(self.sent, job_id)
                pipe.srem(self._inflight(updated.tenant), job_id)
                if updated.backfill and before.status not in TERMINAL:
                    self._count_end(pipe, updated)
            else:
                pipe.zadd(self.active, {job_id: time.time()})
            return updated

        return watched(self.redis, key, write)

    def _count_end(self, pipe, record: JobRecord) -> None:
        """A backfill's job ended: counted on the backfill, once (in the transaction that
        ends it), marked as done if it was (`ended()`), and handed to its manifest (`ended`)."""
        ref = record.backfill
        counts = backfill_key(self.prefix, ref.id, "counts")
        status = str(record.status)
        if record.status in (JobStatus.succeeded, JobStatus.failed):  # not to be done again
            pipe.hset(*self._ended_mark(record.id), status[0])
        pipe.srem(backfill_key(self.prefix, ref.id, "inflight"), record.id)
        pipe.hincrby(counts, status, 1)
        pipe.hincrby(counts, f"run:{ref.run}:ended", 1)
        pipe.hset(counts, f"run:{ref.run}:last_end", time.time())
        if record.status is JobStatus.succeeded:
            pipe.hincrbyfloat(counts, "audio_s", record.progress.done_s)
            pipe.hincrbyfloat(counts, f"run:{ref.run}:audio_s", record.progress.done_s)
        elif record.status is JobStatus.failed:
            code = record.error.code if record.error else "unknown"
            pipe.hincrby(counts, f"failed:{code}", 1)
            failed = backfill_key(self.prefix, ref.id, "failed")
            pipe.hset(failed, record.id, f"{code} {record.source or ''}")  # for a retry
            failure = {
                "source": record.source,
                "job_id": record.id,
                "code": code,
                "message": record.error.message if record.error else "",
            }
            failures = backfill_key(self.prefix, ref.id, "failures")
            pipe.lpush(failures, json.dumps(failure))
            pipe.ltrim(failures, 0, RECENT_FAILURES - 1)
        pipe.rpush(backfill_key(self.prefix, ref.id, "ended"), record.id)

    def transition(
        self, job_id: str, to: JobStatus, only_from: JobStatus | None = None, **changes
    ) -> JobRecord:
        """Move a job to `to` and apply `changes`, atomically; raise if not allowed (or, with
        `only_from`, if the job is in another state)."""

        def change(record: JobRecord) -> JobRecord:
            if only_from is not None and record.status is not only_from:
                raise TransitionError(f"job {job_id} is {record.status}, not {only_from}")
            if to not in TRANSITIONS.get(record.status, frozenset()):
                raise TransitionError(f"job {job_id} is {record.status}, cannot be {to}")
            now = datetime.now(UTC)
            if to is JobStatus.running:
                changes.update(started_at=now, attempts=record.attempts + 1)
            elif to in TERMINAL:
                changes.update(finished_at=now)
            return record.model_copy(update={"status": to, **changes})

        return self._update(job_id, change)

    def count_quarantine_death(self, job_id: str) -> JobRecord:
        """The job's process in the quarantine lane died running it."""

        def change(record: JobRecord) -> JobRecord:
            return record.model_copy(update={"quarantine_deaths": record.quarantine_deaths + 1})

        return self._update(job_id, change)

    def set_progress_many(self, seen: dict[str, Read], progress: dict[str, Progress]) -> int:
        """Record how far running jobs have come, in one call: each job's record as `seen`
        (`read_many`) with its progress replaced, written only where the record is still
        those bytes (a compare-and-set by value), so a record that moved since it was read
        (cancelled, ended, taken over) keeps its move. Returns how many were written."""
        if not progress:
            return 0
        keys, args = [self.active], [time.time()]
        for job_id, done in progress.items():
            read = seen[job_id]
            keys.append(self._key(job_id))
            to_be = read.record.model_copy(update={"progress": done}).model_dump_json()
            args += [read.raw, to_be, job_id]
        return self._set_progress(keys=keys, args=args)
