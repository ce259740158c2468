"""Job records on the real Redis: the state machine and its compare-and-set transitions."""

import threading
import time
from datetime import UTC, datetime, timedelta

import pytest
import redis

from worker.contract.jobs import (
    BackfillRef,
    JobInput,
    JobRecord,
    JobStatus,
    JobStore,
    TransitionError,
    input_key,
    new_job_id,
    result_key,
)


@pytest.fixture
def store(settings) -> JobStore:
    return JobStore(redis.Redis.from_url(settings.redis_url))


def record() -> JobRecord:
    return JobRecord(
        id=new_job_id(), model="tiny.en", input=JobInput(kind="audio", bytes=10, format="wav")
    )


def test_lifecycle_sets_timestamps_and_attempts(store):
    job = record()
    store.create(job)
    assert store.get(job.id).status is JobStatus.queued
    running = store.transition(job.id, JobStatus.running)
    assert running.attempts == 1 and running.started_at is not None
    done = store.transition(job.id, JobStatus.succeeded)
    assert done.finished_at >= done.started_at >= done.created_at
    assert store.get(job.id) == done


def test_terminal_states_never_change(store):
    job = record()
    store.create(job)
    store.transition(job.id, JobStatus.failed)
    for to in JobStatus:
        with pytest.raises(TransitionError, match="is failed"):
            store.transition(job.id, to)


def test_an_ended_record_stays_its_retention_then_leaves_get_and_the_list(settings):
    store = JobStore(redis.Redis.from_url(settings.redis_url), retention_s=1)
    ends = {to: record() for to in (JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled)}
    backfill = record().model_copy(update={"backfill": BackfillRef(id="b1", run=1)})
    for job in [*ends.values(), backfill]:
        store.create(job)
        store.transition(job.id, JobStatus.running)
        assert store.redis.ttl(f"whisperfleet:job:{job.id}") == -1  # kept while it runs
    for job_id, to in [*((j.id, to) for to, j in ends.items()), (backfill.id, JobStatus.succeeded)]:
        store.transition(job_id, to)
    for job in ends.values():
        assert 0 < store.redis.pttl(f"whisperfleet:job:{job.id}") <= 1000
    store.count_quarantine_death(ends[JobStatus.failed].id)  # a change after the end keeps it
    assert 0 < store.redis.pttl(f"whisperfleet:job:{ends[JobStatus.failed].id}") <= 1000
    assert store.redis.ttl(f"whisperfleet:job:{backfill.id}") == -1  # its scanner lets it go
    time.sleep(1.2)
    assert store.get_many([j.id for j in ends.values()]) == [None] * 3
    assert [r.id for r in store.page("default", limit=10).records] == [backfill.id]
    # the list dropped the entries it met without a record
    assert store.redis.zcard("whisperfleet:tenant:default:jobs") == 1


def test_list_entries_older_than_a_record_can_live_are_forgotten(store):
    now = datetime.now(UTC)
    old, recent = [], []
    for tenant in ("acme", "beta"):
        for age_days, kept in ((40, old), (31, old), (29, recent)):
            job = record().model_copy(
                update={"tenant": tenant, "created_at": now - timedelta(days=age_days)}
            )
            store.create(job)
            kept.append(job)
    assert store.forget_listed(now - timedelta(days=30)) == 4
    for tenant in ("acme", "beta"):
        listed = store.redis.zrange(f"whisperfleet:tenant:{tenant}:jobs", 0, -1)
        assert listed == [j.listed_as.encode() for j in recent if j.tenant == tenant]
        assert store.in_flight(tenant) == 3  # nothing else of the tenant's is touched
    assert all(store.get_many([j.id for j in old]))  # records go by their own expiry


def test_create_refuses_an_existing_id(store):
    job = record()
    store.create(job)
    with pytest.raises(TransitionError, match="already exists"):
        store.create(job)


def test_concurrent_finishers_only_one_wins(store):
    job = record()
    store.create(job)
    store.transition(job.id, JobStatus.running)
    wins, barrier = [], threading.Barrier(8)

    def finish(to):
        barrier.wait()
        try:
            store.transition(job.id, to)
            wins.append(to)
        except TransitionError:
            pass

    threads = [
        threading.Thread(target=finish, args=(s,))
        for s in [JobStatus.succeeded, JobStatus.failed] * 4
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and store.get(job.id).status is wins[0]


def test_storage_keys_never_hold_client_names():
    assert input_key("default", "abc") == "jobs/default/abc/input"
    assert result_key("default", "abc") == "jobs/default/abc/result.json"
