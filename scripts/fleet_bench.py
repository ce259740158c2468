"""The fleet against its own engine: the same inputs through the engine directly, then as jobs
through Redis, a real `whisperfleet worker` and S3 storage (the embedded server; SeaweedFS with
`--weed PATH`, scripts/seaweed.py), on one device.

    python scripts/fleet_bench.py [--audio-dir ../shared/audio/dev] [--device cuda]
        [--models tiny.en,large-v3=random:large-v3] [--copies 8,32]
        [--inputs audio,spectrogram] [--processes 1,4] [--runs 3] [--transformers]
        [--plot fleet.png] [--json out.json]
    python scripts/fleet_bench.py --replot out.json --plot fleet.png
    python scripts/fleet_bench.py --restarts 3 --processes 1,4   # only the time to /ready
    python scripts/fleet_bench.py --restarts 2 --profile prof/   # and where a start goes
    python scripts/fleet_bench.py --device cuda --gpus 0 --gpus all --kill ...   # scale-out

For each model, input kind (audio files, or the same clips as .npy log-mel spectrograms) and
number of copies of the clips (`--copies 8`: each clip 8 times) and worker shape
(`--processes 4`: four job processes feeding one engine core), one row:

- engine: `Stream.transcribe` over every input at once, warmed first (best of --engine-runs);
- cold: the jobs queued first, then a new worker process started; from its start to the last
  job's end (its model load, graph captures and kernel compiles included);
- warm: the same jobs again on that worker, from the first dispatch to the last end;
- ratio: engine seconds over queue seconds (1.0: the queue path costs nothing);
- ready: the worker's start to `/ready` on its metrics port. The first start of a run has an
  empty compile cache (`TRITON_CACHE_DIR`, fresh); every later one is a restart after a
  `kill -9` of the previous worker, whose engine core (and job processes) must then exit;
- transformers: a transformers ASR pipeline (`scripts/rtfx_bench.py`: greedy, batches of 16)
  on the same clips, RTFx (audio seconds per second; audio rows of real weights).

`--runs N` runs each row N times, each on a worker started anew (after a `kill -9` of the
last); a table after the rows gives each figure's median and range over them, and how many
"Connection pool is full" lines (urllib3: a storage client with fewer connections than
threads) the workers logged.

`--gpus SPEC` (repeatable: a row each) runs `whisperfleet worker --gpus SPEC` instead, a worker
per GPU under one supervisor, all draining the same queues; the rows of one model, input and
copies give the scale-out (audio seconds per second, all GPUs over the first spec's). With
`--kill`, a row of two or more workers runs the warm jobs a third time and `kill -9`s the last
GPU's worker (its engine core and job processes go with it) once half of them ended: the
others take its jobs over by lease (the supervisor starts it again meanwhile), and the run
must end as the calm one did: every job succeeded, none lost or stored twice (the bucket
keeps versions), the same audio seconds and the same texts.

Random-weight models (`random:*`) get 30 s spectrogram windows only, with their own mel bins.
While the warm jobs run, the worker's metrics are scraped every half second: audio seconds per
second, the engine's busy fraction, queue wait and decode time per input; --plot draws them.
And the CPU time each part spends (worker process, engine core, job processes, Redis, the S3
server, this script) is divided by the warm seconds: a part near 1.0 that is one process (the
S3 server, Redis) is what bounds the row. Redis's own counts while warm (`INFO commandstats`,
this script's polls left out) give its commands a job and a second, and the most clients.
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
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from functools import partial
from itertools import product
from pathlib import Path

import httpx
import numpy as np
import psutil
import redis
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests: the shared helpers

from engine import Engine  # noqa: E402
from engine.audio import decode_audio  # noqa: E402
from engine.mel import N_SAMPLES, log_mel_spectrogram  # noqa: E402
from scripts import harness, measure  # noqa: E402
from scripts.redis_load import command_calls  # noqa: E402
from scripts.rtfx_bench import pipeline_rtfx  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from worker.app import create_app  # noqa: E402
from worker.contract.dispatch import dispatch  # noqa: E402
from worker.contract.jobs import TERMINAL, JobInput, JobRecord, JobStatus, JobStore, new_job_id  # noqa: E402
from worker.contract.results import TranscriptResult  # noqa: E402
from worker.contract.settings import Settings  # noqa: E402
from worker.core.engines import Engines  # noqa: E402
from worker.storage import Storage  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Inputs:
    kind: str  # audio or spectrogram
    items: list[bytes]
    audio_s: float


@dataclass
class Row:
    model: str
    kind: str
    copies: int
    processes: int
    jobs: int
    audio_s: float
    engine_s: float
    cold_s: float = 0.0
    warm_s: float = 0.0
    ready_s: float = 0.0
    first_start: bool = False
    succeeded: int = 0
    core_exited: bool | None = None
    transformers_rtfx: float | None = None
    cores: dict[str, float] = field(default_factory=dict)  # CPU seconds per warm second
    timeline: list[dict] = field(default_factory=list)
    gpus: str = ""  # `worker --gpus` (resolved: 0,1), or "" for one worker without it
    kill: dict = field(default_factory=dict)  # the --kill run's outcome (`kill_run`)
    redis: dict = field(default_factory=dict)  # Redis while warm: commands, clients (`run_row`)
    run: int = 0  # which of --runs
    pool_full: int = 0  # urllib3's "Connection pool is full" lines in the worker's log

    @property
    def warm_ratio(self) -> float:
        return self.engine_s / self.warm_s

    @property
    def cold_ratio(self) -> float:
        return self.engine_s / self.cold_s


def spectrogram(data: bytes, n_mels: int) -> bytes:
    """A clip as the .npy a client would send: one 30 s window, float16."""
    samples = torch.from_numpy(decode_audio(data)[:N_SAMPLES])
    buffer = io.BytesIO()
    np.save(buffer, log_mel_spectrogram(samples, n_mels).numpy().astype(np.float16))
    return buffer.getvalue()


class Fleet:
    """Redis, the S3 storage and one worker at a time (or one supervisor of a worker per
    GPU), on fresh ports."""

    def __init__(self, args: argparse.Namespace, model: str, source: str, log_dir: Path):
        self.args, self.model, self.log_dir = args, model, log_dir
        self.processes = 1
        self.gpus: list[str] = []  # `worker --gpus` these; none: a worker without it
        env = {
            "WHISPERFLEET_S3_BUCKET": "fleet-bench",
            "WHISPERFLEET_MODELS": f"{model}={source}",
            "WHISPERFLEET_DEFAULT_MODEL": model,
            "WHISPERFLEET_DEVICE": args.device,
            "WHISPERFLEET_MAX_JOB_AGE_S": "86400",
            "TRITON_CACHE_DIR": str(log_dir / "triton"),
        }
        if args.slot_memory:
            env["WHISPERFLEET_SLOT_MEMORY_BYTES"] = str(args.slot_memory)
        self.stack = harness.Stack(log_dir, env)
        self.stack.embedded_redis()
        self.stack.storage(args.weed)
        # each worker's port, then one per job process: chosen with Redis and S3 listening
        self.metrics_port = free_port(8 * 9)
        self.stack.env["WHISPERFLEET_METRICS_PORT"] = str(self.metrics_port)
        self.settings = self.stack.settings
        self.store = JobStore(redis.Redis.from_url(self.settings.redis_url))
        self.storage, self.app = Storage(self.settings), create_app(self.settings)
        self.storage.ensure_bucket()
        if args.kill:  # a result stored twice shows as a second version
            self.storage.client.put_bucket_versioning(
                Bucket=self.storage.bucket, VersioningConfiguration={"Status": "Enabled"}
            )
        self.worker: subprocess.Popen | None = None
        self.starts = 0
        self.polls = 0  # this script's own Redis commands in `wait`: one MGET a poll

    def close(self) -> None:
        if self.worker is not None:
            self.kill_worker()
        self.stack.close()

    def upload(self, inputs: Inputs) -> list[JobRecord]:
        """Store the inputs and their records (queued, not yet dispatched)."""
        fmt = "npy" if inputs.kind == "spectrogram" else "flac"

        def put(data: bytes) -> JobRecord:
            record = JobRecord(
                id=new_job_id(), model=self.model, priority="bulk",
                input=JobInput(kind=inputs.kind, bytes=len(data), format=fmt),
            )  # fmt: skip
            self.storage.client.put_object(
                Bucket=self.storage.bucket, Key=record.input_key, Body=data
            )
            self.store.create(record)
            return record

        with ThreadPoolExecutor(16) as pool:
            return list(tqdm(pool.map(put, inputs.items), total=len(inputs.items),
                             desc="upload", unit="job", file=sys.stderr, leave=False))  # fmt: skip

    def dispatch(self, records: list[JobRecord]) -> None:
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda r: dispatch(self.app, self.store, r), records))

    def wait(self, records: list[JobRecord], desc: str, midway=None) -> tuple[float, int]:
        """Until every job ends: when the last ended (time.time), how many succeeded.
        `midway()` is called once, when half of them ended."""
        pending, last, succeeded = {r.id for r in records}, 0.0, 0
        with tqdm(total=len(pending), desc=desc, unit="job", file=sys.stderr) as bar:
            while pending:
                if self.worker is not None and self.worker.poll() is not None:
                    raise SystemExit(f"the worker exited ({self.worker.returncode}); see logs")
                ids = list(pending)
                self.polls += 1
                for job_id, record in zip(ids, self.store.get_many(ids), strict=True):
                    if record.status in TERMINAL:
                        pending.discard(job_id)
                        bar.update()
                        succeeded += record.status is JobStatus.succeeded
                        last = max(last, record.finished_at.timestamp())
                if midway is not None and len(pending) <= len(records) // 2:
                    midway()
                    midway = None
                time.sleep(0.25)  # each job's end is its record's: polling adds no time
        return last, succeeded

    def worker_ports(self) -> list[list[int]]:
        """Each worker's metrics ports: its own, then one per job process (`worker --gpus`
        gives the i-th GPU's worker the block after the (i-1)-th's)."""
        each = self.processes + 1 if self.processes > 1 else 1
        return [
            list(range(self.metrics_port + i * each, self.metrics_port + (i + 1) * each))
            for i in range(max(1, len(self.gpus)))
        ]

    def start_worker(self) -> tuple[float, float]:
        """Start a worker; return when it started (time.time) and its seconds to `/ready`."""
        self.starts += 1
        started = time.time()
        options = ["--processes", str(self.processes)]
        if self.gpus:
            options += ["--gpus", ",".join(self.gpus)]
        if self.args.concurrency:  # else the worker's default
            each = -(-self.args.concurrency // self.processes)  # the jobs in flight, split
            options += ["--concurrency", str(each)]
        wrap = []
        if self.args.profile:  # py-spy samples the worker and every process it starts
            out = Path(self.args.profile).resolve() / f"start-{self.model}-{self.starts}.txt"
            spy = "record --subprocesses --threads --idle --nonblocking --rate 100 --format raw"
            wrap = ["py-spy", *spy.split(), "--output", str(out), "--"]
        self.worker = self.stack.worker(f"worker-{self.model}-{self.starts}", options, wrap=wrap)
        # every worker warm: its model loaded, graphs captured
        self.stack.ready([ports[0] for ports in self.worker_ports()])
        return started, time.time() - started

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds spent so far by each part of the fleet on this machine: the worker
        processes (and a supervisor of them), their engine cores, their job processes, Redis,
        the S3 server, and this script (which dispatches and polls)."""
        parts = {"worker": [], "core": [], "job processes": [], "redis": [], "storage": []}
        workers = [psutil.Process(self.worker.pid)]
        if self.gpus:  # the supervisor, then a worker per GPU
            workers += workers[0].children()
        parts["worker"] += workers
        for child in (c for w in workers for c in w.children() if c not in workers):
            cmdline = " ".join(child.cmdline())
            kind = "core" if "multiprocessing" in cmdline else "job processes"
            parts[kind].append(child)
        for name in ("redis", "storage"):
            if (pid := self.stack.pid(name)) is not None:
                parts[name].append(psutil.Process(pid))
        parts["bench"] = [psutil.Process()]
        seconds = {}
        for name, procs in parts.items():
            total = 0.0
            for proc in procs:
                with contextlib.suppress(psutil.NoSuchProcess):
                    t = proc.cpu_times()
                    total += t.user + t.system
            seconds[name] = total
        return seconds

    def kill_worker(self) -> bool:
        """kill -9 the worker; whether its engine core and job processes exited by themselves
        within 10 s."""
        if self.args.profile:  # py-spy writes its samples, then the worker goes, whole
            os.kill(self.worker.pid, signal.SIGINT)
            self.worker.wait()
            os.killpg(self.worker.pid, signal.SIGKILL)
            self.stack.stop(self.worker)  # ended: only forgotten
            self.worker = None
            return True
        worker = psutil.Process(self.worker.pid)
        cores, supervised = worker.children(recursive=True), worker.children()
        os.kill(self.worker.pid, signal.SIGKILL)
        self.worker.wait()
        self.stack.stop(self.worker)
        self.worker = None
        if self.gpus:  # the supervisor's workers (in process groups of their own) go too
            for proc in supervised:
                proc.kill()
        gone, alive = psutil.wait_procs(cores, timeout=10)
        for proc in alive:
            proc.kill()
        return not alive

    def kill_one(self) -> None:
        """kill -9 the last GPU's worker, as a GPU fault would end it: its engine core and
        job processes end with it, and the supervisor starts it again."""
        workers = psutil.Process(self.worker.pid).children()
        workers[-1].kill()

    def scrape(self) -> dict[str, float]:
        """The workers' metrics, summed over their ports (with job processes: the engine's on
        the first, each job process's on one after it)."""
        text = "\n".join(
            httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
            for ports in self.worker_ports()
            for port in ports
        )
        wanted = {
            "whisperfleet_audio_seconds_total": "audio_s",
            "whisperfleet_engine_busy_seconds_total": "busy_s",
            'whisperfleet_job_stage_seconds_sum{priority="bulk",stage="queue"}': "queue_sum",
            'whisperfleet_job_stage_seconds_count{priority="bulk",stage="queue"}': "queue_n",
            'whisperfleet_job_stage_seconds_sum{priority="bulk",stage="decode"}': "decode_sum",
            'whisperfleet_job_stage_seconds_count{priority="bulk",stage="decode"}': "decode_n",
        }
        values = {}
        for line in text.splitlines():
            name, _, value = line.rpartition(" ")
            if name in wanted:
                values[wanted[name]] = values.get(wanted[name], 0.0) + float(value)
        return values


