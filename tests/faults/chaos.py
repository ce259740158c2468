"""A fleet under chaos, as an operator would try it: jobs of real speech (short, long-form,
spectrograms, duplicates) and malformed files from several clients through the REST API,
while a random worker is `kill -9`ed every 10-20 s (a replacement started at once), Redis is
`kill -9`ed and restarted on its AOF, and the object store is frozen for 20 s.

`run` returns a `Report` of what must be zero: jobs lost, duplicate results, transcripts that
differ from a calm run, good jobs failed, malformed inputs not failed with their code, answers
other than 2xx/4xx/503 JSON, objects in storage that no job owns. `tests/faults/test_chaos.py`
runs a short one; `scripts/chaos.py` the full one.
"""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

from tests.conftest import free_port, long_speech, stop, wait_for_port
from tests.faults.fleet import Fleet, at_rate, npy, speech, wav
from worker.contract.jobs import TERMINAL


@dataclass(frozen=True)
class Case:
    """One submission: a file, its form fields, and what it must end as."""

    name: str
    data: bytes
    filename: str
    fields: tuple[tuple[str, str], ...] = ()
    code: str | None = None  # malformed: the error code it must end with; None: a good job


def cases(clips: dict, n: int, seed: int = 0) -> list[Case]:
    """About n submissions: a tenth malformed, a tenth long-form or costly (a repetitive
    prompt that sends every window into temperature fallback, so its text is sampled), a tenth
    spectrograms, the rest short speech of several lengths and sample rates; distinct inputs
    repeat, as duplicates do."""
    from transformers import WhisperFeatureExtractor

    from engine.audio import decode_audio

    english = [c for c in clips.values() if c.language == "en"]
    jfk = clips["en_jfk"].bytes
    short = [
        Case(f"{c.path.stem} {s:.0f} s", speech(c.bytes, s), f"{c.path.stem}.flac")
        for c in english
        for s in (2.0, 4.0, 7.0)
    ] + [
        Case(f"jfk 4 s at {rate} Hz", at_rate(jfk, 4, rate), "a.wav")
        for rate in (8000, 44100, 48001)
    ]
    long = [
        Case("44 s sequential", long_speech(44), "long.flac"),
        Case(
            "66 s chunked",
            long_speech(66),
            "long.flac",
            (("mode", "chunked"),),
        ),
        Case(
            'jfk 1.5 s, prompt "ha " x 333',
            speech(jfk, 1.5),
            "ha.flac",
            (("prompt", ("ha " * 333).strip()),),  # the API strips form values
        ),
    ]
    extractor = WhisperFeatureExtractor(feature_size=80)
    spectrograms = [
        Case(
            f"{c.path.stem} spectrogram",
            npy(extractor(decode_audio(c.bytes), sampling_rate=16000).input_features[0]),
            "mel.npy",
        )
        for c in english[:2]
    ]
    nan = np.zeros((80, 3000), np.float32)
    nan[3, 7] = np.nan
    good = english[0].bytes
    malformed = [
        Case("text", b"this is not audio at all, just some text", "a.flac", code="invalid_audio"),
        Case("empty", b"", "a.flac", code="invalid_audio"),
        Case("truncated flac", good[: len(good) // 3], "a.flac", code="invalid_audio"),
        Case("NaN spectrogram", npy(nan), "a.npy", code="invalid_spectrogram"),
        Case(
            "128 mels", npy(np.zeros((128, 3000), np.float32)), "a.npy", code="invalid_spectrogram"
        ),
        Case("WAV at 4,001 Hz", at_rate(jfk, 2, 4001), "a.wav", code="invalid_audio"),
        Case("7 KB WAV at 1 Hz (58 min)", wav(np.zeros(3500), 1), "a.wav", code="invalid_audio"),
        Case("40 KB WAV at 1 Hz (5.6 h)", wav(np.zeros(20000), 1), "a.wav", code="too_long"),
    ]
    rng = random.Random(seed)
    plan = (
        [rng.choice(malformed) for _ in range(n // 10)]
        + [rng.choice(long) for _ in range(n // 10)]
        + [rng.choice(spectrograms) for _ in range(n // 10)]
    )
    plan += [rng.choice(short) for _ in range(n - len(plan))]
    rng.shuffle(plan)
    return plan


def calm_texts(stream, plan: list[Case]) -> dict[str, str]:
    """Each good input's text, transcribed alone by `stream` (tiny.en on the CPU, as the
    workers run it)."""
    from worker.contract.options import JobCreate
    from worker.core.transcripts import engine_options

    texts = {}
    for case in {c.name: c for c in plan if c.code is None}.values():
        options = JobCreate.parse(dict(case.fields)).options
        texts[case.name] = stream.transcribe([case.data], engine_options(options, case.data))[
            0
        ].text
    return texts


# what a run must find none of, in the order reports print them
PROBLEMS = (
    "lost",
    "duplicates",
    "different",
    "good_failed",
    "malformed_wrong",
    "bad_answers",
    "orphans",
)


@dataclass
class Report:
    submitted: int = 0
    accepted: int = 0
    refused: Counter = field(default_factory=Counter)  # error code at the API
    lost: list[str] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)
    different: list[str] = field(default_factory=list)
    good_failed: list[str] = field(default_factory=list)
    malformed_wrong: list[str] = field(default_factory=list)
    bad_answers: list[str] = field(default_factory=list)
    orphans: list[str] = field(default_factory=list)
    answers: Counter = field(default_factory=Counter)  # HTTP status of every answer
    events: list[str] = field(default_factory=list)  # what the chaos did, when
    seconds: float = 0.0

    def problems(self) -> dict[str, list]:
        return {name: getattr(self, name) for name in PROBLEMS if getattr(self, name)}

    def __str__(self) -> str:
        counts = ", ".join(f"{name} {len(getattr(self, name))}" for name in PROBLEMS)
        answers = ", ".join(f"{k}: {v}" for k, v in sorted(self.answers.items()))
        return (
            f"submitted {self.submitted}, accepted {self.accepted}, refused at the door "
            f"{dict(self.refused)}, in {self.seconds:.0f} s; {counts}; answers {answers}; "
            f"chaos: {'; '.join(self.events)}"
        )


class Client:
    """Talks to the API as a careful client does: 503 means try again after Retry-After."""

    def __init__(self, url: str, report: Report, lock: threading.Lock):
        self.url, self.report, self.lock = url, report, lock
        self.http = httpx.Client(timeout=120)

    def _answer(self, response: httpx.Response, what: str) -> None:
        json_body = response.headers.get("content-type", "").startswith("application/json")
        ok = response.status_code < 300 or response.status_code in range(400, 500)
        ok = ok or (response.status_code == 503 and "retry-after" in response.headers)
        with self.lock:
            self.report.answers[response.status_code] += 1
            if not ok or (response.status_code >= 400 and not json_body):
                self.report.bad_answers.append(
                    f"{what}: {response.status_code} {response.text[:80]}"
                )

    def request(self, what: str, send) -> httpx.Response:
        while True:
            try:
                response = send()
            except httpx.TransportError as e:  # no answer at all
                with self.lock:
                    self.report.bad_answers.append(f"{what}: {type(e).__name__}")
                time.sleep(1)
                continue
            self._answer(response, what)
            if response.status_code != 503:
                return response
            time.sleep(float(response.headers.get("retry-after", "1")))

    def submit(self, case: Case) -> tuple[str | None, str | None]:
        """(job id, None) when accepted, (None, error code) when refused."""
        response = self.request(
            f"POST {case.name}",
            lambda: self.http.post(
                f"{self.url}/v1/jobs",
                files={"file": (case.filename, case.data)},
                data=dict(case.fields),
            ),
        )
        if response.status_code == 202:
            return response.json()["id"], None
        return None, response.json()["error"]["code"]

    def job(self, job_id: str) -> dict:
        return self.request(
            f"GET {job_id}", lambda: self.http.get(f"{self.url}/v1/jobs/{job_id}")
        ).json()

    def text(self, job_id: str) -> str:
        response = self.request(
            f"GET {job_id}/result", lambda: self.http.get(f"{self.url}/v1/jobs/{job_id}/result")
        )
        return response.json()["text"]


class Monkey:
    """Kills a random worker every `kill_every_s` (a replacement started at once; `kills` of
    them, or until the jobs end), Redis once at `redis_at_s`, freezes storage at
    `freeze_at_s` for `freeze_s`."""

    def __init__(
        self,
        fleet: Fleet,
        storage,
        report: Report,
        kill_every_s: tuple[float, float],
        redis_at_s: float | None,
        freeze_at_s: float | None,
        freeze_s: float,
        kills: int | None = None,
        seed: int = 0,
    ):
        self.fleet, self.storage, self.report, self.kills = fleet, storage, report, kills
        self.kill_every_s, self.redis_at_s = kill_every_s, redis_at_s
        self.freeze_at_s, self.freeze_s = freeze_at_s, freeze_s
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _log(self, start: float, what: str) -> None:
        self.report.events.append(f"{time.monotonic() - start:.0f} s {what}")

    def _run(self) -> None:
        start = time.monotonic()
        next_kill = start + self.rng.uniform(*self.kill_every_s)
        redis_at = start + self.redis_at_s if self.redis_at_s is not None else None
        freeze_at = start + self.freeze_at_s if self.freeze_at_s is not None else None
        thaw_at = None
        while not self.stop.wait(0.2):
            now = time.monotonic()
            if now >= next_kill and self.kills != 0:
                if self.kills is not None:
                    self.kills -= 1
                alive = [w for w in self.fleet.workers if w.poll() is None]
                victim = self.rng.choice(alive)
                victim.kill()
                victim.wait()
                self.fleet.start_worker()
                self._log(start, f"worker {victim.pid} killed")
                next_kill = now + self.rng.uniform(*self.kill_every_s)
            if redis_at and now >= redis_at:
                self.fleet.redis_server.restart_after_kill()
                self._log(start, "Redis killed and restarted")
                redis_at = None
            if freeze_at and now >= freeze_at:
                self.storage.freeze()
                self._log(start, f"storage frozen {self.freeze_s:.0f} s")
                freeze_at, thaw_at = None, now + self.freeze_s
            if thaw_at and now >= thaw_at:
                self.storage.thaw()
                thaw_at = None
        if thaw_at:
            self.storage.thaw()


def start_api(fleet: Fleet, folder: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(folder / "api.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "api", "--port", str(port)],
        env=fleet.env,
        stdout=log,
        stderr=log,
    )
    wait_for_port(port, proc)
    return proc, f"http://127.0.0.1:{port}"


def run(
    fleet: Fleet,
    storage,
    plan: list[Case],
    calm: dict[str, str],
    workers: int = 3,
    clients: int = 4,
    kill_every_s: tuple[float, float] = (10, 20),
    redis_at_s: float | None = 20,
    freeze_at_s: float | None = 40,
    freeze_s: float = 20,
    kills: int | None = None,
    timeout_s: float = 900,
) -> Report:
    report, lock = Report(submitted=len(plan)), threading.Lock()
    api, url = start_api(fleet, fleet.folder)
    for _ in range(workers):
        fleet.start_worker()
    monkey = Monkey(fleet, storage, report, kill_every_s, redis_at_s, freeze_at_s, freeze_s, kills)
    start = time.monotonic()
    monkey.thread.start()
    try:
        client = Client(url, report, lock)
        with ThreadPoolExecutor(clients) as pool:
            outcomes = list(pool.map(lambda c: Client(url, report, lock).submit(c), plan))
        jobs = {}
        for case, (job_id, refused) in zip(plan, outcomes, strict=True):
            if job_id:
                jobs[job_id] = case
            else:
                report.refused[refused] += 1
                if case.code != refused:
                    report.malformed_wrong.append(f"{case.name}: refused as {refused}")
        report.accepted = len(jobs)
        pending, deadline = set(jobs), time.monotonic() + timeout_s
        while pending and time.monotonic() < deadline:
            for job_id in list(pending):
                if client.job(job_id)["status"] in TERMINAL:
                    pending.discard(job_id)
            time.sleep(0.5)
        report.seconds = time.monotonic() - start
        monkey.stop.set()
        monkey.thread.join()
        report.lost = sorted(pending)
        for job_id, case in jobs.items():
            if job_id in pending:
                continue
            record = client.job(job_id)
            if case.code is not None:
                code = (record.get("error") or {}).get("code")
                if record["status"] != "failed" or code != case.code:
                    report.malformed_wrong.append(f"{case.name}: {record['status']} {code}")
            elif record["status"] != "succeeded":
                report.good_failed.append(f"{case.name}: {record['status']} {record.get('error')}")
            elif client.text(job_id) != calm[case.name]:
                report.different.append(case.name)
        _check_storage(fleet, report)
    finally:
        monkey.stop.set()
        storage.thaw()
        stop(api)
    return report


def _check_storage(fleet: Fleet, report: Report) -> None:
    """Every object belongs to a job: an input to a job with a record, a result to a job that
    succeeded; and no result was written twice (the bucket keeps every version)."""
    client, bucket = fleet.storage.client, fleet.storage.bucket
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=bucket)
    for key in (o["Key"] for page in pages for o in page.get("Contents", [])):
        record = fleet.store.get(key.split("/")[2])
        if record is None or (key.endswith("/result.json") and record.status != "succeeded"):
            report.orphans.append(key)
    pages = client.get_paginator("list_object_versions").paginate(Bucket=bucket)
    results = Counter(
        v["Key"] for page in pages for v in page.get("Versions", []) if v["Key"].endswith(".json")
    )
    report.duplicates += [key for key, count in results.items() if count > 1]
