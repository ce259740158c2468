"""Leases and the reconciler on the real Redis: who runs a job, and taking over from the dead."""

import time

import pytest
import redis

from tests.worker.test_jobs import record
from worker.app import create_app
from worker.contract.dispatch import dispatch
from worker.contract.jobs import JobStatus, JobStore
from worker.leases import Leases, Reconciler


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


def test_the_reconciler_takes_over_only_jobs_nobody_runs(store, settings):
    sent = []
    leases = Leases(store.redis, "me", ttl_s=30)
    reconciler = Reconciler(store, leases, sent.append, stale_after_s=0, max_attempts=3)
    orphan, leased, waiting, lost, taken, poison, done = (record() for _ in range(7))
    for r in (orphan, leased, waiting, lost, taken, poison, done):
        store.create(r)
    dispatch(create_app(settings), store, waiting)  # a real message, in its queue
    store.mark_sent(taken.id)  # marked, but its message was taken by a worker that died
    for r in (orphan, leased, poison, done):
        store.transition(r.id, JobStatus.running, worker="dead")
    for _ in range(2):  # poison: started three times in all
        store.transition(poison.id, JobStatus.running, worker="dead")
    assert Leases(store.redis, "alive", ttl_s=30).acquire(leased.id)
    store.transition(done.id, JobStatus.succeeded)

    counts = reconciler.run_once()
    assert counts == {"requeued": 1, "resent": 2, "poison": 1}
    assert sorted(r.id for r in sent) == sorted([orphan.id, lost.id, taken.id])
    assert store.get(orphan.id).status is JobStatus.queued
    assert store.get(leased.id).status is JobStatus.running
    assert store.get(poison.id).status is JobStatus.failed
    assert store.get(poison.id).error.code == "poison"
    assert store.get(waiting.id).status is JobStatus.queued
    assert set(store.stale(0)) == {orphan.id, leased.id, waiting.id, lost.id, taken.id}


def test_only_jobs_left_alone_for_a_while_are_looked_at(store):
    r = record()
    store.create(r)
    reconciler = Reconciler(store, Leases(store.redis, "me", 30), [].append, 60, 3)
    assert reconciler.run_once() == {"requeued": 0, "resent": 0, "poison": 0}
    assert store.stale(60) == [] and store.stale(0) == [r.id]