def sampled(fleet: Fleet, stop: threading.Event, every: float = 0.5) -> list[dict]:
    samples = []
    while not stop.is_set():
        try:
            clients = fleet.store.redis.info("clients")["connected_clients"]
            samples.append({"t": time.time(), "clients": clients, **fleet.scrape()})
        except (httpx.HTTPError, redis.RedisError):
            pass
        stop.wait(every)
    return samples


def timeline(samples: list[dict], start: float) -> list[dict]:
    """Rates between samples: audio s/s, busy fraction; and the running mean queue wait and
    decode time per input. The engine core sends its counters once a second: a sample with
    none new is left out, or its rates would read as an idle half second."""
    out = []
    reported = [
        s for i, s in enumerate(samples)
        if i == 0 or (s.get("audio_s"), s.get("busy_s"))
        != (samples[i - 1].get("audio_s"), samples[i - 1].get("busy_s"))
    ]  # fmt: skip
    for a, b in zip(reported, reported[1:], strict=False):
        dt = b["t"] - a["t"]
        out.append({
            "t": b["t"] - start,
            "audio_per_s": (b.get("audio_s", 0) - a.get("audio_s", 0)) / dt,
            "busy": (b.get("busy_s", 0) - a.get("busy_s", 0)) / dt,
            "queue_ms": 1000 * b.get("queue_sum", 0) / max(b.get("queue_n", 0), 1),
            "decode_ms": 1000 * b.get("decode_sum", 0) / max(b.get("decode_n", 0), 1),
        })  # fmt: skip
    return out


