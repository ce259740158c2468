"""Backfills in one process: the scanner's steps against the real Redis (db 14) and moto's S3
server, with no worker (a test ends jobs as a worker's hooks do, through the job store), and
the REST routes through a TestClient. The same with real processes, crashes and beat:
tests/faults/test_backfills.py."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta

import pytest
import redis
from fastapi.testclient import TestClient

from api.main import create_app
from worker.app import create_app as create_job_app
from worker.backfills.scanner import (
    BULK,
    LockLost,
    Scanner,
    create_backfill_app,
    drop_queued,
    pump,
    schedule,
    start_run,
    unschedule,
)
from worker.contract.backfills import (
    BackfillCreate,
    BackfillError,
    BackfillRecord,
    BackfillStore,
    Run,
    TooManyBackfills,
    object_job_id,
    parse_schedule,
)
from worker.contract.formats import WRITERS
from worker.contract.jobs import JobError, JobStatus, JobStore, Progress, TransitionError
from worker.contract.options import JobOptions
from worker.contract.results import TranscriptResult, TranscriptSegment
from worker.contract.tenants import Limits
from worker.storage import Storage

ARCHIVE = "archive-bf"
LOCK = "whisperfleet:backfills:scanner"


@pytest.fixture
def world(settings, clips):
    """The scanner's world: settings whose tenant may read the archive bucket, storage with
    that bucket, and scanners (each new one finds the scanners' lock free: the last is gone)."""
    sources = [f"s3://{ARCHIVE}/", "s3://missing-bf/"]  # the second bucket does not exist
    settings = settings.model_copy(update={"tenant_sources": sources})
    storage = Storage(settings)
    storage.ensure_bucket()
    try:
        storage.client.create_bucket(Bucket=ARCHIVE)
    except storage.client.exceptions.BucketAlreadyOwnedByYou:
        for page in storage.client.get_paginator("list_objects_v2").paginate(Bucket=ARCHIVE):
            for o in page.get("Contents", []):
                storage.client.delete_object(Bucket=ARCHIVE, Key=o["Key"])
    return World(settings, storage, clips["en_jfk"].bytes)


class World:
    def __init__(self, settings, storage, audio: bytes):
        self.settings, self.storage, self.audio = settings, storage, audio
        self.store = JobStore(redis.Redis.from_url(settings.redis_url))
        self.backfills = BackfillStore(self.store.redis)
        self.queue = create_job_app(settings)

    def scanner(self, **changes) -> Scanner:
        self.store.redis.delete(LOCK)
        settings = self.settings.model_copy(update=changes)
        return Scanner(settings, self.store.redis, self.storage, self.queue)

    def put(self, key: str, data: bytes) -> None:
        self.storage.client.put_object(Bucket=ARCHIVE, Key=key, Body=data)

    def backfill(self, prefix: str, **spec) -> BackfillRecord:
        record = self.record(prefix, **spec)
        self.backfills.create(record)
        return record

    def record(self, prefix: str, **spec) -> BackfillRecord:
        """A backfill's record, not stored yet."""
        create = BackfillCreate(source=f"s3://{ARCHIVE}/{prefix}", **spec)
        create = create.resolve(
            self.settings,
            Limits(sources=self.settings.tenant_sources, jobs_per_minute=1, jobs_in_flight=1),
        )
        return BackfillRecord(
            id=new_id(),
            tenant="default",
            spec=create,
            output=f"s3://{self.settings.s3_bucket}/backfills/default/out-{prefix}",
        )

    def until_listed(self, scanner: Scanner, backfill_id: str, steps: int = 50) -> None:
        for _ in range(steps):
            scanner.step()
            if self.backfills.get(backfill_id).run.scanned_at is not None:
                return
        raise AssertionError(f"backfill {backfill_id} is still listing")

    def jobs_of(self, backfill_id: str) -> list:
        found = []
        for key in self.store.redis.scan_iter(match="whisperfleet:job:*", count=1000):
            record = self.store.get(key.decode().rpartition(":")[2])
            if record and record.backfill and record.backfill.id == backfill_id:
                found.append(record)
        return found

    def end(self, job, status: JobStatus, duration: float = 11.0) -> None:
        """What a worker does: run the job, store its result, move its record."""
        self.store.transition(job.id, JobStatus.running)
        if status is JobStatus.succeeded:
            segment = TranscriptSegment(
                id=0, start=0.0, end=duration, text=" Ask not.", tokens=[1, 2], avg_logprob=-0.2,
                compression_ratio=1.0, no_speech_prob=0.01, temperature=0.0,
            )  # fmt: skip
            result = TranscriptResult(
                text=" Ask not.",
                language="en",
                language_probability=None,
                duration=duration,
                segments=[segment],
                model=job.model,
                options=job.options,
                seed=1,
            )
            body = WRITERS["json"].render(result).encode()
            self.storage.put_once(job.result_key, body, "application/json")
            progress = Progress(done_s=duration, total_s=duration)
            self.store.transition(job.id, status, progress=progress)
        else:
            error = JobError(code="invalid_audio", message="could not decode the audio")
            self.store.transition(job.id, status, error=error)


_ids = iter(range(1, 10**6))


def new_id() -> str:
    return f"bf_{next(_ids):024x}"


# -- the contract


@pytest.mark.parametrize(
    "text", ["0 2 * * *", "@nightly", "@hourly", "*/5 * * * 1-5", "@every 10s", "@every 2h"]
)
def test_schedules_parse(text):
    parse_schedule(text)


@pytest.mark.parametrize(
    "text", ["61 * * * *", "* * *", "@every 3s", "@every", "@yearlyish", "nightly"]
)
def test_bad_schedules_are_refused_in_words(text):
    with pytest.raises(ValueError, match="schedule"):
        parse_schedule(text)


def test_the_job_id_follows_what_makes_the_result():
    options = JobOptions()
    one = object_job_id("t", "b", "a/x.flac", '"e1"', "tiny.en", options)
    assert one == object_job_id("t", "b", "a/x.flac", "e1", "tiny.en", options)
    others = {
        object_job_id("u", "b", "a/x.flac", "e1", "tiny.en", options),
        object_job_id("t", "c", "a/x.flac", "e1", "tiny.en", options),
        object_job_id("t", "b", "a/y.flac", "e1", "tiny.en", options),
        object_job_id("t", "b", "a/x.flac", "e2", "tiny.en", options),
        object_job_id("t", "b", "a/x.flac", "e1", "base", options),
        object_job_id("t", "b", "a/x.flac", "e1", "tiny.en", JobOptions(language="en")),
    }
    assert one not in others and len(others) == 6
    # ids made before options were added stay the same: a rerun after an upgrade skips
    assert one == "1e8cb372c9d320f9e1d87c9bb4fc6236"
    worded = JobOptions(language="en", word_timestamps=True)
    assert object_job_id("t", "b", "a/x.flac", "e1", "tiny.en", worded) == (
        "47c95490a0e722b5b2d729241ab09313"
    )
    assert one != object_job_id("t", "b", "a/x.flac", "e1", "tiny.en", JobOptions(vad=False))
    assert one != object_job_id("t", "b", "a/x.flac", "e1", "tiny.en", JobOptions(diarize=True))


def test_patterns_choose_the_objects():
    spec = BackfillCreate(
        source="s3://archive/calls",  # the slash is added
        include=["2026/*"],
        exclude=["*/draft-*"],
        extensions=[".FLAC", "wav"],
        modified_since=datetime(2026, 1, 1),
    )
    assert spec.source == "s3://archive/calls/"
    new, old = datetime(2026, 6, 1, tzinfo=UTC), datetime(2025, 6, 1, tzinfo=UTC)
    assert spec.takes("2026/a/b.flac", new)
    assert spec.takes("2026/c.WAV", new)
    assert not spec.takes("2026/a/b.flac", old)
    assert not spec.takes("2025/b.flac", new)
    assert not spec.takes("2026/x/draft-1.flac", new)
    assert not spec.takes("2026/notes.txt", new)
    assert spec.formats == ["json"]


# -- the scanner


def test_one_job_per_object_and_a_rerun_makes_none(world):
    for i in range(12):
        world.put(f"calls/{i:02d}.flac", world.audio)
    world.put("calls/empty.wav", b"")
    world.put("calls/notes.txt", b"not audio")
    world.put("calls/fake.flac", b"this is no flac at all")
    record = world.backfill("calls/")
    scanner = world.scanner()
    world.until_listed(scanner, record.id)
    jobs = world.jobs_of(record.id)
    assert len(jobs) == 14  # 12 clips, the empty one and the fake: not the .txt
    failed = {j.source.rpartition("/")[2]: j.error.code for j in jobs if j.status == "failed"}
    assert failed == {"empty.wav": "invalid_audio", "fake.flac": "invalid_audio"}
    assert all(j.priority == BULK and j.status == "queued" for j in jobs if j.error is None)
    assert world.store.redis.llen(BULK) == 12
    run = world.backfills.get(record.id).run
    assert (run.listed, run.excluded, run.skipped) == (15, 1, 0)
    counts = world.backfills.counts(world.backfills.get(record.id))
    assert (counts.created, counts.failed, counts.in_flight) == (14, 2, 12)
    assert world.store.in_flight("default") == 0  # the tenant's own limit is its own

    again = world.backfill("calls/")  # the same objects, model and options: nothing to do
    world.until_listed(scanner, again.id)
    assert world.jobs_of(again.id) == []
    assert world.backfills.get(again.id).run.skipped == 14
    assert world.store.redis.llen(BULK) == 12


def test_a_scan_that_dies_mid_page_goes_on_without_making_a_job_twice(world, monkeypatch):
    for i in range(20):
        world.put(f"crash/{i:02d}.flac", world.audio)
    record = world.backfill("crash/")
    scanner = world.scanner()
    real_head, calls = Storage.head, []

    def head(self, *args, **kwargs):
        calls.append(1)
        if len(calls) > 7:
            raise ConnectionError("storage went away")
        return real_head(self, *args, **kwargs)

    monkeypatch.setattr(Storage, "head", head)
    scanner.step()
    made = len(world.jobs_of(record.id))
    assert 1 <= made < 20
    assert world.backfills.get(record.id).run.cursor is None  # the page is not done
    problem = world.backfills.counts(world.backfills.get(record.id)).problem
    assert problem == "storage or Redis is not answering; tried again"
    monkeypatch.setattr(Storage, "head", real_head)
    world.until_listed(world.scanner(), record.id)  # another scanner, as after a kill
    jobs = world.jobs_of(record.id)
    assert len(jobs) == 20 and len({j.source for j in jobs}) == 20
    run = world.backfills.get(record.id).run
    assert (run.listed, run.skipped) == (20, 0)  # the repeated page is counted once
    counts = world.backfills.counts(world.backfills.get(record.id))
    assert counts.created == 20 and counts.problem is None
    assert world.store.redis.llen(BULK) == 20


def test_one_scanner_works_at_a_time_and_a_lost_lock_writes_nothing(world, monkeypatch):
    for i in range(3):
        world.put(f"lock/{i}.flac", world.audio)
    record = world.backfill("lock/")
    first = world.scanner()
    assert first.step()
    second = Scanner(world.settings, world.store.redis, world.storage, world.queue)
    assert not second.step()  # it waits, ready
    world.put("lock/3.flac", world.audio)
    world.backfills.update(
        record.id, lambda r: r.model_copy(update={"run": Run(number=2)})
    )  # a new run, so that there is a page to write
    real_listing = Storage.listing

    def listing(self, *args, **kwargs):  # the lock lapses while the page is read
        world.store.redis.set(LOCK, "someone else")
        first.holding = False
        return real_listing(self, *args, **kwargs)

    monkeypatch.setattr(Storage, "listing", listing)
    with pytest.raises(LockLost):
        first.step()
    assert world.backfills.get(record.id).run.cursor is None  # nothing written


def test_a_scanner_stopping_lets_go_of_the_lock_at_once(world):
    first, second = world.scanner(), world.scanner()
    stop = threading.Event()
    pumping = threading.Thread(target=pump, args=(first, stop))
    pumping.start()
    for _ in range(100):
        if first.holding:
            break
        time.sleep(0.05)
    assert first.holding and not second.step()  # the second waits
    stop.set()
    pumping.join(10)
    assert not pumping.is_alive() and not world.store.redis.exists(LOCK)
    second.step()
    assert second.holding  # without waiting for the lock to lapse


def test_starts_at_the_same_moment_cannot_pass_the_active_limit_together(world):
    records = [world.record("limit/") for _ in range(8)]
    barrier = threading.Barrier(len(records))

    def start(record) -> bool:
        barrier.wait()
        try:
            world.backfills.create(record, max_active=3)
        except TooManyBackfills:
            return False
        return True

    with ThreadPoolExecutor(len(records)) as pool:
        started = list(pool.map(start, records))
    assert sum(started) == 3
    assert world.backfills.active_count("default") == 3


def test_a_failing_backfill_shows_why_and_holds_up_no_other(world):
    world.put("fine/0.flac", world.audio)
    world.storage.client.create_bucket(Bucket="doomed-bf")
    world.storage.client.put_object(Bucket="doomed-bf", Key="x/0.flac", Body=world.audio)
    doomed = world.backfill("fine/")
    world.backfills.update(
        doomed.id,
        lambda r: r.model_copy(
            update={"spec": r.spec.model_copy(update={"source": "s3://doomed-bf/x/"})}
        ),
    )
    world.storage.client.delete_object(Bucket="doomed-bf", Key="x/0.flac")
    world.storage.client.delete_bucket(Bucket="doomed-bf")
    fine = world.backfill("fine/", language="en")  # other options: jobs of its own
    world.until_listed(world.scanner(), fine.id)
    assert len(world.jobs_of(fine.id)) == 1
    shown = world.backfills.counts(world.backfills.get(doomed.id)).problem
    assert shown == "storage answered NoSuchBucket to ListObjectsV2; tried again"
    scanner = world.scanner(backfill_queue_bound=1)  # a full queue: its work is not tried,
    world.store.redis.rpush(BULK, b"waiting")  # and what it shows stays
    scanner.step()
    assert world.backfills.counts(world.backfills.get(doomed.id)).problem == shown


def test_the_bulk_queue_stays_under_its_bound_and_a_late_small_backfill_gets_its_share(world):
    for i in range(60):
        world.put(f"huge/{i:02d}.flac", world.audio)
    for i in range(6):
        world.put(f"small/{i}.flac", world.audio)
    scanner = world.scanner(backfill_queue_bound=10)
    huge = world.backfill("huge/")
    scanner.step()
    assert world.store.redis.llen(BULK) == 10
    small = world.backfill("small/")
    world.store.redis.delete(BULK)  # workers took the 10 messages: the room is shared
    scanner.step()
    assert len(world.jobs_of(small.id)) == 5 and len(world.jobs_of(huge.id)) == 15
    world.store.redis.delete(BULK)
    scanner.step()  # the small one needs 1 of its 5; the rest of the room is the huge one's
    assert world.store.redis.llen(BULK) == 10
    assert len(world.jobs_of(small.id)) == 6 and len(world.jobs_of(huge.id)) == 24
    assert world.backfills.get(small.id).run.scanned_at is not None
    assert world.backfills.get(huge.id).run.scanned_at is None


def test_ended_jobs_are_counted_once_and_written_out(world):
    for i in range(4):
        world.put(f"out/a/{i}.flac", world.audio)
    record = world.backfill("out/", formats=["srt", "text"])
    scanner = world.scanner()
    world.until_listed(scanner, record.id)
    jobs = sorted(world.jobs_of(record.id), key=lambda j: j.source)
    for job in jobs[:3]:
        world.end(job, JobStatus.succeeded)
    world.end(jobs[3], JobStatus.failed)
    with pytest.raises(TransitionError):  # a second end of one job is refused, not counted
        world.store.transition(jobs[0].id, JobStatus.succeeded)
    scanner.step()
    record = world.backfills.get(record.id)
    assert record.state == "done"
    counts = world.backfills.counts(record)
    assert (counts.succeeded, counts.failed, counts.in_flight) == (3, 1, 0)
    assert counts.audio_s == pytest.approx(33.0)
    assert world.backfills.failures(record.id)[0]["code"] == "invalid_audio"
    bucket, out = world.settings.s3_bucket, "backfills/default/out-out/"
    stored = {k for page in world.storage.pages(out) for k in page}
    for job in jobs[:3]:
        name = job.source.rpartition("out/")[2]
        assert {f"{out}{name}.json", f"{out}{name}.srt", f"{out}{name}.txt"} <= stored
    srt = world.storage.get(f"{out}a/0.flac.srt", bucket).decode()
    assert srt == WRITERS["srt"].render(
        TranscriptResult.model_validate_json(world.storage.get(jobs[0].result_key))
    )
    parts = sorted(k for k in stored if k.startswith(f"{out}_manifest/"))
    lines = [json.loads(x) for p in parts for x in world.storage.get(p, bucket).splitlines()]
    assert sorted(line["key"] for line in lines) == sorted(j.input_location[1] for j in jobs)
    assert {line["status"] for line in lines} == {"succeeded", "failed"}
    ok = next(line for line in lines if line["status"] == "succeeded")
    assert ok["audio_s"] == 11.0 and len(ok["results"]) == 3
    bad = next(line for line in lines if line["status"] == "failed")
    assert bad["error"]["code"] == "invalid_audio" and bad["results"] == []


def test_retry_runs_failed_objects_again_once(world):
    for i in range(3):
        world.put(f"retry/{i}.flac", world.audio)
    record = world.backfill("retry/")
    scanner = world.scanner()
    world.until_listed(scanner, record.id)
    for job in world.jobs_of(record.id):
        world.end(job, JobStatus.failed)
    scanner.step()
    assert world.backfills.get(record.id).state == "done"

    def retry(r):
        return r.model_copy(update={"retrying": True, "state": "active"})

    assert len(world.backfills.failures(record.id)) == 3
    for _ in range(2):  # asked twice: each failed object still gets one new job
        world.backfills.retry(record.id, retry)
        assert world.backfills.failures(record.id) == []  # all of them are retried
        for _ in range(3):
            scanner.step()
    jobs = world.jobs_of(record.id)
    assert len(jobs) == 6
    assert sum(j.status == "queued" for j in jobs) == 3
    counts = world.backfills.counts(world.backfills.get(record.id))
    assert (counts.failed, counts.retried, counts.in_flight) == (0, 3, 3)
    assert not world.backfills.get(record.id).retrying

    cancelled = world.backfill("retry/", language="en")
    world.until_listed(scanner, cancelled.id)
    for job in world.jobs_of(cancelled.id):
        world.end(job, JobStatus.failed)
    world.backfills.update(cancelled.id, lambda r: r.model_copy(update={"state": "cancelled"}))

    def refuse(r):
        raise BackfillError("cancelled")

    with pytest.raises(BackfillError):  # refused: nothing is listed for a retry
        world.backfills.retry(cancelled.id, refuse)
    assert world.store.redis.hlen(world.backfills.key(cancelled.id, "failed")) == 3
    assert not world.store.redis.exists(world.backfills.key(cancelled.id, "retry"))

    for job in [j for j in jobs if j.status == "queued"]:  # they fail again: no loop
        world.end(job, JobStatus.failed)
    for _ in range(3):
        scanner.step()
    assert len(world.jobs_of(record.id)) == 6
    record = world.backfills.get(record.id)
    assert record.state == "done" and world.backfills.counts(record).failed == 3


def test_records_go_once_written_out_and_a_rerun_still_skips_their_objects(world):
    for i in range(4):
        world.put(f"kept/{i}.flac", world.audio)
    world.put("kept/bad.flac", b"this is no flac at all")
    record = world.backfill("kept/")
    scanner = world.scanner(backfill_job_retention_s=1)
    world.until_listed(scanner, record.id)
    jobs = world.jobs_of(record.id)
    for job in jobs:
        if job.status == "queued":
            world.end(job, JobStatus.succeeded)
    scanner.step()  # the harvest: copies, a manifest part, and the records' expiry
    assert world.backfills.get(record.id).state == "done"
    ids = [j.id for j in jobs]
    assert world.store.ended(ids) == [True] * 5
    assert world.store.ended([new_id()[:32]]) == [False]
    deleted = next(j for j in jobs if j.status == "queued")
    world.store.delete(deleted)  # as DELETE /v1/jobs/{id}: its object is to be done again
    time.sleep(2.5)
    assert world.store.get_many(ids) == [None] * 5  # Redis keeps the marks only
    assert world.store.ended(ids).count(True) == 4

    again = world.backfill("kept/")  # each object ended: none is made again but the deleted
    world.until_listed(scanner, again.id)
    assert [j.source for j in world.jobs_of(again.id)] == [deleted.source]
    assert world.backfills.get(again.id).run.skipped == 4

    world.put("kept/bad.flac", world.audio)  # fixed; retried though its record is gone
    world.backfills.retry(
        record.id, lambda r: r.model_copy(update={"retrying": True, "state": "active"})
    )
    for _ in range(3):
        scanner.step()
    retried = world.jobs_of(record.id)
    assert [j.status for j in retried] == ["queued"]
    counts = world.backfills.counts(world.backfills.get(record.id))
    assert (counts.failed, counts.retried) == (0, 1)
    assert counts.failed_by_code == {"invalid_audio": 0}  # its code, though its record went


def test_cancel_drops_queued_jobs_and_lets_running_ones_finish(world):
    for i in range(4):
        world.put(f"cancel/{i}.flac", world.audio)
    record = world.backfill("cancel/")
    scanner = world.scanner()
    world.until_listed(scanner, record.id)
    jobs = world.jobs_of(record.id)
    world.store.transition(jobs[0].id, JobStatus.running)
    world.backfills.update(record.id, lambda r: r.model_copy(update={"state": "cancelled"}))
    drop_queued(world.backfills, world.store, record.id, 60)
    statuses = sorted(world.store.get(j.id).status for j in jobs)
    assert statuses == ["cancelled"] * 3 + ["running"]
    scanner.step()
    assert record.id in world.backfills.active_ids()  # its running job is still to harvest
    world.store.transition(jobs[0].id, JobStatus.succeeded, progress=Progress(done_s=1.0))
    world.storage.put_once(jobs[0].result_key, b"{}", "application/json")
    scanner.step()
    assert record.id not in world.backfills.active_ids()
    assert world.backfills.get(record.id).state == "cancelled"


def test_a_scheduled_time_begins_one_run(world):
    world.put("sched/0.flac", world.audio)
    record = world.backfill("sched/", schedule="@every 10s")
    assert start_run(world.backfills, record.id) is None  # run 1 is still listing: skipped
    assert world.backfills.get(record.id).runs_skipped == 1
    world.until_listed(world.scanner(), record.id)
    assert start_run(world.backfills, record.id) is None  # within 5 s of run 1: a duplicate
    earlier = world.backfills.get(record.id).run.started_at - timedelta(seconds=6)
    world.backfills.update(
        record.id,
        lambda r: r.model_copy(update={"run": r.run.model_copy(update={"started_at": earlier})}),
    )
    run = start_run(world.backfills, record.id).run
    assert (run.number, run.cursor, run.scanned_at) == (2, None, None)


def test_a_schedule_is_entered_for_beat_and_taken_out_on_cancel(world):
    world.put("beat/0.flac", world.audio)
    record = world.backfill("beat/", schedule="@nightly")
    app = create_backfill_app(world.settings)
    schedule(app, record)
    key = f"whisperfleet:redbeat:backfill:{record.id}"
    assert world.store.redis.exists(key)
    assert world.store.redis.zscore("whisperfleet:redbeat::schedule", key) is not None
    unschedule(app, record.id)
    assert not world.store.redis.exists(key)
    assert world.store.redis.zscore("whisperfleet:redbeat::schedule", key) is None


# -- the routes


@pytest.fixture
def client(world):
    """The API, its tenant (`default`) allowed to write its backfills' outputs in the buckets
    it may read."""
    with TestClient(create_app(world.settings)) as c:
        c.app.state.tenants.update("default", outputs=world.settings.tenant_sources)
        yield c


def test_the_routes_start_follow_list_cancel_and_retry(client, world):
    world.put("api/0.flac", world.audio)
    world.put("api/bad.flac", b"")
    started = client.post("/v1/backfills", json={"source": f"s3://{ARCHIVE}/api/"})
    assert started.status_code == 201, started.text
    backfill = started.json()
    assert backfill["status"] == "scanning" and backfill["spec"]["model"] == "tiny.en"
    world.until_listed(world.scanner(), backfill["id"])
    seen = client.get(f"/v1/backfills/{backfill['id']}").json()
    assert seen["status"] == "running"
    assert seen["counts"]["created"] == 2 and seen["counts"]["failed"] == 1
    assert seen["failures"][0]["source"] == f"s3://{ARCHIVE}/api/bad.flac"
    assert client.get("/v1/backfills").json()["data"][0]["id"] == backfill["id"]
    assert client.post(f"/v1/backfills/{backfill['id']}/retry").status_code == 202
    cancelled = client.delete(f"/v1/backfills/{backfill['id']}").json()
    assert cancelled["status"] == "cancelled"
    assert world.store.redis.llen(BULK) >= 1  # the message stays; its job is cancelled
    statuses = {j.source.rpartition("/")[2]: j.status for j in world.jobs_of(backfill["id"])}
    assert statuses == {"0.flac": "cancelled", "bad.flac": "failed"}
    refused = client.post(f"/v1/backfills/{backfill['id']}/retry")
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "backfill_cancelled"


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"source": "s3://elsewhere/x/"}, 403, "source_not_allowed"),
        (
            {"source": f"s3://{ARCHIVE}/a/", "output": "s3://elsewhere/o/"},
            403,
            "output_not_allowed",
        ),
        ({"source": "http://x/y"}, 422, "invalid_request"),
        ({"source": f"{ARCHIVE}/a/"}, 422, "invalid_request"),
        ({"source": "s3://missing-bf/a/"}, 422, "source_not_found"),
        ({"source": f"s3://{ARCHIVE}/a/", "output": "s3://missing-bf/o/"}, 422, "output_not_found"),
        (
            {"source": f"s3://{ARCHIVE}/a/", "output": f"s3://{ARCHIVE}/a/out/"},
            422,
            "invalid_option",
        ),
        ({"source": f"s3://{ARCHIVE}/a/", "schedule": "@every 1s"}, 422, "invalid_request"),
        ({"source": f"s3://{ARCHIVE}/a/", "model": "large-v9"}, 422, "unknown_model"),
        ({"source": f"s3://{ARCHIVE}/a/", "language": "de"}, 422, "invalid_option"),
        ({"source": f"s3://{ARCHIVE}/a/", "formats": ["docx"]}, 422, "invalid_request"),
        ({"source": f"s3://{ARCHIVE}/a/", "sauce": 1}, 422, "invalid_request"),
    ],
)
def test_a_bad_backfill_is_refused_in_words(client, body, status, code):
    answer = client.post("/v1/backfills", json=body)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"]["code"] == code
    assert "Value error" not in answer.text and "body." not in answer.text


