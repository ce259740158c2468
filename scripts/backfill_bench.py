"""Backfills on a fleet of their own: what a running backfill costs interactive jobs, and what
the scanner costs to walk a large listing.

    python scripts/backfill_bench.py latency [--jobs 40] [--interval 2] [--backfill-files 400]
        [--workers 1] [--concurrency 8] [--warmup-jobs 0] [--device cpu] [--audio-dir DIR]
        [--split] [--py-spy PATH]
    python scripts/backfill_bench.py progress [--backfill-files 400] [--device cpu]
    python scripts/backfill_bench.py throughput [--backfill-files 2010] [--engine-runs 2]
        [--warmup-jobs 256] [--device cuda] [--audio-dir DIR] [--third-silence]
        [--job-options '[{"word_timestamps": true}, {"vad": true, "diarize": true}]']
        [--backfill-runs 3]
    python scripts/backfill_bench.py scan [--keys 100000] [--bound 1000] [--stall-s 30]
        [--variants listing,malformed,bound] [--plot docs/bench/backfill-scan.png]
    (either: [--redis-url redis://127.0.0.1:6379/8 | --redis-server redis-server])

Each starts its own stack and stops all of it at the end (also on Ctrl-C or an error):
the storage on a free port (the embedded S3 server, its objects on disk as the stack keeps
them; or SeaweedFS with `--weed PATH`, scripts/seaweed.py), `whisperfleet api`,
`whisperfleet worker` processes (latency, throughput) and `whisperfleet scanner`, each in a
process group of its own. Redis: `--redis-url` (default db 8 of the local Redis, emptied at
the end; a db that holds keys is refused unless `--flush`), or `--redis-server PATH` starts a
redis-server on a free port (Redis's `used_memory` is the whole instance's: on a shared Redis
it also moves with whatever else uses it).

latency: short real clips (`--audio-dir`, its manifest.jsonl; clips up to `--max-clip-s`)
submitted through `POST /v1/jobs`, one every `--interval` s, `--jobs` of them; latency is
submit to the job's `finished_at` (read with `GET /v1/jobs/{id}`), "until started" submit to
its `started_at` (waiting for a worker's job slot). First on an idle fleet, then while a
backfill (`POST /v1/backfills`) of `--backfill-files` copies of the same clips under
`s3://bench-archive/calls/` runs on the same workers; its files/s and audio s/s are the deltas
of `GET /v1/backfills/{id}` over the second phase. The backfill is cancelled at the end.
With `--split` the first worker takes interactive jobs alone (`--queues interactive`), the
others bulk ones. Why: a backfill's jobs wait in `bulk`, behind interactive work, but they
hold the workers' job slots and share the engine's batches and the storage server; this
measures what that costs. Each worker's metrics are
scraped before and after each phase: the mean time per job of each stage (queue, fetch,
decode, engine, store) by priority, and the engine's busy share. `--py-spy PATH` samples
the first worker with py-spy (on PATH) through the second phase, threads holding the GIL only,
and prints the GIL's busy share by thread and by the project's function on the stack.

progress: one long job, the dev set's English clips one after another (`--audio-dir`, 1 s
apart: 9 to 10 minutes), through `POST /v1/jobs` with the defaults (sequential decoding),
its `progress.done_s` read every 0.25 s: on an idle fleet, then while a backfill as
latency's runs. Why: a long job must show progress as it goes (at least every window), also
while bulk work shares the engine; this gives the longest time its progress stood still.

throughput: every clip of `--audio-dir`'s manifest, repeated to `--backfill-files` files.
First the engine alone, in this process: `Engine.open(...).transcribe(files)` over the file
bytes (decoding included, as a worker's jobs include it), after a warm-up pass over the clips,
`--engine-runs` times (0: none). Then the fleet: `--warmup-jobs` interactive jobs at once
(the worker compiles and captures the batch sizes it will meet), then `--backfill-runs`
rounds, each with the files put under `s3://bench-archive/calls/<round>/` and a `POST
/v1/backfills` of them, timed until the backfill is `done` (every job ended, its copies and
manifest written). Both as audio seconds per second; ratio fleet / engine.
Why: a backfill is the bulk workload; this is what the whole path (listing, inspection,
queue, worker, storage, copies, manifest) keeps of the engine's pace. `--third-silence`: the
files are instead copies of one long recording, the manifest's English clips each followed by
room tone half as long (`tools.longform.third_silence`, some 12 minutes, a third without
speech), as an archive of calls; `--job-options`: the backfill's job options (JSON, as
`POST /v1/backfills` takes them), for its jobs, the warm-up jobs and the engine's runs alike;
a list of option sets is run in turn, each warmed up, each backfilled once a round, and
each set's median backfill given against the first's. With `[{"word_timestamps": true},
{"vad": true, "diarize": true}]` that is what voice activity and speakers add to the word
timestamps a diarization needs, at the fleet's pace, in one fleet (issue #39).

scan: `--keys` small objects (a few bytes to 364 bytes each) under `s3://bench-archive/scan/`,
put through a thread pool: half `.txt`, 40% `.flac` that are not audio, 10% valid tiny WAV.
No worker runs. Three backfills, each with a fresh scanner process and an emptied db:
  listing    extensions ["mp3"]: every key is left out by the patterns (the listing alone);
  malformed  extensions ["flac"]: 40% of the keys become jobs, failed at scan (records made,
             harvested into the manifest);
  bound      extensions ["wav"] with WHISPERFLEET_BACKFILL_QUEUE_BOUND=`--bound`: jobs queue
             in `bulk` until the bound, then the scan stalls (nothing drains it); watched for
             `--stall-s`, then cancelled.
Sampled every 0.5 s: the scanner's resident memory (psutil, process and children; its peak
every 0.1 s), Redis `used_memory`, `LLEN bulk`, and the backfill's counts through the API;
the CPU seconds of the scanner, the storage and (one started here) redis-server over the variant.
Why: the scanner must hold memory flat however many keys it walks, and must stop making jobs
at the bound.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import wave
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from functools import partial
from pathlib import Path

import httpx
import psutil
import redis
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts import harness, measure  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from worker.contract.jobs import QUEUES  # noqa: E402

BULK = QUEUES[-1]
STAGES = ("queue", "fetch", "decode", "engine", "store")  # worker.metrics.JOB_STAGE
SCRAPED = ("whisperfleet_job_stage_seconds_sum", "whisperfleet_job_stage_seconds_count",
           "whisperfleet_engine_busy_seconds_total")  # fmt: skip
JOB_BUCKET = "bench-jobs"
ARCHIVE = "bench-archive"
MB = 2**20
VARIANTS = {  # name: the backfill's extensions ("bound" also sets the queue bound)
    "listing": ["mp3"],
    "malformed": ["flac"],
    "bound": ["wav"],
}


class Stack(harness.Stack):
    """The stack of one run: its Redis db (emptied at the end), the storage with the job and
    archive buckets, the API, workers and scanners."""

    def __init__(self, args: argparse.Namespace, log_dir: Path):
        env = {
            "WHISPERFLEET_S3_BUCKET": JOB_BUCKET,
            "WHISPERFLEET_AUTH": "none",
            "WHISPERFLEET_TENANT_JOBS_PER_MINUTE": "1000000",  # warm-ups count too
            "WHISPERFLEET_TENANT_SOURCES": f"s3://{ARCHIVE}/",
            "WHISPERFLEET_METRICS_PORT": "0",
            "WHISPERFLEET_DEVICE": args.device,
            # a name's weights may be mapped already (tiny.en=/dir)
            "WHISPERFLEET_MODELS": os.environ.get("WHISPERFLEET_MODELS") or args.model,
            "WHISPERFLEET_DEFAULT_MODEL": args.model,
        }
        super().__init__(log_dir, env, redis_url="" if args.redis_server else args.redis_url)
        self.args = args
        self.metrics_ports: list[int] = []
        self.owned_db = False

    def close(self) -> None:
        super().close()
        if self.owned_db:
            with contextlib.suppress(redis.RedisError):
                redis.Redis.from_url(self.redis_url).flushdb()

    def services(self) -> None:
        if self.args.redis_server:
            self.redis_server(self.args.redis_server)
        client = redis.Redis.from_url(self.redis_url)
        keys = client.dbsize()
        if keys and not self.args.flush:
            raise SystemExit(
                f"{self.redis_url} holds {keys} keys: give the benchmark a db of its own, or "
                "pass --flush to empty this one"
            )
        client.flushdb()
        self.owned_db = True
        self.storage(self.args.weed)
        s3 = self.s3()
        for bucket in (JOB_BUCKET, ARCHIVE):
            s3.create_bucket(Bucket=bucket)

    def start_worker(self, index: int) -> subprocess.Popen:
        options = ["--concurrency", str(self.args.concurrency)]
        if getattr(self.args, "split", False):  # the first for interactive jobs alone
            options += ["--queues", "interactive" if index == 0 else BULK]
        # its metrics, scraped around each phase; with job processes (a GPU's default), the
        # engine's on this port and each job process's on one after it
        port = free_port(65)
        self.metrics_ports.append(port)
        env = {**self.env, "WHISPERFLEET_METRICS_PORT": str(port)}
        return self.worker(f"worker-{index}", options, env)

    def scrape(self) -> dict[tuple, float]:
        """The workers' job stage and engine busy metrics, summed over the workers and their
        job processes (the ports after a worker's own, up to the first that does not answer)."""
        totals: dict[tuple, float] = {}
        texts = []
        for first in self.metrics_ports:
            texts.append(httpx.get(f"http://127.0.0.1:{first}/metrics", timeout=10).text)
            for port in range(first + 1, first + 65):
                try:
                    texts.append(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)
                except httpx.ConnectError:
                    break
        for text in texts:
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name.startswith(SCRAPED):
                        key = (
                            sample.name,
                            sample.labels.get("stage"),
                            sample.labels.get("priority"),
                        )
                        totals[key] = totals.get(key, 0.0) + sample.value
        return totals

    def scanner(self, name: str, **env: str) -> subprocess.Popen:
        proc = self.start(name, [*harness.CLI, "scanner"], {**self.env, **env}, grace=10)
        try:
            harness.until(lambda: " ready: " in self.tail(name, 200), "the scanner", 60, self.check)
        except RuntimeError as e:
            raise RuntimeError(f"{e}; its log ends:\n{self.tail(name)}") from None
        return proc


def put_many(s3, bucket: str, items: list[tuple[str, bytes]], desc: str, threads: int = 16):
    """put_object from a thread pool, with a progress bar."""
    with tqdm(total=len(items), desc=desc, unit="obj", file=sys.stderr) as bar:

        def put(item: tuple[str, bytes]) -> None:
            s3.put_object(Bucket=bucket, Key=item[0], Body=item[1])
            bar.update()

        with ThreadPoolExecutor(threads) as pool:
            for _ in pool.map(put, items):
                pass


def when(iso: str) -> float:
    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


# -- latency


def read_clips(audio_dir: Path, max_s: float, english: bool) -> list[tuple[str, bytes, float]]:
    clips = []
    for line in (audio_dir / "manifest.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if entry["duration_s"] > max_s or (english and entry.get("language", "en") != "en"):
            continue
        path = audio_dir / entry["file"]
        clips.append((path.name, path.read_bytes(), entry["duration_s"]))
    if not clips:
        raise SystemExit(f"no clip of {max_s} s or less in {audio_dir}/manifest.jsonl")
    return clips


class Phase:
    """Interactive jobs at a steady rate; each one's latency, submit to `finished_at`."""

    def __init__(
        self,
        api_url: str,
        clips: list,
        jobs: int,
        interval: float,
        label: str,
        priority: str = "",
        options: dict | None = None,
    ):
        """options: job options, sent as form fields (httpx writes JSON's true as "true")."""
        self.api_url, self.clips, self.jobs, self.interval = api_url, clips, jobs, interval
        self.label, self.form = label, dict(options or {})
        if priority:
            self.form["priority"] = priority
        self.pending: dict[str, float] = {}
        self.latencies: list[float] = []
        self.waits: list[float] = []  # submit to started_at: waiting for a job slot
        self.refused: list[int] = []
        self.failed = 0
        self.lock = threading.Lock()
        self.local = threading.local()

    def _client(self) -> httpx.Client:
        if not hasattr(self.local, "client"):
            self.local.client = httpx.Client(base_url=self.api_url, timeout=60)
        return self.local.client

    def _submit(self, i: int) -> None:
        name, data, _ = self.clips[i % len(self.clips)]
        sent = time.time()
        files = {"file": (name, data, "audio/flac")}
        reply = self._client().post("/v1/jobs", files=files, data=self.form)
        with self.lock:
            if reply.status_code == 202:
                self.pending[reply.json()["id"]] = sent
            else:
                self.refused.append(reply.status_code)

    def run(self, timeout: float, alive) -> None:
        bar = tqdm(total=self.jobs, desc=self.label, unit="job", file=sys.stderr)
        start = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            futures = []
            for i in range(self.jobs):
                time.sleep(max(0.0, start + i * self.interval - time.monotonic()))
                futures.append(pool.submit(self._submit, i))
                self._poll(bar)
                alive()
            for f in futures:
                f.result()
        deadline = time.monotonic() + timeout
        while self.pending:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.label}: {len(self.pending)} jobs not done in time")
            alive()
            time.sleep(0.2)
            self._poll(bar)
        bar.close()

    def _poll(self, bar: tqdm) -> None:
        with self.lock:
            pending = list(self.pending.items())
        for job_id, sent in pending:
            job = self._client().get(f"/v1/jobs/{job_id}").json()
            if job["status"] in ("succeeded", "failed", "cancelled"):
                with self.lock:
                    del self.pending[job_id]
                if job["status"] == "succeeded":
                    self.latencies.append(when(job["finished_at"]) - sent)
                    self.waits.append(when(job["started_at"]) - sent)
                else:
                    self.failed += 1
                bar.update()

    def row(self, extra: str = "| | |") -> str:
        lat = self.latencies
        refused = f" ({len(self.refused)} refused: {sorted(set(self.refused))})" * bool(
            self.refused
        )
        failed = f" ({self.failed} failed)" * bool(self.failed)
        p = measure.percentile
        return (
            f"| {self.label} | {len(lat)}{refused}{failed} | {p(lat, 50):.2f} "
            f"| {p(lat, 95):.2f} | {max(lat, default=float('nan')):.2f} "
            f"| {p(self.waits, 50):.2f} / {p(self.waits, 95):.2f} {extra}"
        )


def with_archive(args: argparse.Namespace, stack: Stack) -> tuple[list, httpx.Client]:
    """The stack started (storage, API, workers, scanner) and `--backfill-files` copies of the
    short clips under s3://bench-archive/calls/: the clips and a client of the API."""
    english = args.model.endswith(".en")
    clips = read_clips(Path(args.audio_dir), args.max_clip_s or 12.0, english)
    stack.services()
    api = stack.api()
    for i in range(args.workers):
        stack.start_worker(i)
    stack.scanner("scanner")
    copies = [
        (f"calls/{i:06d}-{clips[i % len(clips)][0]}", clips[i % len(clips)][1])
        for i in range(args.backfill_files)
    ]
    put_many(stack.s3(), ARCHIVE, copies, "archive")
    return clips, api


def latency(args: argparse.Namespace, stack: Stack) -> None:
    clips, api = with_archive(args, stack)
    backfill_audio_s = sum(clips[i % len(clips)][2] for i in range(args.backfill_files))

    warmup = max(args.warmup_jobs, len(clips))
    print(f"warming up (model load, {warmup} jobs at once) ...", file=sys.stderr, flush=True)
    warm = Phase(str(api.base_url), clips, warmup, 0.0, "warm-up")
    warm.run(args.timeout, stack.check)
    if args.split:  # the bulk workers, warmed as well
        Phase(str(api.base_url), clips, warmup, 0.0, "warm-up", BULK).run(args.timeout, stack.check)
    idle = Phase(str(api.base_url), clips, args.jobs, args.interval, "idle fleet")
    scraped, start = stack.scrape(), time.monotonic()
    idle.run(args.timeout, stack.check)
    idle_stages = stage_deltas(scraped, stack.scrape(), time.monotonic() - start)

    reply = api.post("/v1/backfills", json={"source": f"s3://{ARCHIVE}/calls/"})
    reply.raise_for_status()
    backfill_id = reply.json()["id"]

    def backfill() -> dict:
        return api.get(f"/v1/backfills/{backfill_id}").json()

    def ended(b: dict) -> int:
        return b["counts"]["succeeded"] + b["counts"]["failed"]

    # the fleet is busy with the backfill once its first jobs have ended
    harness.until(
        lambda: ended(backfill()) >= args.workers, "the backfill's first jobs", 300, stack.check
    )
    before, t0, scraped = backfill(), time.monotonic(), stack.scrape()
    busy = Phase(str(api.base_url), clips, args.jobs, args.interval, "backfill running")
    spy = py_spy(args.py_spy, stack.pid("worker-0"), args.jobs * args.interval)
    busy.run(args.timeout, stack.check)
    if spy and spy.wait() == 0:
        print(gil_summary(Path(args.py_spy), args.jobs * args.interval), file=sys.stderr)
    elif spy:
        print(f"py-spy failed ({spy.returncode}): no GIL profile", file=sys.stderr)
    after, t1 = backfill(), time.monotonic()
    seconds = t1 - t0
    busy_stages = stage_deltas(scraped, stack.scrape(), seconds)
    files_s = (ended(after) - ended(before)) / seconds
    audio_s = (after["audio_hours"] - before["audio_hours"]) * 3600 / seconds
    api.delete(f"/v1/backfills/{backfill_id}")
    still = after["counts"]["in_flight"]

    device = f"{args.model} on {args.device}"
    split = " (the first for interactive jobs alone)" * args.split
    print(
        f"\n{args.workers} worker(s){split} x concurrency {args.concurrency}, {device}; one job "
        f"every {args.interval} s; backfill of {args.backfill_files} files "
        f"({backfill_audio_s:.0f} s of audio), {ended(after)} ended by the end of the second "
        f"phase, {still} in flight then (cancelled)\n"
    )
    print(
        "| condition | jobs | p50 s | p95 s | max s | until started p50 / p95 s "
        "| backfill files/s | backfill audio s/s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    print(idle.row())
    print(busy.row(f"| {files_s:.2f} | {audio_s:.1f} |"))
    ratio = measure.percentile(busy.latencies, 95) / measure.percentile(idle.latencies, 95)
    print(f"\np95(backfill) / p95(idle): {ratio:.2f}")
    print(
        "\nWhere a job's time went (the workers' `whisperfleet_job_stage_seconds`, mean ms per "
        "job over each phase; engine busy: `whisperfleet_engine_busy_seconds` over the phase, "
        "summed over the workers)\n"
    )
    print("| stage | interactive, idle | interactive, backfill running | bulk, backfill running |")
    print("|---|---|---|---|")
    for stage in STAGES:
        cells = [
            idle_stages.get((stage, "interactive")),
            busy_stages.get((stage, "interactive")),
            busy_stages.get((stage, BULK)),
        ]
        print(
            f"| {stage} | "
            + " | ".join("" if c is None else f"{c * 1000:.1f}" for c in cells)
            + " |"
        )
    print(f"| engine busy | {idle_stages['busy']:.0%} | {busy_stages['busy']:.0%} | |")
    if not still:
        print("WARNING: the backfill ran out during the second phase; raise --backfill-files")


# -- progress


def long_recording(audio_dir: Path) -> tuple[str, bytes, float]:
    """The dev set's English clips one after another, 1 s apart, as FLAC (the long-form
    check's "concat" recording)."""
    import soundfile

    from engine.mel import SAMPLE_RATE
    from tools.evaluate import read_manifest
    from tools.longform import recordings

    (recording,) = recordings(read_manifest(audio_dir / "manifest.jsonl"), {"concat"})
    buffer = io.BytesIO()
    soundfile.write(buffer, recording.samples, SAMPLE_RATE, format="FLAC")
    return "concat.flac", buffer.getvalue(), len(recording.samples) / SAMPLE_RATE


def watch(api: httpx.Client, recording: tuple[str, bytes, float], label: str, alive) -> str:
    """One long job through `POST /v1/jobs`, its `progress.done_s` read every 0.25 s until
    it ends: a table row of how long it ran, when its first progress showed, and the longest
    time its progress stood still while it ran."""
    name, data, seconds = recording
    reply = api.post("/v1/jobs", files={"file": (name, data, "audio/flac")})
    reply.raise_for_status()
    job_id, sent = reply.json()["id"], time.monotonic()
    seen: list[tuple[float, float]] = []  # (s since submit, done_s) at each change
    with tqdm(total=round(seconds), desc=label, unit="audio s", file=sys.stderr) as bar:
        while True:
            job = api.get(f"/v1/jobs/{job_id}").json()
            now, done = time.monotonic() - sent, job["progress"]["done_s"]
            if job["status"] == "running" and (not seen or done != seen[-1][1]):
                bar.update(round(done) - bar.n)
                seen.append((now, done))
            if job["status"] in ("succeeded", "failed", "cancelled"):
                break
            alive()
            time.sleep(0.25)
    started, finished = job.get("started_at"), job.get("finished_at")
    ran = when(finished) - when(started) if started and finished else float("nan")
    moves = [b[0] - a[0] for a, b in zip(seen, seen[1:], strict=False)]
    first = seen[0][0] if seen else float("nan")
    return (
        f"| {label} | {job['status']} | {seconds:.0f} | {ran:.1f} | {first:.1f} "
        f"| {max(moves, default=float('nan')):.1f} | {len(seen)} |"
    )


def progress(args: argparse.Namespace, stack: Stack) -> None:
    recording = long_recording(Path(args.audio_dir))
    clips, api = with_archive(args, stack)
    warmup = max(args.warmup_jobs, len(clips))
    Phase(str(api.base_url), clips, warmup, 0.0, "warm-up").run(args.timeout, stack.check)
    rows = [watch(api, recording, "idle fleet", stack.check)]
    reply = api.post("/v1/backfills", json={"source": f"s3://{ARCHIVE}/calls/"})
    reply.raise_for_status()
    backfill_id = reply.json()["id"]

    def ended() -> int:
        counts = api.get(f"/v1/backfills/{backfill_id}").json()["counts"]
        return counts["succeeded"] + counts["failed"]

    harness.until(lambda: ended() >= args.workers, "the backfill's first jobs", 300, stack.check)
    rows.append(watch(api, recording, "backfill running", stack.check))
    still = api.get(f"/v1/backfills/{backfill_id}").json()["counts"]["in_flight"]
    api.delete(f"/v1/backfills/{backfill_id}")
    print(
        f"\n{args.workers} worker(s) x concurrency {args.concurrency}, {args.model} on "
        f"{args.device}; one long job, sequential (the default); backfill of "
        f"{args.backfill_files} files, {still} still in flight when the job ended\n"
    )
    print(
        "| condition | status | audio s | ran s | first progress s after submit "
        "| longest still s | changes seen |"
    )
    print("|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if not still:
        print("WARNING: the backfill ran out before the job ended; raise --backfill-files")


def stage_deltas(before: dict, after: dict, seconds: float) -> dict:
    """Mean seconds per job of each (stage, priority) between two scrapes, and the engine's
    busy share of `seconds` ("busy")."""
    means = {}
    for stage in STAGES:
        for priority in QUEUES:
            key = (stage, priority)
            count = "whisperfleet_job_stage_seconds_count", *key
            total = "whisperfleet_job_stage_seconds_sum", *key
            n = after.get(count, 0.0) - before.get(count, 0.0)
            if n:
                means[key] = (after.get(total, 0.0) - before.get(total, 0.0)) / n
    busy = ("whisperfleet_engine_busy_seconds_total", None, None)
    means["busy"] = (after.get(busy, 0.0) - before.get(busy, 0.0)) / seconds
    return means


def py_spy(path: str | None, pid: int | None, seconds: float) -> subprocess.Popen | None:
    """py-spy sampling the first worker (and its children) at 100 Hz for `seconds`: the
    threads holding the GIL only (`--gil`), as collapsed stacks with thread names."""
    if not path or pid is None:
        return None
    argv = ["py-spy", "record", "--pid", str(pid), "--subprocesses", "--gil", "--threads"]
    argv += ["--rate", "100", "--duration", str(max(1, round(seconds))), "--format", "raw"]
    return subprocess.Popen([*argv, "--output", path], stdout=subprocess.DEVNULL)


def gil_summary(path: Path, seconds: float) -> str:
    """The GIL's busy share (samples with it held over samples taken) by thread, and by the
    deepest frame of this project's code on the stack (which part of a job held it)."""
    by_thread: dict[str, int] = {}
    by_frame: dict[str, int] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [f for f in stack.split(";") if not f.startswith("process ")]
        thread = frames[0].partition("): ")[2].rstrip("0123456789-_") or frames[0]
        by_thread[thread] = by_thread.get(thread, 0) + int(count)
        ours = [f for f in frames[1:] if f.split("(")[-1].startswith(("worker/", "engine/"))]
        frame = (ours or frames)[-1]
        frame = frame.rpartition(":")[0] + ")" if ours else frame  # by function, not line
        by_frame[frame] = by_frame.get(frame, 0) + int(count)
    total = seconds * 100

    def top(counts: dict[str, int], n: int) -> list[str]:
        ranked = sorted(counts.items(), key=lambda kv: -kv[1])[:n]
        return [f"  {count / total:6.1%}  {name}" for name, count in ranked]

    held = sum(by_thread.values()) / total
    return "\n".join(
        [f"GIL held ({path}): {held:.0%} of the time; by thread:", *top(by_thread, 8)]
        + ["by the deepest frame of worker/ or engine/ code:", *top(by_frame, 20)]
    )


# -- throughput


def throughput(args: argparse.Namespace, stack: Stack) -> None:
    import gc
    import statistics

    import soundfile as sf
    import torch

    from engine import Engine
    from tools.evaluate import read_manifest
    from tools.longform import third_silence
    from worker.contract.options import JobOptions
    from worker.contract.settings import Settings
    from worker.core.engines import Engines
    from worker.core.transcripts import engine_options

    sets = json.loads(args.job_options)
    sets = sets if isinstance(sets, list) else [sets]
    engine_sets = [engine_options(JobOptions.model_validate(o), b"") for o in sets]  # checked
    clips = read_clips(Path(args.audio_dir), args.max_clip_s or 1e9, english=False)
    sources = clips
    if args.third_silence:
        made = third_silence(read_manifest(Path(args.audio_dir) / "manifest.jsonl"))
        out = io.BytesIO()
        sf.write(out, made.samples, 16000, format="FLAC")
        sources = [("third-silence.flac", out.getvalue(), made.seconds)]
    files = [sources[i % len(sources)] for i in range(args.backfill_files)]
    audio_s = sum(c[2] for c in files)
    print(f"{len(files)} files, {audio_s:.0f} s of audio", file=sys.stderr, flush=True)

    # the engine as a worker configures it (weights, slots, kernels, cross K/V)
    os.environ.update(stack.env)
    engine_runs: list[list[float]] = []
    if args.engine_runs:
        stream = Engine.open(Engines(Settings()).config(args.model))
        for options in engine_sets:
            stream.transcribe([c[1] for c in sources], options)  # load, compile, capture
            run = partial(stream.transcribe, [c[1] for c in files], options)
            engine_runs.append(measure.timed(run, args.engine_runs, "engine alone")[1])
        del run, stream
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    stack.services()
    api = stack.api()
    for i in range(args.workers):
        stack.start_worker(i)
    stack.scanner("scanner")
    warmup = max(args.warmup_jobs, len(clips))
    for job_options in sets:
        print(f"warming up the worker ({warmup} jobs at once) ...", file=sys.stderr, flush=True)
        warming = Phase(str(api.base_url), clips, warmup, 0.0, "warm-up", options=job_options)
        warming.run(args.timeout, stack.check)

    # each round's files under a prefix of their own (a job's id is its object's and its
    # options'), and the option sets in turn within a round, so drift meets them alike
    fleet_runs: list[list[tuple[float, dict]]] = [[] for _ in sets]
    for round_ in range(args.backfill_runs):
        prefix = f"calls/{round_}/"
        copies = [(f"{prefix}{i:06d}-{name}", data) for i, (name, data, _) in enumerate(files)]
        put_many(stack.s3(), ARCHIVE, copies, "archive")
        for k, job_options in enumerate(sets):
            fleet_runs[k].append(timed_backfill(api, prefix, job_options, len(files), args, stack))
            print(f"round {round_ + 1}, {json.dumps(job_options)}: {fleet_runs[k][-1][0]:.2f} s",
                  file=sys.stderr, flush=True)  # fmt: skip

    gpu = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(
        f"\n{args.model} on {args.device} ({gpu}); {len(files)} files ({len(sources)} "
        f"repeated), {audio_s:.0f} s of audio; fleet: {args.workers} worker(s) x concurrency "
        f"{args.concurrency}, warmed with {warmup} jobs of each option set\n"
    )
    print("| job options | path | seconds | audio s / s | files |")
    print("|---|---|---|---|---|")
    for k, job_options in enumerate(sets):
        shown = f"`{json.dumps(job_options)}`" if job_options else "the defaults"
        for run, seconds in enumerate(engine_runs[k] if engine_runs else [], 1):
            print(f"| {shown} | engine alone (`Stream.transcribe`), run {run} | {seconds:.2f} "
                  f"| {audio_s / seconds:.0f} | {len(files)} |")  # fmt: skip
        for run, (seconds, counts) in enumerate(fleet_runs[k], 1):
            print(f"| {shown} | backfill, `POST /v1/backfills` to `done`, run {run} "
                  f"| {seconds:.2f} | {audio_s / seconds:.0f} "
                  f"| {counts['succeeded']} succeeded, {counts['failed']} failed |")  # fmt: skip
    medians = [statistics.median(s for s, _ in runs) for runs in fleet_runs]
    print("\n| job options | backfill, median (range) s | against the first set |")
    print("|---|---|---|")
    for k, job_options in enumerate(sets):
        seconds = [s for s, _ in fleet_runs[k]]
        print(
            f"| `{json.dumps(job_options)}` | {medians[k]:.2f} ({min(seconds):.2f}–"
            f"{max(seconds):.2f}) | {100 * (medians[k] / medians[0] - 1):+.1f} % |"
        )
    for k, runs in enumerate(engine_runs):
        print(f"ratio, {json.dumps(sets[k])} (backfill median / best engine run): "
              f"{min(runs) / medians[k]:.2f}")  # fmt: skip


def timed_backfill(
    api, prefix: str, job_options: dict, files: int, args, stack
) -> tuple[float, dict]:
    """`POST /v1/backfills` of the prefix, timed until it is `done`: (seconds, its counts)."""
    start = time.perf_counter()
    reply = api.post("/v1/backfills", json={"source": f"s3://{ARCHIVE}/{prefix}", **job_options})
    reply.raise_for_status()
    backfill_id = reply.json()["id"]
    bar = tqdm(total=files, desc="backfill", unit="file", file=sys.stderr)
    deadline = time.monotonic() + args.timeout
    while True:
        b = api.get(f"/v1/backfills/{backfill_id}").json()
        ended = b["counts"]["succeeded"] + b["counts"]["failed"]
        bar.update(ended - bar.n)
        if b["status"] == "done":
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"the backfill: {ended} of {files} ended in time")
        stack.check()
        time.sleep(0.2)
    bar.close()
    return time.perf_counter() - start, b["counts"]


# -- scan


def tiny_wav() -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"\0\0" * 160)  # 10 ms of silence: 364 bytes
    return out.getvalue()


def scan_keys(n: int) -> list[tuple[str, bytes]]:
    """Half `.txt`, 40% `.flac` that are not audio, 10% valid WAV, interleaved."""
    wav, items = tiny_wav(), []
    for i in range(n):
        kind = i % 10
        if kind < 5:
            items.append((f"scan/{i:07d}.txt", b"notes\n"))
        elif kind < 9:
            items.append((f"scan/{i:07d}.flac", b"not a flac\n"))
        else:
            items.append((f"scan/{i:07d}.wav", wav))
    return items


class RSS:
    """The resident memory of a process and its children: the latest, and the peak (sampled
    every 0.1 s)."""

    def __init__(self, pid: int):
        self.proc = psutil.Process(pid)
        self.peak = self.now = self._read()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def _read(self) -> int:
        total = 0
        with contextlib.suppress(psutil.NoSuchProcess):
            for p in [self.proc, *self.proc.children(recursive=True)]:
                with contextlib.suppress(psutil.NoSuchProcess):
                    total += p.memory_info().rss
        return total

    def _sample(self) -> None:
        while not self.done.wait(0.1):
            self.now = self._read()
            self.peak = max(self.peak, self.now)

    def close(self) -> None:
        self.done.set()
        self.thread.join()


def cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of a process so far (0: none)."""
    if pid is None:
        return 0.0
    t = psutil.Process(pid).cpu_times()
    return t.user + t.system


def scan_variant(
    args: argparse.Namespace, stack: Stack, api: httpx.Client, name: str
) -> tuple[list[str], list[dict], list[str]]:
    """One backfill over the keys with a fresh scanner; (table rows, samples, timeline)."""
    client = redis.Redis.from_url(stack.redis_url)
    client.flushdb()
    bound = name == "bound"
    env = {"WHISPERFLEET_BACKFILL_QUEUE_BOUND": str(args.bound)} if bound else {}
    scanner = stack.scanner(f"scanner-{name}", **env)
    rss = RSS(scanner.pid)
    time.sleep(2.0)
    idle_rss = rss.now
    redis_before, keys_before = client.info("memory")["used_memory"], client.dbsize()
    spec = {"source": f"s3://{ARCHIVE}/scan/", "extensions": VARIANTS[name]}
    pids = scanner.pid, stack.pid("storage"), stack.pid("redis")  # redis: only one started here
    cpu_before = [cpu_s(p) for p in pids]
    reply = api.post("/v1/backfills", json=spec)
    reply.raise_for_status()
    record = reply.json()
    backfill_id, created_at = record["id"], when(record["created_at"])
    start = time.monotonic()
    samples: list[dict] = []
    stalled_at = None
    bar = tqdm(total=args.keys, desc=name, unit="key", file=sys.stderr)
    while True:
        stack.check()
        b = api.get(f"/v1/backfills/{backfill_id}").json()
        sample = {
            "t": time.monotonic() - start,
            "listed": b["run"]["listed"],
            "created": b["counts"]["created"],
            "failed": b["counts"]["failed"],
            "llen_bulk": client.llen(BULK),
            "rss": rss.now,
            "redis": client.info("memory")["used_memory"],
            "status": b["status"],
        }
        samples.append(sample)
        bar.update(sample["listed"] - bar.n)
        bar.set_postfix(
            jobs=sample["created"], bulk=sample["llen_bulk"], rss_mb=f"{sample['rss'] / MB:.0f}",
            redis_mb=f"{sample['redis'] / MB:.0f}",
        )  # fmt: skip
        if bound and stalled_at is None and sample["created"] >= args.bound:
            stalled_at = sample["t"]
        if bound and stalled_at is not None and sample["t"] - stalled_at >= args.stall_s:
            break
        if b["status"] == "done":
            break
        if sample["t"] > args.timeout:
            raise RuntimeError(f"{name}: not done in {args.timeout} s")
        time.sleep(0.5)
    bar.close()
    final = b
    if bound:
        api.delete(f"/v1/backfills/{backfill_id}")
    cpu = [cpu_s(p) - before for p, before in zip(pids, cpu_before, strict=True)]
    peak = rss.peak
    rss.close()
    stack.stop(scanner)
    redis_after, keys_after = client.info("memory")["used_memory"], client.dbsize()

    listed = final["run"]["listed"]
    if bound:
        scan_s = stalled_at if stalled_at is not None else samples[-1]["t"]
    else:
        scan_s = when(final["run"]["scanned_at"]) - created_at

    def rss_at(fraction: float) -> str:
        target = fraction * listed
        hit = next((s for s in samples if s["listed"] >= target), samples[-1])
        return f"{hit['rss'] / MB:.0f}"

    redis_peak = max(s["redis"] for s in samples)
    jobs = final["counts"]["created"]
    rows = [
        f"| keys listed | {listed:,} of {args.keys:,} |",
        f"| jobs made (failed at scan) | {jobs:,} ({final['counts']['failed']:,}) |",
        f"| listing time, s | {scan_s:.1f}{' (to the stall)' if bound else ''} |",
        f"| keys/s | {listed / max(scan_s, 1e-9):,.0f} |",
        f"| scanner RSS MB: idle / at 10%, 50%, 100% of keys listed / peak "
        f"| {idle_rss / MB:.0f} / {rss_at(0.1)}, {rss_at(0.5)}, {rss_at(1.0)} / {peak / MB:.0f} |",
        f"| CPU s over the {samples[-1]['t']:.0f} s sampled: scanner / storage"
        f"{' / redis-server' * bool(pids[2])} "
        f"| {cpu[0]:.1f} / {cpu[1]:.1f}{f' / {cpu[2]:.1f}' * bool(pids[2])} |",
        f"| Redis used_memory MB: before / peak / after "
        f"| {redis_before / MB:.1f} / {redis_peak / MB:.1f} / {redis_after / MB:.1f} |",
        f"| Redis keys: before / after | {keys_before:,} / {keys_after:,} |",
    ]
    if jobs:
        per_job = (redis_after - redis_before) / jobs
        rows.append(f"| Redis bytes per job made (after - before) | {per_job:,.0f} |")
    timeline = []
    if bound:
        most = max(s["llen_bulk"] for s in samples)
        rows.append(f"| LLEN bulk: most seen (bound) | {most:,} ({args.bound:,}) |")
        stalled = [s for s in samples if s["t"] >= stalled_at]
        rows.append(
            f"| while stalled ({stalled[-1]['t'] - stalled[0]['t']:.0f} s): keys listed, "
            f"scanner RSS MB, Redis MB | {stalled[0]['listed']:,} -> {stalled[-1]['listed']:,}, "
            f"{stalled[0]['rss'] / MB:.0f} -> {stalled[-1]['rss'] / MB:.0f}, "
            f"{stalled[0]['redis'] / MB:.1f} -> {stalled[-1]['redis'] / MB:.1f} |"
        )
        next_t = 0.0
        for s in samples:
            if s["t"] >= next_t:
                timeline.append(
                    f"| {s['t']:.0f} | {s['listed']:,} | {s['created']:,} | {s['llen_bulk']:,} "
                    f"| {s['rss'] / MB:.0f} | {s['redis'] / MB:.1f} |"
                )
                next_t = s["t"] + args.timeline_every
    return rows, samples, timeline


def plot(path: Path, results: dict[str, list[dict]], bound: int, keys: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(4, 1, figsize=(8, 11), sharex=True)
    for name, samples in results.items():
        t = [s["t"] for s in samples]
        axes[0].plot(t, [s["rss"] / MB for s in samples], label=name)
        axes[1].plot(t, [s["redis"] / MB for s in samples], label=name)
        axes[2].plot(t, [s["listed"] / 1000 for s in samples], label=name)
        axes[3].plot(t, [s["llen_bulk"] for s in samples], label=name)
    axes[0].set_ylabel("scanner RSS, MB")
    axes[0].set_ylim(bottom=0)
    axes[1].set_ylabel("Redis used_memory, MB")
    axes[2].set_ylabel("keys listed, thousands")
    axes[3].axhline(bound, color="grey", lw=0.8, ls=":", label="BACKFILL_QUEUE_BOUND")
    axes[3].set_ylabel("LLEN bulk")
    axes[3].set_xlabel("seconds since the backfill was made")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"whisperfleet scanner over {keys:,} listed keys (no worker)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def scan(args: argparse.Namespace, stack: Stack) -> None:
    names = args.variants.split(",")
    unknown = set(names) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    stack.services()
    api = stack.api()
    put_many(stack.s3(), ARCHIVE, scan_keys(args.keys), "put keys", args.put_threads)
    results, tables = {}, {}
    for name in names:
        rows, samples, timeline = scan_variant(args, stack, api, name)
        results[name], tables[name] = samples, (rows, timeline)
    print(f"\n{args.keys:,} keys under s3://{ARCHIVE}/scan/, Redis {stack.redis_url}")
    for name in names:
        rows, timeline = tables[name]
        print(f"\n{name}: extensions {VARIANTS[name]}" + (
            f", BACKFILL_QUEUE_BOUND={args.bound}" if name == "bound" else ""
        ))  # fmt: skip
        print("\n| measure | value |\n|---|---|")
        print("\n".join(rows))
        if timeline:
            print(f"\n{name}, over time:\n")
            print("| s | keys listed | jobs made | LLEN bulk | scanner RSS MB | Redis MB |")
            print("|---|---|---|---|---|---|")
            print("\n".join(timeline))
    if args.plot:
        plot(Path(args.plot), results, args.bound, args.keys)
        print(f"\nplot: {args.plot}")
    if args.json:
        Path(args.json).write_text(json.dumps(results))


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=["latency", "progress", "throughput", "scan"])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/8")
    parser.add_argument("--redis-server", help="start this redis-server on a free port instead")
    parser.add_argument("--flush", action="store_true", help="empty a --redis-url db with keys")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="tiny.en")
    parser.add_argument("--timeout", type=float, default=1800, help="s, for each wait")
    latency_args = parser.add_argument_group("latency, progress and throughput")
    latency_args.add_argument("--audio-dir", default=str(ROOT / "tests" / "data"))
    latency_args.add_argument(
        "--max-clip-s", type=float, help="leave longer clips out (latency: 12, throughput: none)"
    )
    latency_args.add_argument("--jobs", type=int, default=40, help="interactive jobs per phase")
    latency_args.add_argument("--interval", type=float, default=2.0, help="s between them")
    latency_args.add_argument("--backfill-files", type=int, default=400)
    latency_args.add_argument("--engine-runs", type=int, default=2, help="throughput")
    latency_args.add_argument(
        "--third-silence",
        action="store_true",
        help="throughput: the files are one long recording, a third of it room tone",
    )
    latency_args.add_argument(
        "--job-options",
        default="{}",
        help="throughput: JSON, e.g. '{\"vad\": true}', or a list of such option sets, each "
        "backfilled in turn (the first is the one the others are measured against)",
    )
    latency_args.add_argument(
        "--backfill-runs", type=int, default=1, help="throughput: backfills of each option set"
    )
    latency_args.add_argument(
        "--py-spy", metavar="PATH", help="latency: the first worker's GIL, sampled in phase two"
    )
    parser.add_argument(
        "--weed",
        metavar="PATH",
        help="store in SeaweedFS (this `weed` binary: scripts/seaweed.py) instead of the "
        "embedded storage",
    )
    latency_args.add_argument("--workers", type=int, default=1)
    latency_args.add_argument("--concurrency", type=int, default=8, help="per worker")
    latency_args.add_argument(
        "--split",
        action="store_true",
        help="latency: the first worker takes interactive jobs alone, the others bulk alone "
        "(`--queues`), all on the same device; give --workers 2 or more",
    )
    latency_args.add_argument(
        "--warmup-jobs",
        type=int,
        default=0,
        help="submitted at once before the first phase (at least one per clip); on a GPU, "
        "enough to meet the batch sizes the phases will (kernels compiled, graphs captured)",
    )
    scan_args = parser.add_argument_group("scan")
    scan_args.add_argument("--keys", type=int, default=100_000)
    scan_args.add_argument("--variants", default="listing,malformed,bound")
    scan_args.add_argument("--bound", type=int, default=1000, help="BACKFILL_QUEUE_BOUND")
    scan_args.add_argument("--stall-s", type=float, default=30.0, help="watched at the bound")
    scan_args.add_argument("--timeline-every", type=float, default=5.0)
    scan_args.add_argument("--put-threads", type=int, default=16)
    scan_args.add_argument("--plot", help="write a PNG of the samples here")
    scan_args.add_argument("--json", help="write the samples here")
    args = parser.parse_args()
    if args.redis_server:
        args.redis_server = shutil.which(args.redis_server) or args.redis_server

    def terminated(signum, frame):
        raise SystemExit(128 + signum)

    # Ctrl-C and SIGTERM stop the stack through `finally` (SIGINT too where the shell that
    # started this script had it ignored, as for a background job)
    signal.signal(signal.SIGINT, terminated)
    signal.signal(signal.SIGTERM, terminated)
    with tempfile.TemporaryDirectory(prefix="backfill-bench-") as logs:
        stack = Stack(args, Path(logs))
        try:
            modes = {"latency": latency, "progress": progress, "throughput": throughput,
                     "scan": scan}  # fmt: skip
            modes[args.what](args, stack)
        except (RuntimeError, httpx.HTTPError) as e:
            print(f"backfill_bench: {e}", file=sys.stderr)
            return 1
        finally:
            stack.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