def run_row(fleet: Fleet, row: Row, inputs: Inputs) -> None:
    records = fleet.upload(inputs)
    fleet.dispatch(records)  # queued before the worker starts: the cold run
    started, row.ready_s = fleet.start_worker()
    row.first_start = fleet.starts == 1
    last, _ = fleet.wait(records, f"{row.model} {row.kind} x{row.copies} cold")
    row.cold_s = last - started
    records = fleet.upload(inputs)
    stop, samples = threading.Event(), []
    scraper = threading.Thread(target=lambda: samples.extend(sampled(fleet, stop)))
    scraper.start()
    cpu, polls = fleet.cpu_seconds(), fleet.polls
    fleet.store.redis.config_resetstat()
    start = time.time()
    fleet.dispatch(records)
    last, row.succeeded = fleet.wait(records, f"{row.model} {row.kind} x{row.copies} warm")
    row.warm_s = last - start
    row.cores = {k: (v - cpu[k]) / row.warm_s for k, v in fleet.cpu_seconds().items()}
    commands = sum(command_calls(fleet.store.redis).values()) - (fleet.polls - polls)
    elapsed = time.time() - start
    stop.set()
    scraper.join()
    row.redis = {
        "commands_per_job": commands / row.jobs,  # the messages sent and the worker's part
        "commands_per_s": commands / elapsed,
        "clients": max((s["clients"] for s in samples), default=None),
    }
    row.timeline = timeline(samples, start)
    if fleet.args.kill and len(fleet.gpus) > 1:
        row.kill = kill_run(fleet, row, inputs, calm=records)
    row.core_exited = fleet.kill_worker()
    log = fleet.log_dir / f"worker-{row.model}-{fleet.starts}.log"
    row.pool_full = log.read_text(errors="replace").count("Connection pool is full")