def test_another_tenants_backfill_is_not_found(client, world):
    world.put("mine/0.flac", world.audio)
    record = world.backfill("mine/")
    world.backfills.update(record.id, lambda r: r.model_copy(update={"tenant": "other"}))
    for method, path in (("GET", ""), ("DELETE", ""), ("POST", "/retry"), ("GET", "/manifest")):
        answer = client.request(method, f"/v1/backfills/{record.id}{path}")
        assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found"


def test_a_start_retried_with_its_idempotency_key_is_one_backfill(client, world):
    world.put("idem/0.flac", world.audio)
    body, key = {"source": f"s3://{ARCHIVE}/idem/"}, {"Idempotency-Key": "nightly-2026-12-01"}
    first = client.post("/v1/backfills", json=body, headers=key)
    again = client.post("/v1/backfills", json=body, headers=key)
    assert first.status_code == again.status_code == 201
    assert first.json()["id"] == again.json()["id"]
    other = client.post("/v1/backfills", json={**body, "formats": ["srt"]}, headers=key)
    assert other.status_code == 409 and other.json()["error"]["code"] == "idempotency_conflict"
    assert [b["id"] for b in client.get("/v1/backfills").json()["data"]] == [first.json()["id"]]


def at_once(n: int, call) -> list:
    """`call(i)` for i in range(n), from n threads let go together."""
    barrier = threading.Barrier(n)

    def go(i):
        barrier.wait()
        return call(i)

    with ThreadPoolExecutor(n) as pool:
        return list(pool.map(go, range(n)))


