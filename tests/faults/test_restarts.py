"""The reliability contract when what the workers depend on goes away: Redis restarted, the
storage frozen, a job outliving the visibility timeout, a worker's leases renewed and a dead
one's jobs taken over (`tests/faults/fleet.py`: its own Redis, moto's S3 server, real
worker processes)."""

from __future__ import annotations

import time

import pytest

from tests.conftest import long_speech
from tests.faults.fleet import RUNNING, make_fleet, submit_many

pytestmark = pytest.mark.slow


def test_a_job_longer_than_the_visibility_timeout_runs_once(tmp_path, storage_server):
    fleet = make_fleet(tmp_path, storage_server, VISIBILITY_TIMEOUT_S=2)
    try:
        [job] = [fleet.submit(long_speech(200))]  # running for 8 s and more
        fleet.start_worker()
        fleet.start_worker()
        fleet.wait_until([job], RUNNING, 1, timeout=120)
        time.sleep(3)  # past the visibility timeout, still running
        assert fleet.store.get(job).status == "running"
        fleet.redeliver_overdue()
        fleet.wait_all([job])
        tally = fleet.tally([job])
        assert (tally.succeeded, tally.duplicates, tally.lost) == (1, 0, 0)
        assert fleet.store.get(job).attempts == 1
        assert "is running on" in fleet.logs()  # redelivered, and dropped: the lease held
    finally:
        fleet.close()


@pytest.mark.parametrize(
    "fsync, how", [("everysec", "restart_gracefully"), ("always", "restart_after_kill")]
)
def test_a_redis_restart_loses_no_accepted_job(tmp_path, storage_server, inputs, fsync, how):
    fleet = make_fleet(tmp_path, storage_server, fsync)
    try:
        ids = submit_many(fleet, inputs, 8)
        # supervised, as a worker is deployed: Celery's worker may exit when Redis is
        # killed under it (kombu fails to reconnect while it stops), and is started again
        fleet.start_worker(None, "--gpus", "0")
        fleet.wait_until(ids, RUNNING, 1, timeout=120)
        getattr(fleet.redis_server, how)()
        ids += submit_many(fleet, inputs, 8)  # accepted after the restart
        fleet.wait_all(ids)
        tally = fleet.tally(ids)
        assert (tally.succeeded, tally.duplicates, tally.lost) == (16, 0, 0)
    finally:
        fleet.close()
        print(fleet.logs()[-15000:])


def test_storage_frozen_for_20_s_delays_jobs_and_fails_none(fleet, storage_server, inputs):
    """Frozen for longer than the lease (3 s) and the stale clock (2 s) many times over."""
    ids = submit_many(fleet, inputs, 12)
    fleet.start_worker()
    fleet.wait_until(ids, RUNNING, 1, timeout=120)
    storage_server.freeze()  # moto keeps objects in memory only: stopped, never restarted
    time.sleep(20)
    storage_server.thaw()
    fleet.wait_all(ids)
    tally = fleet.tally(ids)
    assert (tally.succeeded, tally.failed, tally.duplicates, tally.lost) == (12, 0, 0, 0)


def test_a_plain_celery_worker_renews_its_leases_and_takes_over_a_dead_workers_jobs(
    tmp_path, storage_server, inputs
):
    """`celery -A worker.app worker`, as operators start workers, gets what `whisperfleet
    worker` gets from Celery's signals: its heartbeat keeps the lease of a job longer than the
    lease (another worker's reconciler would take it over otherwise), and its reconciler takes
    over the jobs of a `whisperfleet worker` killed mid-batch."""
    fleet = make_fleet(tmp_path, storage_server)
    try:
        plain = fleet.start_celery_worker()
        # 150 s of speech: it runs many times the lease (3 s), renewed by the heartbeat alone
        [long_job] = [fleet.submit(long_speech(150))]
        fleet.wait_until([long_job], RUNNING, 1, timeout=120)
        ours = fleet.start_worker()
        deadline = time.monotonic() + 180  # warm (its graphs captured) before it takes a job
        while fleet.logs().count("loaded and warm") < 2:
            assert time.monotonic() < deadline and ours.poll() is None, "the worker never warmed"
            time.sleep(0.2)
        ids = submit_many(fleet, inputs, 12)
        deadline = time.monotonic() + 120
        while not any(
            (r := fleet.store.get(i)).status == "running" and r.worker.endswith(f":{ours.pid}")
            for i in ids
        ):
            assert time.monotonic() < deadline, "the second worker never ran a job"
            time.sleep(0.1)
        ours.kill()  # mid-batch
        ours.wait()
        fleet.wait_all(ids + [long_job])
        tally = fleet.tally(ids + [long_job])
        assert (tally.succeeded, tally.duplicates, tally.lost) == (13, 0, 0)
        record = fleet.store.get(long_job)
        assert record.attempts == 1 and record.worker.endswith(f":{plain.pid}")
        assert "has no live worker: sent again" in fleet.log_path(0).read_text()
    finally:
        fleet.close()
        print(fleet.logs()[-15000:])