def kill_run(fleet: Fleet, row: Row, inputs: Inputs, calm: list[JobRecord]) -> dict:
    """The warm jobs once more, the last GPU's worker killed once half of them ended; the
    outcome against the calm run's."""
    records = fleet.upload(inputs)
    start = time.time()
    fleet.dispatch(records)
    desc = f"{row.model} {row.kind} x{row.copies} kill -9"
    last, succeeded = fleet.wait(records, desc, midway=fleet.kill_one)
    before, after = [outcome(fleet, r) for r in calm], [outcome(fleet, r) for r in records]
    return {
        "s": last - start,
        "succeeded": succeeded,
        "lost": sum(text is None for text, _, _ in after),
        "stored_twice": sum(stored > 1 for _, _, stored in before + after),
        "audio_s": sum(audio for _, audio, _ in after),
        "calm_audio_s": sum(audio for _, audio, _ in before),
        "same_text": sum(
            a[0] is not None and a[0] == b[0] for a, b in zip(before, after, strict=True)
        ),
    }


def outcome(fleet: Fleet, record: JobRecord) -> tuple[str | None, float, int]:
    """A job's stored text (None: it did not succeed, or nothing is stored), its audio
    seconds, and how many times its result was stored."""
    record = fleet.store.get(record.id)
    versions = fleet.storage.client.list_object_versions(
        Bucket=fleet.storage.bucket, Prefix=record.result_key
    ).get("Versions", [])
    if record.status is not JobStatus.succeeded or not versions:
        return None, 0.0, len(versions)
    result = TranscriptResult.model_validate_json(fleet.storage.get(record.result_key))
    return result.text, result.duration, len(versions)