def test_scheduled_starts_and_cancels_at_the_same_moment_all_answer(world):
    """A fresh API's first schedule saves, and another's first deletes, from many threads at
    once: each answers, and beat's entries follow (the redbeat client is shared)."""
    world.put("many/0.flac", world.audio)
    n = 24
    settings = world.settings.model_copy(update={"backfill_max_active": n})
    body = {"source": f"s3://{ARCHIVE}/many/", "schedule": "@every 1m"}
    entry, due = "whisperfleet:redbeat:backfill:{}", "whisperfleet:redbeat::schedule"
    with TestClient(create_app(settings)) as c:
        c.app.state.tenants.update("default", outputs=settings.tenant_sources)
        started = at_once(n, lambda _: c.post("/v1/backfills", json=body))
        assert [a.status_code for a in started] == [201] * n, [a.text for a in started]
        ids = {a.json()["id"] for a in started}
        listed = c.get("/v1/backfills", params={"limit": 100}).json()["data"]
        assert {b["id"] for b in listed} == ids
    keys = [entry.format(i) for i in ids]
    assert all(world.store.redis.hexists(k, "definition") for k in keys)
    assert all(world.store.redis.zscore(due, k) is not None for k in keys)
    with TestClient(create_app(settings)) as c:
        order = sorted(ids)
        cancelled = at_once(n, lambda i: c.delete(f"/v1/backfills/{order[i]}"))
        assert [a.status_code for a in cancelled] == [200] * n, [a.text for a in cancelled]
        assert {c.get(f"/v1/backfills/{i}").json()["status"] for i in ids} == {"cancelled"}
    assert not any(world.store.redis.exists(k) for k in keys)
    assert world.store.redis.zcard(due) == 0


