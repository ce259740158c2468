"""The task's hooks when Redis is away: the job's message goes back to its queue, never acked
away (its next delivery finds the stored result)."""

import pytest
import redis
from celery.app.task import Task
from celery.exceptions import Reject
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.conftest import free_port
from worker.contract.jobs import JobStore
from worker.jobs.execute import JobFailed, Stored
from worker.jobs.leases import Leases
from worker.jobs.tasks import transcribe


@pytest.fixture
def redis_away(monkeypatch):
    """The task's Redis is a port nobody listens on; a delivery that took its job's lease."""
    no_retries = Retry(NoBackoff(), 0)
    away = JobStore(redis.Redis(port=free_port(), socket_connect_timeout=0.2, retry=no_retries))
    monkeypatch.setitem(transcribe.__dict__, "store", away)
    monkeypatch.setitem(transcribe.__dict__, "leases", Leases(away.redis, "me", 30))
    transcribe.leases.held.add("job")
    transcribe.push_request(args=["job"], leased=True)
    yield
    transcribe.pop_request()


@pytest.mark.parametrize(
    "hook, args",
    [
        ("on_success", (Stored(duration=1.0), "task", ["job"], {})),
        ("on_failure", (JobFailed("invalid_audio", "not audio"), "task", ["job"], {}, None)),
    ],
)
def test_a_record_move_without_redis_puts_the_message_back(redis_away, hook, args):
    with pytest.raises(Reject) as rejected:
        getattr(transcribe, hook)(*args)
    assert rejected.value.requeue
    # the lease is no longer renewed by this worker: it lapses, and the job is taken over
    assert "job" not in transcribe.leases.held


def test_a_retry_that_cannot_be_sent_puts_the_message_back(redis_away, monkeypatch):
    def celery_retry(self, *args, **kwargs):  # what Celery does when the broker is away
        raise Reject(redis.ConnectionError("broker away"), requeue=False)

    monkeypatch.setattr(Task, "retry", celery_retry)
    with pytest.raises(Reject) as rejected:
        transcribe.retry(exc=redis.ConnectionError("storage read"))
    assert rejected.value.requeue and "job" not in transcribe.leases.held