def model_inputs(kind: str, clips, copies: int, n_mels: int, random_weights: bool) -> Inputs:
    if random_weights:  # 30 s windows: engine-bound
        window = [spectrogram(data, n_mels) for data, _ in clips]
        return Inputs("spectrogram", window * copies, 30.0 * len(clips) * copies)
    items = [data for data, _ in clips] if kind == "audio" else [
        spectrogram(data, n_mels) for data, _ in clips
    ]  # fmt: skip
    return Inputs(kind, items * copies, sum(s for _, s in clips) * copies)


def spans(points: list[dict], at_least: float = 2.0) -> list[dict]:
    """The timeline's rates over spans of `at_least` seconds: the core reports once a second
    and the scrapes come twice, so single intervals alias (0.5 s, 1.5 s); a rate times its
    interval is a counter's change, so merging them is exact."""
    out, since, audio, busy = [], points[0]["t"] if points else 0.0, 0.0, 0.0
    for prev, p in zip(points, points[1:], strict=False):
        dt = p["t"] - prev["t"]
        audio, busy = audio + p["audio_per_s"] * dt, busy + p["busy"] * dt
        if p["t"] - since >= at_least:
            span = p["t"] - since
            out.append({"t": p["t"], "audio_per_s": audio / span, "busy": busy / span})
            since, audio, busy = p["t"], 0.0, 0.0
    return out


