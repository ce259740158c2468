"""What the queue path costs: the same clips through the engine directly, then as jobs through
Redis, a real worker process and S3 storage, on the same device.

    python scripts/queue_overhead.py [--manifest ../shared/audio/dev/manifest.jsonl]
        [--model tiny.en] [--device cpu] [--repeat 2] [--copies 1]

Direct: `Stream.transcribe` over every clip at once (the engine's own continuous
batching, nothing else). Queue: a Redis and moto's S3 server of its own (fresh ports), one
`whisperfleet worker` process, each clip uploaded and dispatched as the API does, from 16
threads as from many clients; timed from the first upload to the last terminal record, after
one warm-up job. `--copies N` runs each clip N times (a GPU needs more work than the dev set
to reach its pace). Ratio: direct seconds over queue seconds (1.0: the queue path costs
nothing).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import redis
from tqdm import tqdm

from engine import Engine, EngineConfig
from engine.tools.evaluate import read_manifest
from worker.app import create_app
from worker.contract.dispatch import dispatch
from worker.contract.jobs import TERMINAL, JobInput, JobRecord, JobStatus, JobStore, new_job_id
from worker.contract.settings import Settings
from worker.embedded import ensure_redis, ensure_storage
from worker.storage import Storage


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def direct(model: str, device: str, clips: list[bytes]) -> float:
    stream = Engine.open(EngineConfig(model=model, device=device))
    stream.transcribe(clips[:1])  # warm-up
    start = time.perf_counter()
    stream.transcribe(clips)
    return time.perf_counter() - start


def through_queue(settings: Settings, env: dict, clips: list[bytes]) -> tuple[float, int]:
    store = JobStore(redis.Redis.from_url(settings.redis_url))
    storage, app = Storage(settings), create_app(settings)
    storage.ensure_bucket()

    def submit(data: bytes) -> str:
        record = JobRecord(
            id=new_job_id(), model=settings.default_model, priority="bulk",
            input=JobInput(kind="audio", bytes=len(data), format="flac"),
        )  # fmt: skip
        storage.client.put_object(Bucket=storage.bucket, Key=record.input_key, Body=data)
        store.create(record)
        dispatch(app, store, record)
        return record.id

    def wait(ids: list[str], bar: tqdm | None = None) -> None:
        pending = set(ids)
        while pending:
            for job_id in list(pending):
                if store.get(job_id).status in TERMINAL:
                    pending.discard(job_id)
                    if bar:
                        bar.update()
            time.sleep(0.02)

    worker = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "worker"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait([submit(clips[0])])  # warm-up: the worker has loaded its model and taken a job
        start = time.perf_counter()
        with tqdm(total=len(clips), unit="job", desc="queue", file=sys.stderr) as bar:
            with ThreadPoolExecutor(16) as pool:
                ids = list(pool.map(submit, clips))
            wait(ids, bar)
        seconds = time.perf_counter() - start
        succeeded = sum(store.get(i).status is JobStatus.succeeded for i in ids)
        return seconds, succeeded
    finally:
        worker.terminate()
        worker.wait()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--manifest", default="../shared/audio/dev/manifest.jsonl")
    parser.add_argument("--model", default="tiny.en")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=2, help="best of this many runs each")
    parser.add_argument("--copies", type=int, default=1, help="jobs per clip")
    args = parser.parse_args()
    entries = read_manifest(Path(args.manifest))
    clips = [e.path.read_bytes() for e in entries] * args.copies
    audio_s = sum(e.seconds for e in entries) * args.copies

    settings = Settings(
        redis_url=f"redis://127.0.0.1:{free_port()}/0",
        s3_endpoint_url=f"http://127.0.0.1:{free_port()}",
        s3_bucket="overhead",
        models=args.model,
        default_model=args.model,
        device=args.device,
        metrics_port=0,
    )
    services = [ensure_redis(settings, start=True), ensure_storage(settings, start=True)]
    env = {
        **os.environ,
        "WHISPERFLEET_REDIS_URL": settings.redis_url,
        "WHISPERFLEET_S3_ENDPOINT_URL": settings.s3_endpoint_url,
        "WHISPERFLEET_S3_BUCKET": settings.s3_bucket,
        "WHISPERFLEET_MODELS": args.model,
        "WHISPERFLEET_DEFAULT_MODEL": args.model,
        "WHISPERFLEET_DEVICE": args.device,
        "WHISPERFLEET_METRICS_PORT": "0",
    }
    try:
        engine_s = min(direct(args.model, args.device, clips) for _ in range(args.repeat))
        runs = [through_queue(settings, env, clips) for _ in range(args.repeat)]
        queue_s, succeeded = min(runs)
    finally:
        for proc in services:
            if proc is not None:
                proc.terminate()
                proc.wait()
    print(f"{len(clips)} clips, {audio_s:.0f} s of audio, {args.model} on {args.device}\n")
    print("| path | seconds | audio s / s | jobs succeeded |")
    print("|---|---|---|---|")
    print(f"| engine directly (Stream.transcribe) | {engine_s:.2f} | {audio_s / engine_s:.1f} | |")
    print(
        f"| queue: Redis, worker process, S3 | {queue_s:.2f} | {audio_s / queue_s:.1f} "
        f"| {succeeded}/{len(clips)} |"
    )
    print(f"\nratio (queue throughput / engine throughput): {engine_s / queue_s:.2f}")


if __name__ == "__main__":
    main()
