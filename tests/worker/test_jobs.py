"""Job records on the real Redis: the state machine and its compare-and-set transitions."""

import threading

import pytest
import redis

from worker.contract.jobs import (
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
