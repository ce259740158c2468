"""Leases and the reconciler on the real Redis: who runs a job, and taking over from the dead."""

import json
import time
from datetime import UTC, datetime, timedelta

import pytest
import redis

from tests.worker.test_formats import STORED
from tests.worker.test_jobs import record
from worker.app import create_app
from worker.contract.dispatch import dispatch
from worker.contract.jobs import JobStatus, JobStore
from worker.jobs.execute import stored_result
from worker.jobs.leases import Leases, Reconciler, poison
from worker.storage import Storage

RESULT = json.dumps({**STORED, "duration": 11.0})


@pytest.fixture
def store(settings) -> JobStore:
    return JobStore(redis.Redis.from_url(settings.redis_url))


def test_a_lease_is_held_by_one_worker_renewed_by_it_and_lapses(store):
    a, b = Leases(store.redis, "a", ttl_s=0.5), Leases(store.redis, "b", ttl_s=0.5)
    assert a.acquire("job") and not b.acquire("job")
    assert a.holder("job") == "a"
    assert not b.renew("job") and a.renew("job")
    b.release("job")  # not b's: stays
    assert a.holder("job") == "a"
    time.sleep(0.7)
    assert a.holder("job") is None and not a.renew("job")
    assert b.acquire("job")
    a.release("job")
    assert b.holder("job") == "b"
    b.release("job")
    assert b.holder("job") is None


def reconciler(store, settings, sent, stale_after_s=0) -> Reconciler:
    storage = Storage(settings)
    storage.ensure_bucket()

    def stored(r) -> float | None:
        result = stored_result(storage, r)
        return None if result is None else result.duration

    leases = Leases(store.redis, "me", ttl_s=30)
    return Reconciler(store, leases, sent.append, stored, stale_after_s, max_age_s=3600)


def test_the_reconciler_takes_over_only_jobs_nobody_runs(store, settings):
    sent = []
    orphan, leased, waiting, lost, taken, stored, old, done = (record() for _ in range(8))
    old = old.model_copy(update={"created_at": datetime.now(UTC) - timedelta(hours=2)})
    for r in (orphan, leased, waiting, lost, taken, stored, old, done):
        store.create(r)
    dispatch(create_app(settings), store, waiting)  # a real message, in its queue
    store.mark_sent(taken.id)  # marked, but its message was taken by a worker that died
    for r in (orphan, leased, stored, old, done):
        store.transition(r.id, JobStatus.running, worker="dead")
    assert Leases(store.redis, "alive", ttl_s=30).acquire(leased.id)
    store.transition(done.id, JobStatus.succeeded)
    taking_over = reconciler(store, settings, sent)
    Storage(settings).put_once(stored.result_key, RESULT.encode(), "application/json")

    counts = taking_over.run_once()
    assert counts == {"requeued": 1, "resent": 2, "succeeded": 1, "expired": 1}
    assert sorted(r.id for r in sent) == sorted([orphan.id, lost.id, taken.id])
    # its worker died under it: it runs again, in the quarantine lane
    assert store.get(orphan.id).status is JobStatus.queued and store.get(orphan.id).quarantined
    assert store.get(leased.id).status is JobStatus.running
    assert store.get(stored.id).status is JobStatus.succeeded  # a stored result always wins
    assert store.get(stored.id).progress.done_s == 11.0
    assert store.get(old.id).error.code == "expired"
    assert store.get(waiting.id).status is JobStatus.queued
    assert set(store.stale(0)) == {orphan.id, leased.id, waiting.id, lost.id, taken.id}


def test_only_jobs_left_alone_for_a_while_are_looked_at(store, settings):
    r = record()
    store.create(r)
    counts = reconciler(store, settings, [], stale_after_s=60).run_once()
    assert counts == {"requeued": 0, "resent": 0, "succeeded": 0, "expired": 0}
    assert store.stale(60) == [] and store.stale(0) == [r.id]


def test_the_poison_rule_counts_deaths_in_quarantine_only(store):
    job = record()
    store.create(job)
    for _ in range(4):  # four starts, each of them killed with its worker: no evidence
        store.transition(job.id, JobStatus.running, worker="dead")
    assert poison(store.get(job.id), 2) is None
    store.count_quarantine_death(job.id)
    assert poison(store.get(job.id), 2) is None
    error = poison(store.count_quarantine_death(job.id), 2)
    assert error.code == "poison" and "2 times, running alone" in error.message