def plot(path: Path, rows: list[Row]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    for row in rows:
        if not (points := spans(row.timeline)):
            continue
        label = f"{row.model} {row.kind} x{row.copies}, {row.processes} job process(es)"
        label += f", GPUs {row.gpus}" if row.gpus else ""
        t = [p["t"] for p in points]
        top.plot(t, [p["audio_per_s"] for p in points], label=label, marker=".")
        bottom.plot(t, [p["busy"] for p in points], label=label, marker=".")
    top.set_ylabel("audio seconds / second")
    bottom.set_ylabel("engine busy fraction")
    bottom.set_xlabel("seconds since the first dispatch (warm worker)")
    top.legend(fontsize=8)
    bottom.set_ylim(bottom=0)
    top.set_title("the warm runs, scraped from the workers' metrics ports (2 s spans)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--audio-dir", default=str(ROOT.parent / "shared" / "audio" / "dev"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", default="tiny.en", help="name or name=source, comma-separated")
    parser.add_argument("--copies", default="1", help="comma-separated: rows per count")
    parser.add_argument("--inputs", default="audio,spectrogram")
    parser.add_argument("--engine-runs", type=int, default=2)
    parser.add_argument(
        "--concurrency",
        type=int,
        help="the worker's jobs in flight, split among its job processes (default: the "
        "worker's own: 32 on the CPU, 640 on a GPU)",
    )
    parser.add_argument(
        "--processes", default="1", help="comma-separated: the worker's job processes, a row each"
    )
    parser.add_argument("--transformers", action="store_true", help="RTFx of plain transformers")
    parser.add_argument(
        "--slot-memory-gb", type=float, help="each engine's slot cache (default: half the free)"
    )
    parser.add_argument(
        "--gpus",
        action="append",
        help="`worker --gpus` this (0,1 or all), a row each; repeat it, e.g. --gpus 0 --gpus all",
    )
    parser.add_argument(
        "--kill", action="store_true", help="with --gpus: a run that kill -9s one GPU's worker"
    )
    parser.add_argument(
        "--runs", type=int, default=1, help="each row this many times (a fresh worker each)"
    )
    parser.add_argument(
        "--weed",
        metavar="PATH",
        help="store in SeaweedFS (this `weed` binary: scripts/seaweed.py) instead of the "
        "embedded storage",
    )
    parser.add_argument("--plot", help="write a PNG of the warm runs' metrics here")
    parser.add_argument("--json", help="write every row here")
    parser.add_argument("--replot", metavar="JSON", help="only draw --plot from an earlier --json")
    parser.add_argument(
        "--restarts",
        type=int,
        metavar="N",
        help="only start the worker N times (each after a kill -9 of the last) and time /ready",
    )
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="with --restarts: record each start with py-spy (collapsed stacks, every process)",
    )
    args = parser.parse_args()
    if args.replot:
        rows = [Row(**r) for r in json.loads(Path(args.replot).read_text())]
        plot(Path(args.plot), rows)
        return
    args.slot_memory = int(args.slot_memory_gb * 1024**3) if args.slot_memory_gb else None
    if args.restarts:
        restarts(args)
        return
    clips = measure.read_clips(Path(args.audio_dir))
    log_dir = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    compile_cache = log_dir / "triton"  # the workers': empty, the first start compiles all
    os.environ["TRITON_CACHE_DIR"] = str(log_dir / "triton-engine")  # this process's
    print(f"logs in {log_dir}", file=sys.stderr)
    rows: list[Row] = []
    for spec in args.models.split(","):
        name, _, source = spec.partition("=")
        source = source or name
        random_weights = source.startswith("random:")
        settings = Settings(
            models=f"{name}={source}", default_model=name, device=args.device,
            slot_memory_bytes=args.slot_memory,
        )  # fmt: skip
        stream = Engine.open(Engines(settings).config(name))
        stream.warm()
        n_mels = stream.engine.loaded.dims.n_mels
        rtfx = None
        if args.transformers and not random_weights:
            audio = [decode_audio(data) for data, _ in clips]
            rtfx, _ = pipeline_rtfx(stream.engine.loaded, audio, batch_size=16)
        fleet = Fleet(args, name, source, log_dir)
        try:
            kinds = ["spectrogram"] if random_weights else args.inputs.split(",")
            for kind in kinds:
                for copies in map(int, args.copies.split(",")):
                    inputs = model_inputs(kind, clips, copies, n_mels, random_weights)
                    _, seconds = measure.timed(
                        partial(stream.transcribe, inputs.items), args.engine_runs
                    )
                    engine_s = min(seconds)  # the best run
                    for processes, gpus, run in product(
                        map(int, args.processes.split(",")),
                        map(gpu_list, args.gpus or [""]),
                        range(args.runs),
                    ):
                        fleet.processes, fleet.gpus = processes, gpus
                        row = Row(name, kind, copies, processes, len(inputs.items),
                                  inputs.audio_s, engine_s, gpus=",".join(gpus),
                                  run=run)  # fmt: skip
                        row.transformers_rtfx = rtfx if kind == "audio" else None
                        run_row(fleet, row, inputs)
                        rows.append(row)
                        print(table([row], header=False), file=sys.stderr)
        finally:
            fleet.close()
        del stream
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device
    flight = args.concurrency or "the default"
    shape = "a worker per GPU (--gpus)" if args.gpus else "one worker"
    print(f"\n{device}; {shape}, {flight} jobs in flight each; {len(clips)} clips\n")
    print(table(rows))
    if args.runs > 1:
        print("\n" + runs_table(rows))
    if args.gpus:
        print("\n" + scale_table(rows))
    print(f"\ncompile cache after the run: {sum(1 for _ in compile_cache.rglob('*'))} files")
    if args.plot:
        plot(Path(args.plot), rows)
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1))
    for cache in ("triton", "triton-engine"):
        shutil.rmtree(log_dir / cache, ignore_errors=True)


