"""Backfills on the real stack: our own Redis, moto's S3 server, the API, real workers (tiny.en
on the CPU), the scanner, and two beat processes, all as processes; a scanner and a worker
`kill -9`ed mid-run. Counts are scaled for CI: WHISPERFLEET_TEST_BACKFILL_AUDIO (default 12)
audio objects among the 200 of the first prefix."""

from __future__ import annotations

import json
import os
import time
import uuid

import httpx
import pytest

from tests.conftest import free_port, wait_for_port
from tests.faults.fleet import Fleet, StorageServer, make_fleet
from worker.contract.backfills import BackfillStore

pytestmark = pytest.mark.slow

AUDIO = int(os.environ.get("WHISPERFLEET_TEST_BACKFILL_AUDIO", "12"))
MALFORMED, EMPTY, OTHER = 60, 20, 120 - AUDIO  # 200 objects in all
JOBS = AUDIO + MALFORMED + EMPTY  # the objects named as audio: each a job
NEW = 6  # objects added once the first run is done
ARCHIVE = f"archive-{uuid.uuid4().hex[:10]}"
BOUND = 12  # the bulk queue's bound: the scan of `crash/` lasts as long as its jobs


class Stack:
    def __init__(self, fleet: Fleet, url: str, inputs: list[bytes]):
        self.fleet, self.url, self.inputs = fleet, url, inputs
        self.http = httpx.Client(base_url=url, timeout=30)
        self.backfills = BackfillStore(fleet.redis)
        self.s3 = fleet.storage.client

    def put(self, key: str, data: bytes) -> None:
        self.s3.put_object(Bucket=ARCHIVE, Key=key, Body=data)

    def put_prefix(self, prefix: str, audio: int, malformed: int, empty: int, other: int):
        for i in range(audio):
            self.put(f"{prefix}a/{i:04d}.flac", self.inputs[i % len(self.inputs)])
        for i in range(malformed):  # a FLAC header, then nothing a decoder can read
            self.put(f"{prefix}m/{i:04d}.flac", b"fLaC" + os.urandom(64))
        for i in range(empty):
            self.put(f"{prefix}e/{i:04d}.wav", b"")
        for i in range(other):
            self.put(f"{prefix}o/{i:04d}" + (".txt", ".json", ".jpg")[i % 3], b"not audio")

    def start(self, prefix: str, **spec) -> dict:
        answer = self.http.post(
            "/v1/backfills", json={"source": f"s3://{ARCHIVE}/{prefix}", **spec}
        )
        assert answer.status_code == 201, answer.text
        return answer.json()

    def get(self, backfill_id: str) -> dict:
        return self.http.get(f"/v1/backfills/{backfill_id}").json()

    def wait(self, backfill_id: str, until, timeout: float = 600) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            seen = self.get(backfill_id)
            if until(seen):
                return seen
            time.sleep(0.5)
        raise TimeoutError(f"backfill {backfill_id}: {json.dumps(seen)[:2000]}")

    def manifest(self, backfill_id: str) -> list[dict]:
        answer = self.http.get(f"/v1/backfills/{backfill_id}/manifest")
        assert answer.status_code == 200
        return [json.loads(line) for line in answer.text.splitlines()]

    def wait_manifest(self, backfill_id: str, lines: int, timeout: float = 60) -> list[dict]:
        deadline = time.monotonic() + timeout
        while len(found := self.manifest(backfill_id)) < lines:
            assert time.monotonic() < deadline, f"{len(found)} manifest lines of {lines}"
            time.sleep(0.5)
        return found

    def beats_sent(self, backfill_id: str) -> list[int]:
        """How many times each beat process sent the backfill's scheduled run."""
        logs = [self.fleet.log_path(self.fleet.workers.index(b)) for b in self.beats]
        return [p.read_text().count(f"Sending due task backfill:{backfill_id}") for p in logs]

    def jobs_of(self, backfill_id: str) -> list:
        store = self.fleet.store
        ids = [k.decode().rpartition(":")[2] for k in store.redis.scan_iter("whisperfleet:job:*")]
        return [r for r in store.get_many(ids) if r and r.backfill and r.backfill.id == backfill_id]

    def run_created(self, backfill_id: str) -> dict[int, int]:
        counts = self.fleet.redis.hgetall(self.backfills.key(backfill_id, "counts"))
        return {
            int(k.decode().split(":")[1]): int(v)
            for k, v in counts.items()
            if k.decode().startswith("run:") and k.decode().endswith(":created")
        }


