"""The worker's metrics listen where they are told (this host only by default), and tell
where a job's time went."""

import time

import httpx
import psutil
import pytest
import redis
from prometheus_client import REGISTRY

from tests.conftest import free_port
from worker import metrics
from worker.contract.jobs import JobInput, JobRecord, JobStore, new_job_id
from worker.contract.settings import Settings
from worker.jobs.execute import execute
from worker.jobs.looks import Looks
from worker.jobs.tasks import transcribe
from worker.storage import Storage


@pytest.fixture(scope="module")
def served() -> int:
    """The metrics server of this process (one per process, as in a worker): its port."""
    port = free_port()
    store = JobStore(redis.Redis.from_url(Settings().redis_url))
    metrics.serve("127.0.0.1", port, store, set())
    return port


def test_metrics_listen_on_the_metrics_host_only(served):
    assert Settings().metrics_host == "127.0.0.1"
    listening = {
        c.laddr.ip
        for c in psutil.Process().net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == served
    }
    assert listening == {"127.0.0.1"}
    assert "whisperfleet_queue_depth" in httpx.get(f"http://127.0.0.1:{served}/metrics").text


def test_ready_says_whether_the_worker_takes_jobs(served):
    metrics.READY.clear()
    loading = httpx.get(f"http://127.0.0.1:{served}/ready")
    assert (loading.status_code, loading.json()) == (503, {"ready": False})
    metrics.READY.set()
    try:
        ready = httpx.get(f"http://127.0.0.1:{served}/ready")
        assert (ready.status_code, ready.json()) == (200, {"ready": True})
    finally:
        metrics.READY.clear()


def samples(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_a_jobs_time_is_told_by_stage_and_the_engine_by_its_busy_seconds(
    settings, clips, monkeypatch, core
):
    """Each stage of a real job on tiny.en is observed once, under its priority; the engine's
    steps count as busy time."""
    store, storage = JobStore(redis.Redis.from_url(settings.redis_url)), Storage(settings)
    storage.ensure_bucket()
    audio = clips["en_jfk"].bytes
    record = JobRecord(
        id=new_job_id(),
        model="tiny.en",
        priority="bulk",
        input=JobInput(kind="audio", bytes=len(audio), format="flac"),
    )
    storage.put_once(record.input_key, audio, "audio/flac")
    store.create(record)
    stages = ("queue", "fetch", "decode", "engine", "store")
    count = "whisperfleet_job_stage_seconds_count"
    before = {s: samples(count, stage=s, priority="bulk") for s in stages}
    engines = core(settings)  # the process's only core: the metrics are its own
    engines.load("tiny.en")
    busy = samples("whisperfleet_engine_busy_seconds_total")

    monkeypatch.setitem(transcribe.__dict__, "store", store)
    running = transcribe.start(record)
    execute(running, store, storage, engines, Looks(store))
    after = {s: samples(count, stage=s, priority="bulk") for s in stages}
    assert {s: after[s] - before[s] for s in stages} == dict.fromkeys(stages, 1.0)
    deadline = time.monotonic() + 5  # the engine core sends its metrics every second
    while samples("whisperfleet_engine_busy_seconds_total") <= busy:
        assert time.monotonic() < deadline, "the engine core's busy seconds never came"
        time.sleep(0.1)
    engine = samples("whisperfleet_job_stage_seconds_sum", stage="engine", priority="bulk")
    assert engine > 0
