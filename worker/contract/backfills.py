"""Backfills: every audio object under a storage prefix transcribed once, in the background,
and again on a schedule for the objects that arrived since.

Light on purpose (no torch, no FastAPI): the API makes and reads backfills, the scanner
(`worker.backfills.scanner`) runs them, and the job store counts their jobs' ends (`JobStore`,
in the same transaction that ends a job, so each end is counted once whoever ends it).

A backfill's jobs are ordinary `bulk` jobs on `s3://` sources, with an id derived from what
makes the result (`object_job_id`): an object whose job exists is never given a second one,
by a rerun, a resumed scan or another backfill of the tenant with the same model and options.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal

import redis
from celery.schedules import crontab
from pydantic import BaseModel, ConfigDict, Field, field_validator

from worker.contract.jobs import RECENT_FAILURES, backfill_key, watched
from worker.contract.options import JobCreate, JobOptions, OptionError
from worker.contract.settings import Settings
from worker.contract.tenants import Limits, TenantError, check_source_prefix

AUDIO_EXTENSIONS = ("wav", "flac", "ogg", "oga", "opus", "mp3", "m4a", "mp4", "aac", "webm", "npy")
OutputFormat = Literal["json", "srt", "vtt", "text"]
MIN_EVERY_S = 10  # the shortest `@every` schedule
MAX_PATTERNS = 32
_EVERY = re.compile(r"@every\s+(\d+)\s*(s|m|h)")
_UNIT_S = {"s": 1, "m": 60, "h": 3600}
_ALIASES = {
    "@hourly": "0 * * * *",
    "@daily": "0 0 * * *",
    "@nightly": "0 2 * * *",
    "@weekly": "0 0 * * 0",
    "@monthly": "0 0 1 * *",
}


def parse_schedule(text: str) -> crontab | timedelta:
    """A schedule as written: five cron fields (minute hour day-of-month month day-of-week,
    in UTC), an alias (@hourly, @daily, @nightly = 02:00, @weekly, @monthly), or `@every N`
    with s, m or h (at least MIN_EVERY_S). ValueError says what is wrong."""
    text = " ".join(text.split())
    if m := _EVERY.fullmatch(text):
        seconds = int(m[1]) * _UNIT_S[m[2]]
        if seconds < MIN_EVERY_S:
            raise ValueError(f"schedule {text!r}: at least every {MIN_EVERY_S} s")
        return timedelta(seconds=seconds)
    fields = _ALIASES.get(text, text).split()
    if len(fields) != 5:
        raise ValueError(
            f"schedule {text[:80]!r}: expected five cron fields (minute hour day month "
            "weekday), @hourly, @daily, @nightly, @weekly, @monthly, or @every <n>s|m|h"
        )
    minute, hour, day, month, weekday = fields
    try:
        return crontab(
            minute=minute,
            hour=hour,
            day_of_month=day,
            month_of_year=month,
            day_of_week=weekday,
        )
    except Exception as e:  # celery's parser raises ValueError or its own ParseException
        raise ValueError(f"schedule {text[:80]!r}: {e}") from None


def min_gap_s(schedule: crontab | timedelta) -> float:
    """Two scheduled runs closer than this are one run delivered twice: half the interval, or
    30 s for cron (whose resolution is a minute)."""
    return schedule.total_seconds() / 2 if isinstance(schedule, timedelta) else 30.0


def split_prefix(uri: str) -> tuple[str, str]:
    """`s3://bucket/prefix/` as (bucket, prefix); TenantError if it is not one."""
    uri = check_source_prefix(uri)
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    return bucket, prefix


class BackfillCreate(JobOptions):
    """What a backfill transcribes, how, where its outputs go, and when it runs again."""

    model_config = ConfigDict(extra="forbid")

    source: str = Field(
        description="s3://bucket/prefix/ of the archive, inside the sources the tenant may read",
        examples=["s3://archive/calls/2026/"],
    )
    include: list[str] = Field(
        default_factory=list,
        max_length=MAX_PATTERNS,
        description="globs on each key below the prefix (`*` spans `/`): only matching keys; "
        "none: all",
        examples=[["*.flac", "team-a/*"]],
    )
    exclude: list[str] = Field(
        default_factory=list,
        max_length=MAX_PATTERNS,
        description="globs on each key below the prefix: matching keys are left out",
    )
    extensions: list[str] = Field(
        default_factory=lambda: list(AUDIO_EXTENSIONS),
        max_length=MAX_PATTERNS,
        description="file extensions taken (case ignored); an empty list takes any",
    )
    modified_since: datetime | None = Field(
        None, description="only objects last modified at or after this time (ISO 8601)"
    )
    model: str | None = Field(None, description="a model the server serves; omitted: its default")
    output: str | None = Field(
        None,
        description="s3://bucket/prefix/ for the rendered copies and the manifest, inside the "
        "tenant's sources; omitted: the service's bucket, under backfills/<tenant>/<id>/",
    )
    formats: list[OutputFormat] = Field(
        default_factory=lambda: ["json"],
        description="rendered copies written beside each other under the output prefix (json "
        "always)",
    )
    schedule: str | None = Field(
        None,
        max_length=100,
        description="run again on this schedule, for objects not transcribed yet: five cron "
        "fields in UTC, @hourly, @daily, @nightly (02:00), @weekly, @monthly or @every <n>s|m|h",
        examples=["@nightly", "30 1 * * *"],
    )

    @field_validator("source", "output")
    @classmethod
    def _prefix(cls, value: str | None) -> str | None:
        if value is None:
            return None
        try:
            return check_source_prefix(value)
        except TenantError as e:
            raise ValueError(str(e)) from None

    @field_validator("include", "exclude")
    @classmethod
    def _globs(cls, value: list[str]) -> list[str]:
        for glob in value:
            if not glob or len(glob) > 256:
                raise ValueError("a pattern is 1 to 256 characters")
        return value

    @field_validator("extensions")
    @classmethod
    def _extensions(cls, value: list[str]) -> list[str]:
        cleaned = [e.lower().lstrip(".") for e in value]
        if any(not re.fullmatch(r"[a-z0-9]{1,10}", e) for e in cleaned):
            raise ValueError("an extension is 1 to 10 letters or digits (flac, wav, ...)")
        return cleaned

    @field_validator("formats")
    @classmethod
    def _json_always(cls, value: list[str]) -> list[str]:
        return ["json", *sorted(set(value) - {"json"})]

    @field_validator("schedule")
    @classmethod
    def _schedule(cls, value: str | None) -> str | None:
        if value is not None:
            parse_schedule(value)
        return value

    @field_validator("modified_since")
    @classmethod
    def _aware(cls, value: datetime | None) -> datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value

    def resolve(self, settings: Settings, limits: Limits) -> BackfillCreate:
        """As the scanner will run it: its model named and able to honour the options, its
        prefixes inside what the tenant may use. OptionError otherwise."""
        job = JobCreate(model=self.model, **self.options.model_dump())
        model = job.resolve(settings, None).model
        bucket, prefix = split_prefix(self.source)
        if not limits.may_read(bucket, prefix):
            raise OptionError(
                "source_not_allowed",
                f"{self.source} is outside the sources this tenant may read "
                "(`whisperfleet tenants set`)",
                status=403,
            )
        if self.output is not None:
            out_bucket, out_prefix = split_prefix(self.output)
            if not limits.may_write(out_bucket, out_prefix):
                raise OptionError(
                    "output_not_allowed",
                    f"{self.output} is outside the prefixes this tenant may write (`whisperfleet "
                    "tenants set --output`; reading a prefix is no grant to write it); omit "
                    "`output` to keep the outputs in the service's bucket",
                    status=403,
                )
        return self.model_copy(update={"model": model})

    @property
    def options(self) -> JobOptions:
        return JobOptions(**{name: getattr(self, name) for name in JobOptions.model_fields})

    def takes(self, relative: str, modified: datetime) -> bool:
        """Whether an object `relative` below the prefix, last modified then, is one to
        transcribe."""
        if self.extensions:
            ext = relative.rpartition(".")[2].lower() if "." in relative else ""
            if ext not in self.extensions:
                return False
        if self.include and not any(fnmatch.fnmatchcase(relative, g) for g in self.include):
            return False
        if any(fnmatch.fnmatchcase(relative, g) for g in self.exclude):
            return False
        return self.modified_since is None or modified >= self.modified_since


# The options job ids were first made of, at any value; an option added since counts only where
# it is set, so that a new option changes no object's job (a rerun after an upgrade skips what
# was done before it).
FIRST_OPTIONS = frozenset(
    {"language", "task", "mode", "prompt", "timestamps", "word_timestamps", "temperature", "seed"}
)


def object_job_id(
    tenant: str, bucket: str, key: str, etag: str, model: str, options: JobOptions
) -> str:
    """The job of one object: the same object (its ETag: the same bytes), model and options
    give the same id, so whoever finds the object again finds its job."""
    chosen = {
        name: value
        for name, value in options.model_dump(mode="json").items()
        if name in FIRST_OPTIONS or value != JobOptions.model_fields[name].default
    }
    what = [tenant, bucket, key, etag.strip('"'), model, chosen]
    blob = json.dumps(what, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def retry_job_id(failed_job_id: str) -> str:
    """The job that retries a failed one: retried twice, still one job."""
    return hashlib.sha256(f"retry:{failed_job_id}".encode()).hexdigest()[:32]


class Run(BaseModel):
    """One pass over the prefix: the first, then one per scheduled time."""

    number: int = 1
    started_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    scanned_at: datetime | None = None  # the listing was read to its end
    cursor: str | None = None  # the last key handled: the scan goes on after it
    listed: int = 0  # keys read from the listing
    excluded: int = 0  # ... left out by the patterns
    skipped: int = 0  # ... whose job existed already (an earlier run, another backfill)


BackfillState = Literal["active", "done", "cancelled"]


class BackfillRecord(BaseModel):
    id: str
    tenant: str
    spec: BackfillCreate  # as resolved: `model` named
    output: str  # s3://bucket/prefix/, resolved
    state: BackfillState = "active"
    created_at: datetime = Field(default_factory=lambda: datetime.now(UTC))
    finished_at: datetime | None = None
    run: Run = Field(default_factory=Run)
    retrying: bool = False  # failed jobs wait to be run again (`retry`)
    runs_skipped: int = 0  # scheduled times that found the last run still scanning

    @property
    def bucket_prefix(self) -> tuple[str, str]:
        return split_prefix(self.spec.source)

    @property
    def listed_as(self) -> str:
        return f"{int(self.created_at.timestamp() * 1e6):017d}:{self.id}"

    def relative(self, key: str) -> str:
        return key[len(self.bucket_prefix[1]) :]


BACKFILL_ID = re.compile(r"bf_[0-9a-f]{24}")


def new_backfill_id() -> str:
    return "bf_" + secrets.token_hex(12)


class BackfillError(RuntimeError):
    """A backfill that is not in a state to do what was asked."""


class TooManyBackfills(BackfillError):
    """The tenant has as many active backfills as it may."""


@dataclass(frozen=True)
class Counts:
    """What a backfill's jobs did, from the counters its jobs' ends move."""

    created: int
    succeeded: int
    failed: int
    cancelled: int
    retried: int
    audio_s: float
    in_flight: int
    run_created: int
    run_ended: int
    run_audio_s: float
    run_last_end: float | None
    failed_by_code: dict[str, int]
    problem: str | None


class BackfillStore:
    """Backfill records under `<prefix>:backfill:<id>`; beside each (`backfill_key`): `counts`
    (a hash the job store moves as its jobs are made and end), `inflight` (its jobs not yet
    ended), `ended` (jobs ended and not yet written to the manifest, in order), `failed`
    (failed job id -> "<error code> <source>"), `retry` (failed jobs `retry` listed for the
    scanner to run again) and `failures` (the latest, with reasons).
    `<prefix>:backfills:active` holds the backfills the scanner looks after,
    `<prefix>:backfills:scanner` the scanners' lock, `<prefix>:tenant:<t>:backfills` a
    tenant's backfills by creation."""

    def __init__(self, client: redis.Redis, prefix: str = "whisperfleet"):
        self.redis, self.prefix = client, prefix
        self.active = f"{prefix}:backfills:active"
        self.lock_key = f"{prefix}:backfills:scanner"

    def key(self, backfill_id: str, part: str = "") -> str:
        return backfill_key(self.prefix, backfill_id, part)

    def _listing(self, tenant: str) -> str:
        return f"{self.prefix}:tenant:{tenant}:backfills"

    def create(self, record: BackfillRecord, max_active: int | None = None) -> None:
        """Store a new backfill; TooManyBackfills where its tenant has `max_active` active
        ones already. Counted and stored in one transaction (watching the active set), so
        starts at the same moment cannot pass the limit together."""

        def write(pipe) -> None:
            if max_active is not None and self.active_count(record.tenant, pipe) >= max_active:
                raise TooManyBackfills(f"{max_active} backfills of this tenant are active")
            pipe.multi()
            pipe.set(self.key(record.id), record.model_dump_json(), nx=True)
            pipe.zadd(self._listing(record.tenant), {record.listed_as: 0})
            pipe.sadd(self.active, record.id)

        watched(self.redis, self.active, write)

    def active_count(self, tenant: str, client=None) -> int:
        """The tenant's backfills that are active (neither done nor cancelled)."""
        client = client or self.redis
        ids = [m.decode() for m in client.smembers(self.active)]
        raws = client.mget([self.key(i) for i in ids]) if ids else []
        records = [BackfillRecord.model_validate_json(r) for r in raws if r]
        return sum(r.tenant == tenant and r.state == "active" for r in records)

    def get(self, backfill_id: str) -> BackfillRecord | None:
        """The record; None for an unknown id, and for any that is not a backfill's (one
        ending in `:counts` names another of its keys)."""
        if not BACKFILL_ID.fullmatch(backfill_id):
            return None
        raw = self.redis.get(self.key(backfill_id))
        return BackfillRecord.model_validate_json(raw) if raw else None

    def update(
        self,
        backfill_id: str,
        change: Callable[[BackfillRecord], BackfillRecord],
        also: Callable[[redis.client.Pipeline], None] | None = None,
    ) -> BackfillRecord:
        """`change(record) -> record` as a compare-and-set; `also(pipe)` adds commands to the
        same transaction. An active backfill is (again) one the scanner looks after; it lets
        go of one itself, once nothing of it is left to harvest."""
        key = self.key(backfill_id)

        def write(pipe) -> BackfillRecord:
            raw = pipe.get(key)
            if raw is None:
                raise BackfillError(f"backfill {backfill_id} does not exist")
            updated = change(BackfillRecord.model_validate_json(raw))
            pipe.multi()
            pipe.set(key, updated.model_dump_json())
            if updated.state == "active":
                pipe.sadd(self.active, backfill_id)
            if also is not None:
                also(pipe)
            return updated

        return watched(self.redis, key, write)

    def page(
        self, tenant: str, limit: int, cursor: str | None = None
    ) -> tuple[list[BackfillRecord], str | None]:
        """The tenant's backfills, newest first, after `cursor`, and the next page's cursor."""
        high = f"({cursor}" if cursor else "+"
        members = self.redis.zrevrangebylex(self._listing(tenant), high, "-", 0, limit + 1)
        members = [m.decode() for m in members]
        raws = self.redis.mget([self.key(m.partition(":")[2]) for m in members[:limit]])
        records = [BackfillRecord.model_validate_json(r) for r in raws if r]
        more = len(members) > limit
        return records, (members[limit - 1] if more else None)

    def active_ids(self) -> list[str]:
        return sorted(m.decode() for m in self.redis.smembers(self.active))

    def counts(self, record: BackfillRecord) -> Counts:
        with self.redis.pipeline(transaction=False) as pipe:
            pipe.hgetall(self.key(record.id, "counts"))
            pipe.scard(self.key(record.id, "inflight"))
            raw, in_flight = pipe.execute()
        c = {k.decode(): v.decode() for k, v in raw.items()}
        n = record.run.number

        def num(name: str) -> int:
            return int(float(c.get(name, 0)))

        last = c.get(f"run:{n}:last_end")
        return Counts(
            created=num("created"),
            succeeded=num("succeeded"),
            failed=num("failed"),
            cancelled=num("cancelled"),
            retried=num("retried"),
            audio_s=float(c.get("audio_s", 0)),
            in_flight=in_flight,
            run_created=num(f"run:{n}:created"),
            run_ended=num(f"run:{n}:ended"),
            run_audio_s=float(c.get(f"run:{n}:audio_s", 0)),
            run_last_end=float(last) if last else None,
            failed_by_code={
                k.removeprefix("failed:"): int(v) for k, v in c.items() if k.startswith("failed:")
            },
            problem=c.get("problem"),
        )

    def failures(self, backfill_id: str) -> list[dict]:
        """The latest failures, newest first: key, job id, code, message."""
        raws = self.redis.lrange(self.key(backfill_id, "failures"), 0, RECENT_FAILURES - 1)
        return [json.loads(r) for r in raws]

    def in_flight(self, backfill_id: str) -> list[str]:
        return sorted(m.decode() for m in self.redis.smembers(self.key(backfill_id, "inflight")))

    def set_problem(self, backfill_id: str, problem: tuple[str, str] | None) -> None:
        """What keeps the scanner from going on with the backfill: (the work that failed, in
        words); None: nothing now."""
        counts = self.key(backfill_id, "counts")
        if problem is None:
            self.redis.hdel(counts, "problem", "problem_work")
        else:
            self.redis.hset(counts, mapping={"problem_work": problem[0], "problem": problem[1]})

    def problems(self, backfill_ids: list[str]) -> dict[str, tuple[str, str]]:
        """The problems these backfills show, by id: (the work that failed, in words)."""
        with self.redis.pipeline(transaction=False) as pipe:
            for backfill_id in backfill_ids:
                pipe.hmget(self.key(backfill_id, "counts"), "problem_work", "problem")
            shown = pipe.execute()
        return {
            b: (w.decode(), p.decode())
            for b, (w, p) in zip(backfill_ids, shown, strict=True)
            if w and p
        }

    def retry(self, backfill_id: str, change: Callable[[BackfillRecord], BackfillRecord]):
        """List the backfill's failed jobs for the scanner to run again (moved from `failed`
        to `retry`, where the scanner takes them: one that fails again waits for the next
        call; the latest failures shown go with them), with `change` applied to its record,
        in one transaction."""
        keys = [self.key(backfill_id, "failed"), self.key(backfill_id, "retry")]

        def also(pipe) -> None:
            self._move_all(keys=keys, client=pipe)
            pipe.delete(self.key(backfill_id, "failures"))  # all of them are retried

        return self.update(backfill_id, change, also)

    @property
    def _move_all(self):
        return self.redis.register_script(
            "local all = redis.call('hgetall', KEYS[1]) "
            "for i = 1, #all, 2 do redis.call('hset', KEYS[2], all[i], all[i + 1]) end "
            "redis.call('del', KEYS[1]) return #all / 2"
        )

    # the scanners' lock: one scanner works at a time, the others wait to take over

    def lock(self, token: str, ttl_s: float) -> bool:
        """Take (or, held by `token`, renew) the scanners' lock for `ttl_s`."""
        if self.redis.set(self.lock_key, token, nx=True, px=int(ttl_s * 1000)):
            return True
        return bool(self._renew(keys=[self.lock_key], args=[token, int(ttl_s * 1000)]))

    def unlock(self, token: str) -> None:
        """Let go of the scanners' lock, if `token` holds it: a scanner stopping cleanly hands
        over at once rather than when the lock lapses."""
        self._release(keys=[self.lock_key], args=[token])

    @property
    def _renew(self):
        return self.redis.register_script(
            "if redis.call('get', KEYS[1]) == ARGV[1] then "
            "return redis.call('pexpire', KEYS[1], ARGV[2]) else return 0 end"
        )

    @property
    def _release(self):
        return self.redis.register_script(
            "if redis.call('get', KEYS[1]) == ARGV[1] then "
            "return redis.call('del', KEYS[1]) else return 0 end"
        )


def rate(record: BackfillRecord, counts: Counts, now: float | None = None) -> dict:
    """The current run's throughput and ETA: files and audio seconds a second since it
    started (to its last end once nothing is in flight); the ETA once its listing is read."""
    now = time.time() if now is None else now
    start = record.run.started_at.timestamp()
    end = now if counts.in_flight or counts.run_last_end is None else counts.run_last_end
    elapsed = max(end - start, 1e-3)
    files_per_s = counts.run_ended / elapsed
    eta = None
    if record.run.scanned_at is not None and not record.retrying:
        left = counts.in_flight
        eta = 0.0 if left == 0 else (left / files_per_s if files_per_s > 0 else None)
    return {
        "files_per_s": round(files_per_s, 3),
        "audio_s_per_s": round(counts.run_audio_s / elapsed, 3),
        "eta_s": None if eta is None else round(eta, 1),
    }
