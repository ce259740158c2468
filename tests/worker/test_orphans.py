"""The orphan sweeper against the real Redis and a real S3 endpoint (moto's server)."""

import logging
import threading
import time
from datetime import UTC, datetime, timedelta

import redis

from tests.conftest import free_port
from worker.contract.jobs import JobInput, JobRecord, JobStore, new_job_id
from worker.jobs.leases import Leases, Reconciler
from worker.jobs.orphans import OrphanSweeper
from worker.storage import Storage


def _setup(settings):
    storage, store = Storage(settings), JobStore(redis.Redis.from_url(settings.redis_url))
    storage.ensure_bucket()
    return storage, store


def _put(storage, key):
    storage.put_once(key, b"x", "application/octet-stream")


def _keys(storage) -> set[str]:
    return {k for page in storage.pages("") for k in page}


def test_an_input_without_a_record_at_two_sweeps_is_deleted(settings):
    storage, store = _setup(settings)
    claimed = JobRecord(
        id=new_job_id(), model="tiny.en", input=JobInput(kind="audio", bytes=1, format="wav")
    )
    store.create(claimed)
    late = claimed.model_copy(update={"id": new_job_id()})
    orphan = f"jobs/default/{new_job_id()}/input"
    kept = {claimed.input_key, claimed.result_key, late.input_key, "jobs/default/notes.txt"}
    for key in kept | {orphan}:
        _put(storage, key)
    sweeper = OrphanSweeper(storage, store, every_s=0, record_lifetime_s=3600)
    assert sweeper.sweep() == 0  # first look: unclaimed, not yet deleted
    store.create(late)  # its record came after its input (a submission in progress)
    assert sweeper.sweep() == 1
    assert _keys(storage) == kept


def test_storage_away_is_logged_and_swept_again_later(settings, caplog):
    away = settings.model_copy(update={"s3_endpoint_url": f"http://127.0.0.1:{free_port()}"})
    sweeper = OrphanSweeper(
        Storage(away), JobStore(redis.Redis.from_url(away.redis_url)), 3600, record_lifetime_s=3600
    )
    with caplog.at_level(logging.WARNING, "worker.jobs.orphans"):
        sweeper()
        sweeper()  # within every_s: not tried again
    (entry,) = caplog.records
    assert "storage unavailable" in entry.getMessage()


def test_the_reconciler_sweeps_at_its_turns(settings):
    """Inputs without a record go, and list entries of jobs made longer ago than a record
    can live."""
    storage, store = _setup(settings)
    _put(storage, f"jobs/default/{new_job_id()}/input")
    made = datetime.now(UTC) - timedelta(hours=2)
    gone, live = (
        JobRecord(
            id=new_job_id(),
            model="tiny.en",
            input=JobInput(kind="audio", bytes=1, format="wav"),
            created_at=at,
            source="s3://archive/a.wav",  # no input object of its own
        )
        for at in (made, datetime.now(UTC))
    )
    for job in (gone, live):
        store.create(job)
    store.redis.delete(f"whisperfleet:job:{gone.id}")  # its record expired
    listing = f"whisperfleet:tenant:{gone.tenant}:jobs"
    sweeper = OrphanSweeper(storage, store, every_s=0, record_lifetime_s=3600)
    leases = Leases(store.redis, "worker-1", ttl_s=30)
    reconciler = Reconciler(store, leases, lambda record: None, lambda r: None, 60, 3600, sweeper)
    stop = threading.Event()
    thread = threading.Thread(target=reconciler.loop, args=(0.05, stop))
    thread.start()
    deadline = time.monotonic() + 10
    while (_keys(storage) or store.redis.zcard(listing) > 1) and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    thread.join()
    assert _keys(storage) == set()
    assert store.redis.zrange(listing, 0, -1) == [live.listed_as.encode()]
