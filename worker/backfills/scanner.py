"""The backfill scanner: lists each backfill's prefix a page at a time, makes a `bulk` job for
each object not transcribed yet while the bulk queue has room, and writes what its jobs did
under the backfill's output prefix.

`whisperfleet scanner` (`run`) is a Celery worker of its own on the `backfills` queue, where
`whisperfleet beat` (Celery beat with celery-redbeat's scheduler: one beat at a time holds its
lock in Redis) sends each backfill's scheduled runs; beside it a pump thread does the work, a
step at a time (`Scanner.step`). One scanner works at a time: it holds the scanners' lock in
Redis, renewed beside long steps, and the others wait to take over. Everything a step needs is
in Redis, so a scanner killed at any point is replaced by the next one (or itself, restarted)
once the lock lapses:

- The scan. A page of the listing after the run's cursor: keys the patterns leave out are
  counted, each other object's job id is derived (`object_job_id`) and looked up; an object
  whose job exists or ended is skipped (an earlier run, another backfill, or this step before
  a crash made it), a new one is inspected (its first bytes, the checks an upload gets) and
  made, as `failed` at once if the inspection refuses it. The cursor and the page's counts
  then move in one transaction. A crash mid-page repeats the page: the jobs it made are
  found, not made twice.
- Backpressure. Jobs are made only while fewer than BACKFILL_QUEUE_BOUND messages wait in
  `bulk`, the room shared between the backfills scanning, the least recently served first: a
  small backfill started after a huge one gets its share at the next step.
- The harvest. Jobs that ended (the job store lists them in `ended`, in the transaction that
  ends them) get their rendered copies under the output prefix (`a/b/c.flac` ->
  `<out>/a/b/c.flac.json`, `.srt`, ...) and a line each in the manifest, written as numbered
  parts (`<out>/_manifest/000000001.jsonl`, ...; the API wrote the empty part 0 at the start);
  the list is trimmed after its part is written, and a part written again after a crash holds
  the same lines and more. The records of the jobs written out then expire
  (BACKFILL_JOB_RETENTION_S): the manifest keeps what they said, and the job store's small
  mark of each end (`JobStore.ended`) is what a later run skips, so Redis holds about 40
  bytes per object done rather than its whole record.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from functools import cache

import redis
from botocore.exceptions import BotoCoreError, ClientError
from celery import Celery
from celery.schedules import schedule as every
from celery.signals import worker_ready
from kombu import Exchange, Queue

from worker.app import create_app as create_job_app
from worker.contract.backfills import (
    BackfillError,
    BackfillRecord,
    BackfillStore,
    Run,
    min_gap_s,
    object_job_id,
    parse_schedule,
    retry_job_id,
    split_prefix,
)
from worker.contract.dispatch import dispatch
from worker.contract.formats import WRITERS
from worker.contract.jobs import (
    QUEUES,
    BackfillRef,
    JobError,
    JobInput,
    JobRecord,
    JobStatus,
    JobStore,
    TransitionError,
    watched,
)
from worker.contract.options import OptionError
from worker.contract.results import TranscriptResult
from worker.contract.settings import Settings, get_settings
from worker.contract.uploads import EXPECTED, HEAD_BYTES, Inspector, Sniffed
from worker.logs import configure as configure_logs
from worker.logs import ready, worker_argv
from worker.storage import Storage

log = logging.getLogger(__name__)

BULK = QUEUES[-1]  # the queue consumed after interactive work: a backfill's jobs wait there
BACKFILL_QUEUE = "backfills"
SCHEDULED_TASK = "whisperfleet.backfill.scheduled"
SCHEDULE_TIMEOUT_S = 5.0  # each call to the schedule's Redis, as the API's other calls
LOCK_TTL_S = 15.0  # a scanner killed mid-step holds the scanners' lock this long
IDLE_S = 0.5  # between steps that found nothing to do
HARVEST_BATCH = 500  # jobs per manifest part, at most
PART_EVERY_S = 10.0  # a part holds fewer lines when its first waited this long, or at the end
THREADS = 16  # objects inspected, copies written, at once
MISSING = ("NoSuchKey", "404")


def _uri(bucket: str, key: str) -> str:
    return f"s3://{bucket}/{key}"


class LockLost(RuntimeError):
    """Another scanner took over: what this step did is not written."""


def _problem(error: Exception) -> str:
    """A scanner's failure as its backfill shows it."""
    if isinstance(error, ClientError):
        code = error.response.get("Error", {}).get("Code", "an error")
        operation = getattr(error, "operation_name", "a request")
        return f"storage answered {code} to {operation}; tried again"
    if isinstance(error, redis.RedisError | BotoCoreError | OSError):
        return "storage or Redis is not answering; tried again"
    return "the scanner failed on this backfill; tried again (its log says why)"


