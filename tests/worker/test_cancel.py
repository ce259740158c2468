"""Cancelling a job (DELETE /v1/jobs/{id}): a running one leaves the engine's stream at the
batcher's next turn, its slot freed for the others, and nothing of it is stored after; a queued
one never runs. In-process on the batcher and the engines, then with real worker processes."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import SimpleNamespace

import psutil
import pytest
import redis
from botocore.exceptions import ClientError

from engine import TranscriptionOptions
from tests.conftest import long_speech, open_stream
from tests.faults.fleet import Fleet, StorageServer, make_fleet, speech
from worker.contract.jobs import JobInput, JobOptions, JobRecord, JobStatus, JobStore, new_job_id
from worker.contract.results import TranscriptResult
from worker.contract.settings import Settings
from worker.core.batching import Batcher
from worker.core.calls import Cancelled
from worker.jobs.execute import JobCancelled, Stored, execute
from worker.jobs.looks import Looks
from worker.jobs.tasks import transcribe
from worker.storage import Storage


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds until `condition()` held; fails the test after `timeout`."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            pytest.fail(f"not within {timeout} s: {what}")
        time.sleep(0.02)
    return time.monotonic() - start


def test_a_cancelled_input_leaves_the_stream_and_the_others_go_on(clips):
    stream = open_stream("tiny.en", slots=8)
    batcher = Batcher(stream, batch_size=1, max_wait_s=0.0)
    options = TranscriptionOptions()
    long = batcher.submit(stream.prepare(long_speech(220)), options, True)
    wait_for(lambda: long.done_s > 0, 60, "the long input's first window decoded")
    other = batcher.submit(stream.prepare(clips["en_jfk"].bytes), options, True)
    wait_for(lambda: other in stream.owners, 10, "a second input in the stream with it")

    batcher.cancel(long)
    with pytest.raises(Cancelled):
        long.future.result(timeout=5)
    assert long.done_s < long.total_s == 220  # stopped midway
    assert long not in stream.owners
    assert "ask not what your country" in other.future.result(timeout=60).text.lower()
    wait_for(lambda: not stream.busy, 5, "the stream empty")
    after = batcher.submit(stream.prepare(clips["en_jfk"].bytes), options, True)
    assert after.future.result(timeout=60).text == other.future.result().text


def test_a_pending_input_cancelled_never_starts(clips, encoded):
    """Still waiting for its batch to fill: forgotten, never encoded."""
    stream = open_stream("tiny.en", slots=8)
    batcher = Batcher(stream, batch_size=2, max_wait_s=60.0)
    item = stream.prepare(clips["en_jfk"].bytes)
    waiting = batcher.submit(item, TranscriptionOptions(), True)
    batcher.cancel(waiting)
    with pytest.raises(Cancelled):
        waiting.future.result(timeout=5)
    pair = [batcher.submit(item, TranscriptionOptions(), True) for _ in range(2)]
    assert all("ask not" in t.future.result(timeout=60).text.lower() for t in pair)
    assert encoded == [2] and not stream.busy


def test_the_job_thread_stops_when_its_wait_says_cancelled(clips, core):
    """EngineCore.transcribe asks `on_wait` every `wait_s`, with the input's progress as the
    core reports it; True: Cancelled, and the input leaves the core's stream. With one slot,
    the next input could not start while the cancelled one held it."""
    engines = core(Settings(models="tiny.en", device="cpu"), slots=1)
    asked = threading.Event()

    def on_wait(call) -> bool:
        asked.set()
        return call.done_s > 0

    data = long_speech(440)
    start = time.monotonic()
    with pytest.raises(Cancelled):
        engines.transcribe("tiny.en", data, JobOptions(), on_wait=on_wait, wait_s=0.2)
    assert asked.is_set() and time.monotonic() - start < 30  # 440 s of speech: not to the end
    start = time.monotonic()
    assert "ask not" in engines.transcribe("tiny.en", clips["en_jfk"].bytes, JobOptions()).text
    assert time.monotonic() - start < 15  # the windows left of the cancelled one: ~40 CPU s


# The job's run (worker.jobs.execute) and the task's hooks, in this process: Redis db 14, moto's S3.


class Stub:
    """Engines whose transcription calls `during(on_wait)`, then returns a result."""

    def __init__(self, during: Callable[[Callable], None] = lambda on_wait: None):
        self.during = during

    def transcribe(self, name, data, options, urgent=True, on_wait=None, wait_s=0.5):
        self.during(on_wait)
        return TranscriptResult(
            text="ask not",
            language="en",
            language_probability=None,
            duration=11.0,
            segments=[],
            model=name,
            options=options,
        )


@pytest.fixture
def job(settings) -> tuple[JobRecord, JobStore, Storage]:
    """A running job, its input uploaded."""
    store, storage = JobStore(redis.Redis.from_url(settings.redis_url)), Storage(settings)
    storage.ensure_bucket()
    record = JobRecord(
        id=new_job_id(), model="tiny.en", input=JobInput(kind="audio", bytes=3, format="flac")
    )
    storage.put_once(record.input_key, b"fLaC", "audio/flac")
    store.create(record)
    return store.transition(record.id, JobStatus.running), store, storage


def api_cancel(store: JobStore, storage: Storage, job_id: str) -> None:
    """What DELETE /v1/jobs/{id} does: the record to `cancelled`, then the job's objects."""
    record = store.transition(job_id, JobStatus.cancelled)
    for key in record.owned_keys:
        storage.delete(key)