@pytest.fixture(scope="module")
def stack(tmp_path_factory, inputs):
    folder = tmp_path_factory.mktemp("backfills")
    storage = StorageServer()
    fleet = make_fleet(
        folder,
        storage,
        TENANT_SOURCES=f"s3://{ARCHIVE}/",
        BACKFILL_QUEUE_BOUND=str(BOUND),
        MAX_AUDIO_S="60",
    )
    fleet.storage.client.create_bucket(Bucket=ARCHIVE)
    fleet.storage.client.put_bucket_versioning(  # a result written twice would show
        Bucket=fleet.settings.s3_bucket, VersioningConfiguration={"Status": "Enabled"}
    )
    port = free_port()
    api = fleet.start("api", "--port", str(port))
    fleet.start_worker()
    scanner = fleet.start("scanner")
    beats = [fleet.start("beat"), fleet.start("beat")]
    try:
        wait_for_port(port, api)
        s = Stack(fleet, f"http://127.0.0.1:{port}", inputs)
        s.scanner, s.beats = scanner, beats
        yield s
    finally:
        fleet.close()
        storage.close()
        for path in sorted(folder.glob("worker-*.log")):
            print(f"--- {path.name}\n{path.read_text()[-4000:]}")


def ended(seen: dict) -> bool:
    return seen["run"]["scanned_at"] is not None and seen["counts"]["in_flight"] == 0


def test_a_prefix_is_done_once_reruns_make_nothing_and_a_schedule_takes_only_new_objects(stack):
    stack.put_prefix("big/", AUDIO, MALFORMED, EMPTY, OTHER)
    backfill = stack.start("big/", schedule="@every 10s", formats=["srt"])
    bid = backfill["id"]
    seen = stack.wait(bid, lambda s: ended(s) and s["counts"]["created"] == JOBS, timeout=900)
    counts = seen["counts"]
    assert (counts["succeeded"], counts["failed"]) == (AUDIO, MALFORMED + EMPTY), counts
    assert seen["failed_by_code"] == {"invalid_audio": MALFORMED + EMPTY}
    assert seen["audio_hours"] > 0
    jobs = stack.jobs_of(bid)
    assert len(jobs) == JOBS and len({j.source for j in jobs}) == JOBS  # each object, once

    # every job in the manifest once, with its outputs; failures with their reasons
    lines = stack.wait_manifest(bid, JOBS)
    by_key = {line["key"]: line for line in lines}
    assert len(by_key) == len(lines) == JOBS
    assert not any(k.startswith("big/o/") for k in by_key)  # not audio: left out
    for key, line in by_key.items():
        if key.startswith("big/a/"):
            assert line["status"] == "succeeded" and line["audio_s"] > 0
            assert [r.rpartition(".")[2] for r in line["results"]] == ["json", "srt"]
        else:
            assert line["status"] == "failed" and line["error"]["code"] == "invalid_audio"
            assert line["error"]["message"]
    out_bucket, _, out_prefix = seen["output"].removeprefix("s3://").partition("/")
    srt = stack.s3.get_object(Bucket=out_bucket, Key=f"{out_prefix}a/0000.flac.srt")
    assert b"-->" in srt["Body"].read()

    # the next scheduled run finds everything done: no job
    run = seen["run"]["number"]
    again = stack.wait(bid, lambda s: s["run"]["number"] > run and s["run"]["scanned_at"])
    assert again["run"]["created"] == 0 and again["counts"]["created"] == JOBS
    assert again["run"]["skipped"] == JOBS and again["run"]["excluded"] == OTHER

    # new objects: the scheduled runs from now on make exactly their jobs
    before = again["run"]["number"]
    for i in range(NEW):
        stack.put(f"big/new/{i:02d}.flac", stack.inputs[i % len(stack.inputs)])
    seen = stack.wait(bid, lambda s: ended(s) and s["counts"]["created"] == JOBS + NEW)
    made = stack.run_created(bid)
    assert sum(n for run, n in made.items() if run > before) == NEW, made
    assert seen["counts"]["succeeded"] == AUDIO + NEW
    new = [j for j in stack.jobs_of(bid) if "/new/" in j.source]
    assert len(new) == NEW and all(j.status == "succeeded" for j in new)

    # two beats ran all along: one sent each scheduled time, once, and each was taken once
    # (a run began, or it was counted skipped while the last run was still listing)
    run = stack.get(bid)["run"]["number"]
    stack.wait(bid, lambda s: s["run"]["number"] > run)
    time.sleep(2)  # what was sent has arrived; the next time is 8 s away
    seen, sent = stack.get(bid), stack.beats_sent(bid)
    received = int(stack.fleet.redis.hget(stack.backfills.key(bid, "counts"), "scheduled"))
    assert sorted(sent)[0] == 0 and sum(sent) == received >= 4, (sent, received)
    assert received == seen["run"]["number"] - 1 + seen["runs_skipped"]
    assert stack.http.delete(f"/v1/backfills/{bid}").json()["status"] == "cancelled"