def test_a_schedule_store_out_of_reach_answers_503(client, world, monkeypatch):
    world.put("away/0.flac", world.audio)
    record = world.backfill("away/", schedule="@nightly")
    away = world.settings.model_copy(update={"redis_url": "redis://127.0.0.1:1/14"})
    monkeypatch.setattr(client.app.state, "backfill_celery", create_backfill_app(away))
    body = {"source": f"s3://{ARCHIVE}/away/", "schedule": "@nightly"}
    for answer in (
        client.post("/v1/backfills", json=body),
        client.delete(f"/v1/backfills/{record.id}"),
    ):
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "unavailable"
        assert answer.headers["Retry-After"]
    assert [b["id"] for b in client.get("/v1/backfills").json()["data"]] == [record.id]


def test_a_cancel_cut_short_by_the_schedule_store_is_finished_by_the_next(
    client, world, monkeypatch
):
    """Issue #37: a DELETE that answered 503 after the record was cancelled left beat's entry,
    and each DELETE after it answered 200 without taking it out."""
    world.put("again/0.flac", world.audio)
    record = world.backfill("again/", schedule="@nightly")
    reachable = client.app.state.backfill_celery
    schedule(reachable, record)
    key, due = f"whisperfleet:redbeat:backfill:{record.id}", "whisperfleet:redbeat::schedule"
    away = world.settings.model_copy(update={"redis_url": "redis://127.0.0.1:1/14"})
    client.app.state.backfill_celery = create_backfill_app(away)
    assert client.delete(f"/v1/backfills/{record.id}").status_code == 503
    assert world.backfills.get(record.id).state == "cancelled"
    assert world.store.redis.exists(key)
    client.app.state.backfill_celery = reachable
    again = client.delete(f"/v1/backfills/{record.id}")
    assert again.status_code == 200 and again.json()["status"] == "cancelled"
    assert not world.store.redis.exists(key) and world.store.redis.zscore(due, key) is None