def gpu_list(spec: str) -> list[str]:
    """`--gpus` as the GPUs it names ("all": every GPU this process sees); "": none."""
    if spec == "all":
        return [str(i) for i in range(torch.cuda.device_count())]
    return spec.split(",") if spec else []


def runs_table(rows: list[Row]) -> str:
    """Each row's --runs: the median and range of its ratios and of its restarts' /ready (a
    first start, with its empty compile cache, left out)."""
    lines = [
        "| model | input | processes | GPUs | runs | warm ratio median [min–max] "
        "| cold ratio median [min–max] | ready s median [min–max] | pool full lines |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple, list[Row]] = {}
    for r in rows:
        groups.setdefault((r.model, r.kind, r.copies, r.processes, r.gpus), []).append(r)

    spread = partial(measure.spread, form="{median} [{low}–{high}]")

    for (model, kind, copies, processes, gpus), group in groups.items():
        restarts = [r.ready_s for r in group if not r.first_start]
        lines.append(
            f"| {model} | {kind} ×{copies} | {processes} | {gpus or '—'} | {len(group)} "
            f"| {spread([r.warm_ratio for r in group])} | {spread([r.cold_ratio for r in group])} "
            f"| {spread(restarts, 1)} | {sum(r.pool_full for r in group)} |"
        )
    return "\n".join(lines)


def scale_table(rows: list[Row]) -> str:
    """Each `--gpus` row against the first of its model, input and copies: audio seconds per
    second and their ratio; and the --kill run's outcome."""
    lines = [
        "| model | input | copies | GPUs | warm audio s/s | × the first | per GPU "
        "| kill -9 run s | succeeded | lost | stored twice | audio s as calm | same text |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    first: dict[tuple, float] = {}
    for r in rows:
        rate = r.audio_s / r.warm_s
        one = first.setdefault((r.model, r.kind, r.copies), rate)
        n = len(r.gpus.split(",")) if r.gpus else 1
        k = r.kill
        killed = (
            f"{k['s']:.1f} | {k['succeeded']}/{r.jobs} | {k['lost']} | {k['stored_twice']} "
            f"| {abs(k['audio_s'] - k['calm_audio_s']) < 1e-6} | {k['same_text']}/{r.jobs}"
            if k
            else "— | — | — | — | — | —"
        )
        lines.append(
            f"| {r.model} | {r.kind} | {r.copies} | {r.gpus or '—'} | {rate:.0f} "
            f"| {rate / one:.2f} | {rate / one / n:.2f} | {killed} |"
        )
    return "\n".join(lines)


def restarts(args: argparse.Namespace) -> None:
    """Start each model's worker `--restarts` times, every shape of `--processes`, and print
    how long each took to `/ready` (the first with an empty compile cache)."""
    log_dir = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    print("| model | job processes | start | ready s | core and job processes gone |")
    print("|---|---|---|---|---|")
    for spec in args.models.split(","):
        name, _, source = spec.partition("=")
        fleet = Fleet(args, name, source or name, log_dir)
        try:
            for processes in map(int, args.processes.split(",")):
                fleet.processes = processes
                for _ in range(args.restarts):
                    _, ready = fleet.start_worker()
                    first = " (empty cache)" if fleet.starts == 1 else ""
                    gone = fleet.kill_worker()
                    print(
                        f"| {name} | {processes} | {fleet.starts}{first} | {ready:.1f} | {gone} |"
                    )
        finally:
            fleet.close()
    print(f"logs in {log_dir}")


def table(rows: list[Row], header: bool = True) -> str:
    lines = []
    if header:
        lines += [
            "| model | input | processes | GPUs | jobs | audio s | engine s | warm s | warm ratio "
            "| cold s | cold ratio | ready s | engine RTFx | transformers RTFx | ok "
            "| core exited | CPU cores busy while warm | Redis while warm |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
    for r in rows:
        ready = f"{r.ready_s:.1f}" + (" (empty cache)" if r.first_start else "")
        hf = f"{r.transformers_rtfx:.0f}" if r.transformers_rtfx else "—"
        cores = ", ".join(f"{k} {v:.2f}" for k, v in r.cores.items())
        db = r.redis and (
            f"{r.redis['commands_per_job']:.0f} commands a job, "
            f"{r.redis['commands_per_s']:,.0f} a second, {r.redis['clients']} clients"
        )
        lines.append(
            f"| {r.model} | {r.kind} | {r.processes} | {r.gpus or '—'} | {r.jobs} "
            f"| {r.audio_s:.0f} | {r.engine_s:.2f} "
            f"| {r.warm_s:.2f} | {r.warm_ratio:.2f} | {r.cold_s:.2f} | {r.cold_ratio:.2f} "
            f"| {ready} | {r.audio_s / r.engine_s:.0f} | {hf} | {r.succeeded}/{r.jobs} "
            f"| {r.core_exited} | {cores} | {db or '—'} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