def exists(storage: Storage, key: str) -> bool:
    try:
        storage.client.head_object(Bucket=storage.bucket, Key=key)
    except ClientError as e:
        assert e.response["Error"]["Code"] in ("404", "NoSuchKey")
        return False
    return True


def test_the_wait_learns_of_the_cancel_and_leaves_the_record_as_it_is(job):
    """The job's wait answers from the process's looks: its progress is written, then, once a
    look found the job cancelled, the run stops; the cancelled record is not written again (it
    keeps the expiry the API gave it)."""
    record, store, storage = job
    looks = Looks(store)  # looked at by hand, not by its thread
    answers = []

    def during(on_wait):
        ticket = SimpleNamespace(done_s=3.0, total_s=11.0)
        answers.append(on_wait(ticket))
        looks.look(write_progress=True)
        assert store.get(record.id).progress.done_s == 3.0
        api_cancel(store, storage, record.id)
        store.expire(record.id, 600)
        answers.append(on_wait(ticket))  # not looked at since
        looks.look(write_progress=True)
        answers.extend(on_wait(ticket) for _ in range(2))

    with pytest.raises(JobCancelled):
        execute(record, store, storage, Stub(during), looks)
    assert answers == [False, False, True, True]
    assert store.get(record.id).status is JobStatus.cancelled
    assert store.get(record.id).progress.done_s == 3.0
    assert 0 < store.redis.ttl(store._key(record.id)) <= 600
    assert not exists(storage, record.result_key)


def test_cancelled_in_its_last_moments_a_job_stores_nothing(job, monkeypatch):
    record, store, storage = job
    puts = []
    monkeypatch.setattr(Storage, "put_once", lambda self, *args: puts.append(args))
    with pytest.raises(JobCancelled):
        cancel = Stub(lambda _: api_cancel(store, storage, record.id))
        execute(record, store, storage, cancel, Looks(store))
    assert puts == []


def test_a_result_stored_after_the_api_deleted_the_jobs_objects_is_deleted(job, monkeypatch):
    """The cancel lands between the run's last look and its put: the API found no result to
    delete, the put stores one, and the run's look after the put deletes it."""
    record, store, storage = job
    put_once = Storage.put_once

    def put_after_a_cancel(self, key, *args):
        api_cancel(store, storage, record.id)
        assert put_once(self, key, *args)
        assert exists(storage, key)
        return True

    monkeypatch.setattr(Storage, "put_once", put_after_a_cancel)
    with pytest.raises(JobCancelled):
        execute(record, store, storage, Stub(), Looks(store))
    assert not exists(storage, record.result_key)
    assert not exists(storage, record.input_key)


@pytest.mark.parametrize("ended", [JobStatus.cancelled, JobStatus.succeeded])
def test_a_success_that_lost_to_a_cancel_deletes_its_result(job, monkeypatch, ended):
    """on_success finds the job ended meanwhile: cancelled, its result goes; ended otherwise
    (another run's success), the result stays."""
    record, store, storage = job
    storage.put_once(record.result_key, b"{}", "application/json")
    store.transition(record.id, ended)
    monkeypatch.setitem(transcribe.__dict__, "store", store)
    monkeypatch.setitem(transcribe.__dict__, "storage", storage)
    transcribe.push_request(args=[record.id], leased=False)
    try:
        stored = Stored(duration=11.0, result_key=record.result_key)
        transcribe.on_success(stored, "task", [record.id], {})
    finally:
        transcribe.pop_request()
    assert store.get(record.id).status is ended
    assert exists(storage, record.result_key) is (ended is JobStatus.succeeded)


def test_a_job_cancelled_between_its_claim_and_its_start_is_dropped(job, monkeypatch):
    record, store, storage = job
    queued = store.transition(record.id, JobStatus.queued)
    api_cancel(store, storage, record.id)
    monkeypatch.setitem(transcribe.__dict__, "store", store)
    assert transcribe.start(queued) is None
    assert store.get(record.id).status is JobStatus.cancelled


# Real processes: a fleet's own Redis, moto's S3 server, `whisperfleet worker` on the CPU.