def test_beat_firing_a_cancelled_backfill_removes_its_entry(world, monkeypatch, caplog):
    """The entry of a backfill cancelled while the schedule store was away, had no DELETE
    come again: its next scheduled time takes it out, and starts no run."""
    from worker.backfills import scanner

    world.put("late/0.flac", world.audio)
    record = world.backfill("late/", schedule="@every 1m")
    app = create_backfill_app(world.settings)
    schedule(app, record)
    world.backfills.update(record.id, lambda r: r.model_copy(update={"state": "cancelled"}))
    monkeypatch.setattr(scanner, "app", app)
    monkeypatch.setattr(scanner, "_backfills", lambda: world.backfills)
    with caplog.at_level(logging.WARNING, logger="worker.backfills.scanner"):
        scanner.scheduled(record.id)
    assert f"backfill {record.id}, which is cancelled: entry removed" in caplog.text
    assert not world.store.redis.exists(f"whisperfleet:redbeat:backfill:{record.id}")
    assert world.backfills.get(record.id).run.number == record.run.number


def test_a_schedule_store_that_never_answers_gets_503_not_a_wait_for_ever(client, world):
    """A Redis that takes the connection and says nothing (frozen, or a black hole on the
    way): the scheduled start answers 503 within the client's socket timeout and retries."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)
    frozen = f"redis://127.0.0.1:{silent.getsockname()[1]}/14"
    client.app.state.backfill_celery = create_backfill_app(
        world.settings.model_copy(update={"redis_url": frozen})
    )
    world.put("frozen/0.flac", world.audio)
    body = {"source": f"s3://{ARCHIVE}/frozen/", "schedule": "@nightly"}
    began = time.monotonic()
    try:
        answer = client.post("/v1/backfills", json=body)
    finally:
        silent.close()
    assert answer.status_code == 503, answer.text
    assert time.monotonic() - began < 60