class Scanner:
    def __init__(self, settings: Settings, client: redis.Redis, storage: Storage, queue: Celery):
        self.settings, self.storage, self.queue = settings, storage, queue
        self.backfills = BackfillStore(client)
        self.jobs = JobStore(client)
        self.redis = client
        self.token = uuid.uuid4().hex  # this scanner's hold on the scanners' lock
        self.holding = False
        # what each failing backfill shows: (the work that failed, in words); what failed in
        # this step, and what went through (backfill, work)
        self.problems: dict[str, tuple[str, str]] = {}
        self.failing: dict[str, tuple[str, str]] = {}
        self.went_through: set[tuple[str, str]] = set()
        self.pool = ThreadPoolExecutor(THREADS, thread_name_prefix="scanner")
        self.served: dict[str, float] = {}  # when each backfill last got room (fairness)
        self.waiting: dict[str, float] = {}  # since when each has jobs ended, not harvested

    # -- one step

    def step(self) -> bool:
        """Harvest, scan, finish what is done, for every active backfill, if this scanner
        holds the scanners' lock (the others wait, ready to take over); whether there was
        anything to do. A backfill that fails (its bucket gone, say) is reported on it and
        tried again next step; the others go on."""
        if not self._hold():
            return False
        records = [r for r in map(self.backfills.get, self.backfills.active_ids()) if r]
        busy = False
        for record in records:
            busy |= bool(self._guard(record, self.harvest, record))
        scanning = [
            r for r in records if r.state == "active" and (r.run.scanned_at is None or r.retrying)
        ]
        scanning.sort(key=lambda r: self.served.get(r.id, 0.0))
        for i, record in enumerate(scanning):
            room = self.settings.backfill_queue_bound - self.redis.llen(BULK)
            share = -(-room // (len(scanning) - i))  # the room left, shared by those left
            if share <= 0:
                break
            self.served[record.id] = time.monotonic()
            work = self.retry_some if record.retrying else self.scan
            busy |= bool(self._guard(record, work, record, share))
        for record in records:
            if record.state == "cancelled":  # a page made as it was cancelled
                retention = self.settings.cancelled_retention_s
                self._guard(record, drop_queued, self.backfills, self.jobs, record.id, retention)
            self._guard(record, self._finish, record.id)
        self._show_problems()
        return busy

    def _hold(self) -> bool:
        """Take or keep the scanners' lock; taking it, learn what the backfills show (an
        earlier scanner's problems, cleared once their work goes through)."""
        held, self.holding = self.holding, self.backfills.lock(self.token, LOCK_TTL_S)
        if self.holding and not held:
            self.problems = self.backfills.problems(self.backfills.active_ids())
        return self.holding

    def keep(self, stop: threading.Event) -> None:
        """Renew the lock while a step runs long (a slow store, a large page)."""
        while not stop.wait(LOCK_TTL_S / 3):
            if not self.holding:
                continue
            try:
                kept = self._hold()
            except Exception as e:  # Redis away: the lock may lapse; write nothing meanwhile
                self.holding, kept = False, False
                log.warning("scanner: the lock was not renewed (%s: %s)", type(e).__name__, e)
            if not kept:
                log.warning("scanner: the scanners' lock was lost; this step writes nothing")

    def _still_holding(self) -> None:
        """Before a step writes what it did: the lock is still this scanner's."""
        if not self.holding:
            raise LockLost("the scanners' lock went to another scanner")

    def _guard(self, record: BackfillRecord, work, *args):
        """`work(*args)` for one backfill; a failure is logged and noted for the backfill to
        show (`_show_problems`), and never stops the others."""
        name = work.__name__
        try:
            done = work(*args)
        except LockLost:
            raise
        except Exception as e:
            problem = _problem(e)
            if self.problems.get(record.id, (None, None))[1] != problem:
                log.warning("backfill %s: %s (%s: %s)", record.id, problem, type(e).__name__, e)
            self.failing[record.id] = (name, problem)
            return None
        self.went_through.add((record.id, name))
        return done

    def _show_problems(self) -> None:
        """Each backfill shows what failed (in words that name no internal address) until the
        work that failed goes through."""
        shown = {}
        for backfill_id in self.problems.keys() | self.failing.keys():
            before = self.problems.get(backfill_id)
            now = self.failing.get(backfill_id)
            if now is None and (backfill_id, before[0]) not in self.went_through:
                now = before
            if now != before:
                self.backfills.set_problem(backfill_id, now)
            if now is not None:
                shown[backfill_id] = now
        self.problems, self.failing, self.went_through = shown, {}, set()

    # -- the scan

    def scan(self, record: BackfillRecord, share: int) -> int:
        """Go on with the run's listing: make at most `share` jobs, then move the cursor past
        the keys looked at; how many it looked at."""
        bucket, prefix = record.bucket_prefix
        run = record.run
        objects, truncated = self.storage.listing(bucket, prefix, run.cursor)
        spec, options = record.spec, record.spec.options
        ids: list[str | None] = []
        for o in objects:
            key, etag = o["Key"], o.get("ETag", "")
            if spec.takes(record.relative(key), o["LastModified"]):
                ids.append(object_job_id(record.tenant, bucket, key, etag, spec.model, options))
            else:
                ids.append(None)
        taken = [i for i in ids if i]
        known = dict(zip(taken, self.jobs.get_many(taken), strict=True))
        gone = [i for i in taken if known[i] is None]  # never made, or its record went
        ended = {i for i, mark in zip(gone, self.jobs.ended(gone), strict=True) if mark}
        ours = BackfillRef(id=record.id, run=run.number)
        walked, excluded, skipped, new = 0, 0, 0, []
        for o, job_id in zip(objects, ids, strict=True):
            fresh = job_id is not None and known[job_id] is None and job_id not in ended
            if fresh and len(new) == share:
                break
            walked += 1
            if job_id is None:
                excluded += 1
            elif fresh:
                new.append((o, job_id))
            elif job_id in ended or known[job_id].backfill != ours:
                skipped += 1  # made before: by an earlier run, another backfill, a retry
        list(self.pool.map(lambda n: self._make(record, bucket, *n), new))
        cursor = objects[walked - 1]["Key"] if walked else run.cursor
        finished = walked == len(objects) and not truncated

        def advance(r: BackfillRecord) -> BackfillRecord:
            if r.run.number != run.number:
                raise BackfillError(f"backfill {r.id}: run {run.number} was replaced")
            update = {
                "cursor": cursor,
                "listed": r.run.listed + walked,
                "excluded": r.run.excluded + excluded,
                "skipped": r.run.skipped + skipped,
            }
            if finished:
                update["scanned_at"] = datetime.now(UTC)
            return r.model_copy(update={"run": r.run.model_copy(update=update)})

        self._still_holding()
        self.backfills.update(record.id, advance)
        if finished:
            log.info("backfill %s: run %d listed to its end", record.id, run.number)
        return walked

    def _make(self, record: BackfillRecord, bucket: str, obj: dict, job_id: str) -> bool:
        """Make the job of one object (`obj`: its Key and Size): queued, or failed at once
        where its first bytes are refused. False: it exists already, or the object is gone."""
        key, size = obj["Key"], obj["Size"]
        error, fmt, frames = None, "unknown", None
        kind = Sniffed(None, False).kind  # what a file not recognised is taken for
        try:
            if size == 0:
                raise OptionError("invalid_audio", f"the file is empty; {EXPECTED}")
            _, first = self.storage.head(key, bucket, HEAD_BYTES)
            head = Inspector(self.settings.max_upload_bytes, self.settings.max_audio_s).judge(
                first, size
            )
            kind, fmt = head.sniffed.kind, head.sniffed.format
            frames = head.npy.frames if head.npy else None
        except OptionError as e:
            error = JobError(code=e.code, message=str(e))
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") in MISSING:
                log.info("backfill %s: %s is gone since it was listed", record.id, key)
                return False
            raise
        job = JobRecord(
            id=job_id,
            tenant=record.tenant,
            model=record.spec.model,
            options=record.spec.options,
            priority=BULK,
            input=JobInput(
                kind=kind, bytes=size, filename=key.rpartition("/")[2], format=fmt, frames=frames
            ),
            source=_uri(bucket, key),
            backfill=BackfillRef(id=record.id, run=record.run.number),
        )
        return self._add(job, error)

    def _add(self, job: JobRecord, error: JobError | None) -> bool:
        try:
            self.jobs.create(job)
        except TransitionError:  # made by a step that died before its cursor moved
            return False
        if error is not None:
            self.jobs.transition(job.id, JobStatus.failed, error=error)
        else:
            dispatch(self.queue, self.jobs, job)
        return True

    # -- retry

    def retry_some(self, record: BackfillRecord, share: int) -> int:
        """Run again up to `share` of the failed jobs `retry` listed (`BackfillStore.retry`),
        each as a new job on its object as it is now (inspected again, as the scan does); once
        none is left, the backfill stops retrying. A retried job that fails again waits for
        the next `retry`."""
        retry = self.backfills.key(record.id, "retry")
        _, entries = self.redis.hscan(retry, 0, count=share)
        entries = list(entries.items())[:share]
        if not entries:
            self.backfills.update(record.id, lambda r: r.model_copy(update={"retrying": False}))
            return 0
        for job_id, failure in entries:
            job_id = job_id.decode()
            code, _, source = failure.decode().partition(" ")
            bucket, _, key = source.removeprefix("s3://").partition("/")
            try:  # the object as it is now, inspected again
                size, _ = self.storage.head(key, bucket)
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") not in MISSING:
                    raise
                log.info("backfill %s: %s is gone; not retried", record.id, source)
            else:
                self._make(record, bucket, {"Key": key, "Size": size}, retry_job_id(job_id))
            self._forget_failure(record.id, job_id, code)
        return len(entries)

    def _forget_failure(self, backfill_id: str, job_id: str, code: str) -> None:
        """The failed job was retried: it leaves the retry list (counted once, whoever gets
        here)."""
        retry = self.backfills.key(backfill_id, "retry")
        counts = self.backfills.key(backfill_id, "counts")

        def write(pipe) -> None:
            if not pipe.hexists(retry, job_id):
                return
            pipe.multi()
            pipe.hdel(retry, job_id)
            pipe.hincrby(counts, "failed", -1)
            pipe.hincrby(counts, f"failed:{code}", -1)
            pipe.hincrby(counts, "retried", 1)

        watched(self.redis, retry, write)

    # -- the harvest

    def harvest(self, record: BackfillRecord) -> bool:
        """Copies and manifest lines for up to HARVEST_BATCH ended jobs, in one part: once
        that many ended, once the first waited PART_EVERY_S, or once none is in flight."""
        ended = self.backfills.key(record.id, "ended")
        ids = [i.decode() for i in self.redis.lrange(ended, 0, HARVEST_BATCH - 1)]
        if not ids:
            self.waiting.pop(record.id, None)
            return False
        since = self.waiting.setdefault(record.id, time.monotonic())
        due = time.monotonic() - since >= PART_EVERY_S or len(ids) == HARVEST_BATCH
        if not due and self.redis.scard(self.backfills.key(record.id, "inflight")):
            return False
        jobs = self.jobs.get_many(ids)
        pairs = zip(ids, jobs, strict=True)
        lines = list(self.pool.map(lambda p: self._deliver(record, *p), pairs))
        counts = self.backfills.key(record.id, "counts")
        part = int(self.redis.hget(counts, "manifest_parts") or 0) + 1
        bucket, prefix = split_prefix(record.output)
        body = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
        self.storage.put(
            f"{prefix}_manifest/{part:09d}.jsonl", body.encode(), "application/x-ndjson", bucket
        )
        self._still_holding()
        with self.redis.pipeline() as pipe:
            pipe.ltrim(ended, len(ids), -1)
            pipe.hincrby(counts, "manifest_parts", 1)
            for job_id in ids:  # the manifest keeps them now; the ended marks stay
                self.jobs.expire(job_id, self.settings.backfill_job_retention_s, pipe)
            pipe.execute()
        self.waiting.pop(record.id, None)
        return True

    def _deliver(self, record: BackfillRecord, job_id: str, job: JobRecord | None) -> dict:
        """The rendered copies of one ended job, and its manifest line."""
        if job is None:  # deleted by its tenant since it ended
            return {"key": None, "job_id": job_id, "status": "deleted", "error": None,
                    "audio_s": None, "results": []}  # fmt: skip
        key = job.input_location[1]
        line = {
            "key": key,
            "job_id": job.id,
            "status": str(job.status),
            "error": job.error.model_dump() if job.error else None,
            "audio_s": job.progress.done_s if job.status is JobStatus.succeeded else None,
            "results": [],
        }
        if job.status is not JobStatus.succeeded:
            return line
        bucket, prefix = split_prefix(record.output)
        base = prefix + record.relative(key)
        formats = record.spec.formats
        results = []
        try:
            self.storage.copy(job.result_key, bucket, f"{base}.json")
            results.append(_uri(bucket, f"{base}.json"))
            if len(formats) > 1:
                result = TranscriptResult.model_validate_json(self.storage.get(job.result_key))
                for name in formats[1:]:
                    writer = WRITERS[name]
                    target = f"{base}.{writer.extension}"
                    data = writer.render(result).encode()
                    self.storage.put(target, data, writer.media_type, bucket)
                    results.append(_uri(bucket, target))
        except ClientError as e:
            if e.response.get("Error", {}).get("Code") not in MISSING:
                raise
            line["status"], line["error"] = "deleted", None  # its result went with the job
        line["results"] = results
        return line

    # -- the end of a run, and the next

    def _finish(self, backfill_id: str) -> None:
        """A backfill whose jobs all ended and are harvested: without a schedule, once its run
        is listed and retried, it is done; cancelled, the scanner lets go of it."""
        inflight = self.redis.scard(self.backfills.key(backfill_id, "inflight"))
        pending = self.redis.llen(self.backfills.key(backfill_id, "ended"))
        if inflight or pending:
            return

        def done(r: BackfillRecord) -> BackfillRecord:
            if r.state != "active":  # cancelled (or done): nothing left to look after
                return r
            if r.spec.schedule or r.retrying or r.run.scanned_at is None:
                raise BackfillError("not done")
            log.info("backfill %s: done", backfill_id)
            return r.model_copy(update={"state": "done", "finished_at": datetime.now(UTC)})

        def release(pipe) -> None:
            pipe.srem(self.backfills.active, backfill_id)

        try:
            self.backfills.update(backfill_id, done, also=release)
        except BackfillError:
            return
        self.served.pop(backfill_id, None)


def drop_queued(
    backfills: BackfillStore, jobs: JobStore, backfill_id: str, retention_s: float
) -> None:
    """Cancel the backfill's jobs that wait in the queue (a running one finishes)."""
    error = JobError(code="cancelled", message="its backfill was cancelled")
    for job_id in backfills.in_flight(backfill_id):
        try:
            jobs.transition(job_id, JobStatus.cancelled, only_from=JobStatus.queued, error=error)
        except TransitionError:  # running, or ended meanwhile
            continue
        jobs.expire(job_id, retention_s)


def start_run(backfills: BackfillStore, backfill_id: str) -> BackfillRecord | None:
    """A scheduled time came: the next run begins, unless the last is still listing (then it
    is counted as skipped) or began less than the schedule's minimum gap ago (the same time
    delivered twice). The new run lists the prefix from the start; objects with jobs are
    skipped. None: no run began."""
    backfills.redis.hincrby(backfills.key(backfill_id, "counts"), "scheduled", 1)
    began: list[BackfillRecord] = []

    def next_run(r: BackfillRecord) -> BackfillRecord:
        if r.state == "cancelled" or not r.spec.schedule:
            raise BackfillError(f"backfill {r.id} is {r.state}")
        if r.run.scanned_at is None:
            log.warning("backfill %s: run %d is still listing; this time skipped", r.id,
                        r.run.number)  # fmt: skip
            return r.model_copy(update={"runs_skipped": r.runs_skipped + 1})
        gap = min_gap_s(parse_schedule(r.spec.schedule))
        if datetime.now(UTC) - r.run.started_at < timedelta(seconds=gap):
            raise BackfillError(f"backfill {r.id}: run {r.run.number} began {gap} s ago or less")
        updated = r.model_copy(
            update={"run": Run(number=r.run.number + 1), "state": "active", "finished_at": None}
        )
        began.append(updated)
        return updated

    try:
        backfills.update(backfill_id, next_run)
    except BackfillError as e:
        log.info("scheduled run not begun: %s", e)
        return None
    if began:
        log.info("backfill %s: run %d begins", backfill_id, began[-1].run.number)
    return began[-1] if began else None


# -- schedules and the process


def _queue() -> Queue:
    return Queue(BACKFILL_QUEUE, Exchange(BACKFILL_QUEUE), routing_key=BACKFILL_QUEUE)


def create_backfill_app(settings: Settings) -> Celery:
    """The scanner's and beat's Celery app: only the `backfills` queue, and redbeat's
    scheduler, its entries and lock in the fleet's Redis.

    Its redbeat client is made here, before any thread uses the app: redbeat makes it on
    first use without a lock, so threads saving or deleting their first entries at once each
    made one, and each client replaced by another's closed its pool as it was dropped, under
    the save still using it (500s and 503s when starts or cancels came together)."""
    from redbeat.schedulers import get_redis

    app = Celery("whisperfleet-backfills", broker=settings.redis_url, set_as_current=False)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        task_queues=[_queue()],
        task_default_queue=BACKFILL_QUEUE,
        task_routes={SCHEDULED_TASK: {"queue": _queue()}},
        broker_connection_retry_on_startup=True,
        worker_pool="threads",
        worker_hijack_root_logger=False,
        timezone="UTC",
        beat_scheduler="redbeat.RedBeatScheduler",
        beat_max_loop_interval=5,  # a beat that takes over sees new entries this soon
        redbeat_redis_url=settings.redis_url,
        redbeat_key_prefix="whisperfleet:redbeat:",  # entries: <prefix><name>, no separator
        redbeat_lock_key="whisperfleet:redbeat:lock",
        redbeat_lock_timeout=30,  # a beat killed holding the lock is replaced after this
        # a Redis that takes the connection and never answers fails the call (503 in the API);
        # redis-py before 8 would wait for ever
        redbeat_redis_options={
            "socket_timeout": SCHEDULE_TIMEOUT_S,
            "socket_connect_timeout": SCHEDULE_TIMEOUT_S,
        },
    )
    get_redis(app)
    return app