@pytest.fixture
def fleet(tmp_path):
    """One decoding slot: an input that kept its slot would hold up every other job."""
    storage_server = StorageServer()
    fleet = make_fleet(tmp_path, storage_server, SLOT_MEMORY_BYTES=1)
    yield fleet
    fleet.close()
    storage_server.close()
    print(fleet.logs()[-15000:])


def cancel(fleet: Fleet, job_id: str) -> None:
    """What DELETE /v1/jobs/{id} does: the record to `cancelled`, then the job's objects."""
    record = fleet.store.transition(job_id, JobStatus.cancelled)
    for key in record.owned_keys:
        fleet.storage.delete(key)


def result_exists(fleet: Fleet, job_id: str) -> bool:
    try:
        fleet.storage.client.head_object(
            Bucket=fleet.storage.bucket, Key=fleet.store.get(job_id).result_key
        )
    except ClientError as e:
        assert e.response["Error"]["Code"] in ("404", "NoSuchKey")
        return False
    return True


def stays_cancelled_without_a_result(fleet: Fleet, job_id: str, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert fleet.store.get(job_id).status is JobStatus.cancelled
        assert not result_exists(fleet, job_id)
        time.sleep(0.25)


@pytest.mark.slow
def test_a_running_job_cancelled_stops_stores_nothing_and_frees_its_slot(fleet, clips):
    worker = fleet.start_worker()
    # 440 s: 40 CPU seconds; chunked, all its windows are ready at once, ahead of the
    # next job's in the queue for the one slot
    chunked = JobOptions(mode="chunked")
    job = fleet.submit(long_speech(440), options=chunked)
    fleet.wait_until_running_on(job, worker.pid, timeout=120)
    wait_for(lambda: fleet.store.get(job).progress.done_s > 0, 60, "its first window decoded")

    cancel(fleet, job)
    stopped = f"job {job} cancelled while running"
    latency = wait_for(lambda: stopped in fleet.logs(), 5, "the worker says it stopped")
    print(f"cancelled job stopped {latency:.2f} s after the cancel")
    stays_cancelled_without_a_result(fleet, job, 5)

    # its only slot is free: a job after it runs now (about a second), not after the rest
    # of 440 s of speech (tens of seconds)
    start = time.monotonic()
    second = fleet.submit(speech(clips["en_jfk"].bytes, 5))
    fleet.wait_all([second], timeout=25)
    print(f"the next job took {time.monotonic() - start:.2f} s")
    record = fleet.store.get(second)
    assert record.status is JobStatus.succeeded and record.worker.endswith(f":{worker.pid}")
    assert fleet.store.get(job).attempts == 1 and worker.poll() is None


@pytest.mark.slow
def test_a_queued_job_cancelled_never_runs(fleet, clips):
    job = fleet.submit(speech(clips["en_jfk"].bytes, 5))
    cancel(fleet, job)
    worker = fleet.start_worker()
    second = fleet.submit(speech(clips["en_jfk"].bytes, 4))  # behind it in the same queue
    fleet.wait_all([second], timeout=120)
    assert fleet.store.get(second).status is JobStatus.succeeded
    assert f"job {job} is already cancelled; dropping this delivery" in fleet.logs()
    record = fleet.store.get(job)
    assert record.attempts == 0 and record.started_at is None
    stays_cancelled_without_a_result(fleet, job, 1)
    assert worker.poll() is None


@pytest.mark.slow
def test_a_quarantined_job_cancelled_has_its_process_killed(fleet, clips):
    """A job whose worker died under it runs in the quarantine lane's own process, which may
    not answer (here it is stopped: SIGSTOP): cancelled, that process is killed (a new one
    takes the next quarantined job), and nothing is stored."""
    job = fleet.submit(long_speech(220))
    fleet.store.transition(job, JobStatus.running, worker="gone:1")  # its worker died
    worker = fleet.start_worker()
    fleet.wait_until_running_on(job, worker.pid, timeout=120)
    wait_for(lambda: fleet.store.get(job).progress.done_s > 0, 90, "its first window decoded")
    assert fleet.store.get(job).quarantined
    spawned = [
        p for p in psutil.Process(worker.pid).children() if "spawn_main" in " ".join(p.cmdline())
    ]
    lane = max(spawned, key=psutil.Process.create_time)  # the engine core started first

    lane.suspend()
    cancel(fleet, job)
    latency = wait_for(lambda: not lane.is_running(), 5, "the quarantine process killed")
    print(f"quarantine process killed {latency:.2f} s after the cancel")
    wait_for(lambda: f"job {job} cancelled while running" in fleet.logs(), 5, "its log line")
    stays_cancelled_without_a_result(fleet, job, 5)
    second = fleet.submit(speech(clips["en_jfk"].bytes, 5))
    fleet.wait_all([second], timeout=60)
    assert fleet.store.get(second).status is JobStatus.succeeded and worker.poll() is None