def test_a_killed_scanner_and_worker_leave_the_totals_of_a_calm_run(stack):
    audio, malformed, other = 16, 6, 3
    jobs = audio + malformed
    stack.put_prefix("crash/", audio, malformed, 0, other)
    bid = stack.start("crash/")["id"]
    stack.wait(bid, lambda s: s["counts"]["created"] >= 4)
    assert stack.get(bid)["run"]["scanned_at"] is None  # mid-scan: the bound holds it back
    stack.scanner.kill()  # kill -9
    stack.scanner.wait()
    stack.scanner = stack.fleet.start("scanner")
    worker = stack.fleet.workers[1]  # the first worker
    deadline = time.monotonic() + 120
    while not any(j.status == "running" for j in stack.jobs_of(bid)):
        assert time.monotonic() < deadline, "no job of the backfill ever ran"
        time.sleep(0.1)
    worker.kill()  # kill -9, mid-run
    worker.wait()
    stack.fleet.start_worker()
    seen = stack.wait(bid, lambda s: s["status"] == "done", timeout=600)
    counts = seen["counts"]
    assert (counts["created"], counts["succeeded"], counts["failed"]) == (jobs, audio, malformed)
    run = seen["run"]
    assert (run["listed"], run["excluded"], run["skipped"]) == (jobs + other, other, 0)
    made = stack.jobs_of(bid)
    assert len(made) == jobs and len({j.source for j in made}) == jobs  # no object twice
    for job in made:  # each result written once
        if job.status == "succeeded":
            versions = stack.s3.list_object_versions(
                Bucket=stack.fleet.settings.s3_bucket, Prefix=job.result_key
            )
            assert len(versions.get("Versions", [])) == 1, job.id
    lines = stack.wait_manifest(bid, jobs)
    assert sorted(line["job_id"] for line in lines) == sorted(j.id for j in made)
    assert any(j.attempts > 1 for j in made)  # the job the killed worker ran, taken over


def test_a_backfill_of_conversations_gives_each_its_speakers(stack):
    """Archived conversations (two and three real voices), backfilled with diarize: each
    result names its speakers, and the subtitles written out carry them."""
    import io

    import soundfile as sf

    from tests.conftest import built_conversations

    made = built_conversations()
    for conv in made:
        buf = io.BytesIO()
        sf.write(buf, conv.samples, 16000, format="FLAC")
        stack.put(f"calls/{conv.name}.flac", buf.getvalue())
    bid = stack.start("calls/", diarize=True, formats=["srt"])["id"]
    seen = stack.wait(bid, lambda s: s["status"] == "done", timeout=600)
    assert seen["counts"]["succeeded"] == len(made), seen
    out_bucket, _, out_prefix = seen["output"].removeprefix("s3://").partition("/")
    for conv in made:
        [job] = [j for j in stack.jobs_of(bid) if j.source.endswith(f"{conv.name}.flac")]
        assert job.options.diarize is True
        result = json.loads(
            stack.s3.get_object(Bucket=stack.fleet.settings.s3_bucket, Key=job.result_key)[
                "Body"
            ].read()
        )
        assert len(result["speakers"]) == len(conv.speakers), conv.name
        assert all(s["speaker"] for s in result["segments"])
        srt = stack.s3.get_object(Bucket=out_bucket, Key=f"{out_prefix}{conv.name}.flac.srt")
        assert srt["Body"].read().decode().count("[SPEAKER_0") == len(result["segments"])