def schedule(celery_app: Celery, record: BackfillRecord) -> None:
    """Enter the backfill's schedule for beat (replacing any entry it had)."""
    from redbeat import RedBeatSchedulerEntry

    when = parse_schedule(record.spec.schedule)
    RedBeatSchedulerEntry(
        f"backfill:{record.id}",
        SCHEDULED_TASK,
        every(when) if isinstance(when, timedelta) else when,
        args=[record.id],
        options={"queue": BACKFILL_QUEUE},
        app=celery_app,
    ).save()


def unschedule(celery_app: Celery, backfill_id: str) -> None:
    from redbeat import RedBeatSchedulerEntry

    key = f"{celery_app.conf.redbeat_key_prefix}backfill:{backfill_id}"
    try:
        RedBeatSchedulerEntry.from_key(key, app=celery_app).delete()
    except KeyError:  # it had none
        pass


app = create_backfill_app(get_settings())


@cache
def _backfills() -> BackfillStore:
    return BackfillStore(redis.Redis.from_url(get_settings().redis_url))


@app.task(name=SCHEDULED_TASK, shared=False)
def scheduled(backfill_id: str) -> None:
    """A scheduled time of a backfill came. One that is gone (its start failed after the
    entry was made) or cancelled (its cancel cut short before the entry went) has its entry
    removed: beat would fire it for ever."""
    record = _backfills().get(backfill_id)
    if record is None or record.state == "cancelled":
        why = "does not exist" if record is None else "is cancelled"
        log.warning("scheduled run of backfill %s, which %s: entry removed", backfill_id, why)
        unschedule(app, backfill_id)
        return
    start_run(_backfills(), backfill_id)


