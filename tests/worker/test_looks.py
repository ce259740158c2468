"""A job process's looks at its running jobs (worker.jobs.looks), on the real Redis: one read for
all of them, their progress in one compare-and-set call, a cancel seen by the job's wait, and
Redis away stopping nothing."""

import logging
import threading
import time
from contextlib import ExitStack
from types import SimpleNamespace

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.conftest import free_port
from worker.contract.jobs import JobInput, JobRecord, JobStatus, JobStore, Progress, new_job_id
from worker.jobs.looks import Looks


class Counting(redis.Redis):
    """A client that keeps the name of every command it sends."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.sent: list[str] = []

    def execute_command(self, *args, **options):
        self.sent.append(str(args[0]).upper())
        return super().execute_command(*args, **options)


@pytest.fixture
def store(settings) -> JobStore:
    return JobStore(Counting.from_url(settings.redis_url))


def running(store: JobStore, n: int) -> list[str]:
    ids = []
    for _ in range(n):
        record = JobRecord(
            id=new_job_id(), model="tiny.en", input=JobInput(kind="audio", bytes=3, format="wav")
        )
        store.create(record)
        store.transition(record.id, JobStatus.running)
        ids.append(record.id)
    return ids


def test_one_look_reads_every_running_job_and_writes_their_progress_in_one_call(store):
    """20 jobs: one MGET a look, and one script call for all their progress (where each job
    had a GET every half second and a WATCH/GET/MULTI/SET/ZADD/EXEC every 2 s)."""
    looks, ids = Looks(store), running(store, 20)
    with ExitStack() as stack:
        waits = [stack.enter_context(looks.running(i)) for i in ids]
        for n, on_wait in enumerate(waits):
            assert on_wait(SimpleNamespace(done_s=float(n), total_s=30.0)) is False
        before = store.redis.zscore(store.active, ids[0])
        looks.look(write_progress=True)  # loads the script into Redis: once
        store.redis.sent.clear()
        looks.look()
        assert store.redis.sent == ["MGET"]
        store.redis.sent.clear()
        looks.look(write_progress=True)
        assert store.redis.sent == ["MGET", "EVALSHA"]
    for n, record in enumerate(store.get_many(ids)):
        assert record.status is JobStatus.running
        assert record.progress == Progress(done_s=float(n), total_s=30.0)
    assert store.redis.zscore(store.active, ids[0]) > before  # looked at now, as before
    store.redis.sent.clear()
    looks.look(write_progress=True)
    assert store.redis.sent == []  # none running here: nothing to look at


def test_a_record_that_moved_after_the_read_keeps_its_move(store):
    """The write compares each record with the bytes read: one cancelled, one ended and one
    deleted in between are not written, the others are, in the same call."""
    ids = running(store, 5)
    seen = dict(zip(ids, store.read_many(ids), strict=True))
    store.transition(ids[1], JobStatus.cancelled)
    store.expire(ids[1], 600)
    store.transition(ids[2], JobStatus.succeeded)
    store.delete(store.get(ids[3]))
    progress = Progress(done_s=7.0, total_s=9.0)
    assert store.set_progress_many(seen, dict.fromkeys(ids, progress)) == 2
    after = dict(zip(ids, store.get_many(ids), strict=True))
    assert [after[i].progress for i in (ids[0], ids[4])] == [progress, progress]
    assert after[ids[1]].status is JobStatus.cancelled and after[ids[1]].progress.done_s == 0
    assert 0 < store.redis.ttl(store._key(ids[1])) <= 600  # the cancel's expiry kept
    assert after[ids[2]].status is JobStatus.succeeded and after[ids[2]].progress.done_s == 0
    assert after[ids[3]] is None  # not written back


def test_a_cancel_or_a_deleted_record_reaches_the_jobs_wait_from_the_looks_thread(store):
    looks, stop = Looks(store, every_s=0.05), threading.Event()
    threading.Thread(target=looks.loop, args=(stop,), daemon=True).start()
    try:
        ids = running(store, 3)
        with ExitStack() as stack:
            waits = [stack.enter_context(looks.running(i)) for i in ids]
            ticket = SimpleNamespace(done_s=1.0, total_s=5.0)
            assert not any(wait(ticket) for wait in waits)
            store.transition(ids[0], JobStatus.cancelled)
            store.delete(store.get(ids[2]))
            deadline = time.monotonic() + 5
            while not (waits[0](ticket) and waits[2](ticket)):
                assert time.monotonic() < deadline, "the looks never saw the cancel"
                time.sleep(0.01)
            assert waits[1](ticket) is False
            assert store.get(ids[1]).status is JobStatus.running
        with looks.running(ids[0]) as again:  # run again here: not cancelled until a look
            assert again(ticket) is False
    finally:
        stop.set()


def test_redis_away_stops_no_job_and_is_logged_once(caplog):
    """The looks go on failing quietly: the job's wait says not cancelled, one warning."""
    no_retries = Retry(NoBackoff(), 0)
    away = JobStore(redis.Redis(port=free_port(), socket_connect_timeout=0.1, retry=no_retries))
    looks, stop = Looks(away, every_s=0.02, progress_every_s=0.04), threading.Event()
    threading.Thread(target=looks.loop, args=(stop,), daemon=True).start()
    try:
        with caplog.at_level(logging.WARNING, logger="worker.jobs.looks"):
            with looks.running("job") as on_wait:
                for _ in range(10):
                    assert on_wait(SimpleNamespace(done_s=1.0, total_s=5.0)) is False
                    time.sleep(0.03)
    finally:
        stop.set()
    warnings = [r for r in caplog.records if "not looked at" in r.getMessage()]
    assert len(warnings) == 1


def test_a_look_that_fails_for_another_reason_does_not_end_the_looks(store, monkeypatch, caplog):
    """A bug in one look is logged with its traceback, once; the next looks still see cancels."""
    (job_id,) = running(store, 1)
    read_many, calls = store.read_many, []

    def fails_twice(job_ids):
        calls.append(job_ids)
        if len(calls) <= 2:
            raise ValueError("a bad record")
        return read_many(job_ids)

    monkeypatch.setattr(store, "read_many", fails_twice)
    looks, stop = Looks(store, every_s=0.02), threading.Event()
    threading.Thread(target=looks.loop, args=(stop,), daemon=True).start()
    try:
        with caplog.at_level(logging.WARNING, logger="worker.jobs.looks"):
            with looks.running(job_id) as on_wait:
                store.transition(job_id, JobStatus.cancelled)
                deadline = time.monotonic() + 5
                while not on_wait(SimpleNamespace(done_s=0.0, total_s=None)):
                    assert time.monotonic() < deadline, "the looks stopped after the failure"
                    time.sleep(0.01)
    finally:
        stop.set()
    failed = [r for r in caplog.records if "a bad record" in r.getMessage()]
    assert len(failed) == 1 and failed[0].exc_info is not None