def pump(scanner: Scanner, stop: threading.Event) -> None:
    """Step until stopped: at once again after a step that did something; the lock renewed
    beside the steps, and let go of once stopped (another scanner goes on at once)."""
    threading.Thread(target=scanner.keep, args=(stop,), name="lock", daemon=True).start()
    while not stop.is_set():
        try:
            busy = scanner.step()
        except Exception as e:  # Redis or storage away, for a while: tried again
            log.warning("scanner step failed (%s: %s); trying again", type(e).__name__, e)
            busy = False
            stop.wait(2.0)
        if not busy:
            stop.wait(IDLE_S)
    try:
        scanner.holding = False  # the lock thread renews it no more
        scanner.backfills.unlock(scanner.token)
    except redis.RedisError as e:  # it lapses by itself
        log.warning("scanner: the lock was not let go (%s)", e)


def run(concurrency: int = 2) -> None:
    """`whisperfleet scanner`: the pump thread, and the worker that takes scheduled runs."""
    settings = get_settings()
    configure_logs(settings.log_format)
    client = redis.Redis.from_url(settings.redis_url)
    storage = Storage(settings, threads=THREADS)  # its pool's threads each read and copy
    scanner = Scanner(settings, client, storage, create_job_app(settings))
    stop = threading.Event()
    pumping = threading.Thread(target=pump, args=(scanner, stop), name="pump", daemon=True)
    pumping.start()
    try:
        worker_ready.connect(lambda sender, **_: ready(sender, "scheduled runs"), weak=False)
        app.worker_main(worker_argv("whisperfleet-scanner", BACKFILL_QUEUE, concurrency))
    finally:
        stop.set()
        pumping.join(LOCK_TTL_S)  # its step ends, then it lets go of the lock


def beat() -> None:
    """`whisperfleet beat`: Celery beat with the backfills' schedules."""
    settings = get_settings()
    configure_logs(settings.log_format)
    log.info(
        "beat ready: sends backfills' scheduled runs while it holds the lock in Redis (one beat "
        "at a time sends them)"
    )
    app.Beat(loglevel="INFO", scheduler="redbeat.RedBeatScheduler", quiet=True).run()
