"""A small fleet for fault tests: its own redis-server (AOF in a temp folder, on a free port,
never the machine's shared one), its own moto S3 server, real worker processes (tiny.en on
the CPU), and jobs submitted as the API submits them."""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import redis
import soundfile as sf
from fastapi.testclient import TestClient

from api.main import create_app as create_api
from tests.conftest import free_port, start_redis, stop, wait_for_port
from worker.app import create_app
from worker.contract.dispatch import dispatch
from worker.contract.jobs import TERMINAL, JobInput, JobRecord, JobStatus, JobStore, new_job_id
from worker.contract.options import JobOptions
from worker.contract.settings import Settings
from worker.local import s3_server
from worker.storage import Storage

# fast takeover, so a test waits seconds, not minutes
FAST = {"LEASE_S": "3", "RECONCILE_EVERY_S": "0.5", "STALE_AFTER_S": "2", "METRICS_PORT": "0"}


class RedisServer:
    def __init__(self, folder: Path, fsync: str = "everysec"):
        self.folder, self.fsync, self.port = folder, fsync, free_port()
        self.proc: subprocess.Popen | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = start_redis(
            self.port, "--dir", str(self.folder), "--appendonly", "yes", "--appendfsync", self.fsync
        )

    def restart_gracefully(self) -> None:
        """SIGTERM: Redis writes its AOF out and exits; then start it on the same folder."""
        self.proc.terminate()
        self.proc.wait(timeout=30)
        self.start()

    def restart_after_kill(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=30)
        self.start()

    def close(self) -> None:
        if self.proc:
            self.proc.kill()
            self.proc.wait()


class StorageServer:
    """moto's S3 server: in memory, so it may be frozen (SIGSTOP) but never restarted."""

    def __init__(self):
        self.port = free_port()
        self.proc = subprocess.Popen(
            s3_server.command("127.0.0.1", self.port),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for_port(self.port, self.proc)
        self.url = f"http://127.0.0.1:{self.port}"

    def freeze(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        self.thaw()
        stop(self.proc)


@dataclass
class Tally:
    submitted: int
    succeeded: int
    failed: int
    duplicates: int  # jobs with more than one result object (the bucket keeps versions)
    lost: int  # accepted jobs not terminal, or succeeded without a result

    def __str__(self) -> str:
        return (
            f"submitted {self.submitted}, succeeded {self.succeeded}, failed {self.failed}, "
            f"duplicates {self.duplicates}, lost {self.lost}"
        )


class Fleet:
    def __init__(self, folder: Path, redis_server: RedisServer, storage: StorageServer, **env):
        self.folder, self.redis_server = folder, redis_server
        bucket = f"faults-{uuid.uuid4().hex[:12]}"
        self.env = {
            **os.environ,
            "WHISPERFLEET_REDIS_URL": redis_server.url,
            "WHISPERFLEET_S3_ENDPOINT_URL": storage.url,
            "WHISPERFLEET_S3_BUCKET": bucket,
            "WHISPERFLEET_DEVICE": "cpu",
            "WHISPERFLEET_MODELS": "tiny.en",
            "WHISPERFLEET_WORKER_CONCURRENCY": "8",
            "WHISPERFLEET_AUTH": "none",  # the API is open: the subject here is faults
            **{f"WHISPERFLEET_{k}": str(v) for k, v in {**FAST, **env}.items()},
        }
        self.settings = Settings(  # the workers' settings, for this process's clients
            redis_url=redis_server.url,
            s3_endpoint_url=storage.url,
            s3_bucket=bucket,
            **{k.lower(): v for k, v in {**FAST, **env}.items()},
        )
        self.redis = redis.Redis.from_url(redis_server.url)
        self.store = JobStore(self.redis)
        self.storage = Storage(self.settings)
        self.storage.ensure_bucket()
        self.storage.client.put_bucket_versioning(
            Bucket=bucket, VersioningConfiguration={"Status": "Enabled"}
        )
        self.app = create_app(self.settings)
        self.workers: list[subprocess.Popen] = []

    def start_worker(
        self, failpoint: str | None = None, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        """`whisperfleet worker` (with `args`, e.g. `--gpus 0`; `env` over the fleet's)."""
        env = {**self.env, "WHISPERFLEET_FAILPOINT": failpoint or "", **(env or {})}
        return self._start([sys.executable, "-m", "worker.cli", "worker", *args], env)

    def start_celery_worker(self) -> subprocess.Popen:
        """A worker started as operators start Celery workers, not by our command line."""
        name = f"plain-{len(self.workers)}@%h"
        argv = ["celery", "-A", "worker.app", "worker", "--loglevel=INFO", f"--hostname={name}"]
        return self._start([sys.executable, "-m", *argv], self.env)

    def start(self, *command: str) -> subprocess.Popen:
        """Another `whisperfleet` process of this fleet: `start("scanner")`, `start("beat")`."""
        return self._start([sys.executable, "-m", "worker.cli", *command], self.env)

    def _start(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        log = open(self.log_path(len(self.workers)), "w")  # noqa: SIM115
        proc = subprocess.Popen(argv, env=env, stdout=log, stderr=log)
        self.workers.append(proc)
        return proc

    def log_path(self, index: int) -> Path:
        """The log of the `index`-th worker started."""
        return self.folder / f"worker-{index}.log"

    def logs(self) -> str:
        return "".join(p.read_text() for p in sorted(self.folder.glob("worker-*.log")))

    def submit(
        self,
        data: bytes,
        kind: str = "audio",
        fmt: str = "flac",
        twice: bool = False,
        options: JobOptions | None = None,
        priority: str = "bulk",
    ):
        """As the API does: the input, the record, the message (here maybe two)."""
        record = JobRecord(
            id=new_job_id(),
            model="tiny.en",
            options=options or JobOptions(),
            priority=priority,
            input=JobInput(kind=kind, bytes=len(data), format=fmt),
        )
        self.storage.client.put_object(Bucket=self.storage.bucket, Key=record.input_key, Body=data)
        self.store.create(record)
        dispatch(self.app, self.store, record)
        if twice:
            dispatch(self.app, self.store, record)
        return record.id

    def wait_until(self, ids: list[str], statuses: set[str], count: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                records = [self.store.get(i) for i in ids]
                if sum(r.status in statuses for r in records) >= count:
                    return
            except redis.ConnectionError:
                pass
            time.sleep(0.2)
        stuck = [
            (
                i,
                r.status.value,
                r.attempts,
                self.store.is_sent(i),
                self.redis.get(f"whisperfleet:lease:{i}"),
            )
            for i, r in zip(ids, (self.store.get(i) for i in ids), strict=True)
            if r.status not in statuses
        ]
        raise TimeoutError(
            f"fewer than {count} jobs reached {statuses} in {timeout} s; "
            f"(job, status, attempts, sent mark, lease) of the others: {stuck}"
        )

    def wait_until_running_on(self, job_id: str, pid: int, timeout: float) -> None:
        """Until the job has started on the worker process `pid` (in either of its lanes)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            record = self.store.get(job_id)
            if record.status == "running" and (record.worker or "").endswith(f":{pid}"):
                return
            time.sleep(0.1)
        raise TimeoutError(f"job {job_id} did not start on worker {pid} within {timeout} s")

    def readiness(self) -> str:
        """What the fleet's API answers for its workers at `/readyz`."""
        with TestClient(create_api(self.settings)) as c:
            answer = c.get("/readyz")
        checks = answer.json()["checks"]
        assert (answer.status_code == 200) == all(v == "ok" for v in checks.values()), answer
        return checks["workers"]

    def wait_readiness(self, workers: str, timeout: float = 120) -> float:
        """Seconds until `/readyz` answers `workers` for the fleet's workers."""
        started = time.monotonic()
        while self.readiness() != workers:
            if time.monotonic() - started > timeout:
                raise TimeoutError(f"/readyz did not say workers {workers} in {timeout} s")
            time.sleep(0.2)
        return time.monotonic() - started

    def wait_all(self, ids: list[str], timeout: float = 240) -> None:
        self.wait_until(ids, set(TERMINAL), len(ids), timeout)

    def tally(self, ids: list[str]) -> Tally:
        succeeded = failed = duplicates = lost = 0
        for job_id in ids:
            record = self.store.get(job_id)
            listing = self.storage.client.list_object_versions(
                Bucket=self.storage.bucket, Prefix=record.result_key
            )
            versions = len(listing.get("Versions", []))
            duplicates += versions > 1
            if record.status is JobStatus.succeeded:
                succeeded += 1
                lost += versions == 0
            elif record.status is JobStatus.failed:
                failed += 1
                print(f"job {job_id} failed: {record.error.code}: {record.error.message}")
            else:
                lost += 1
        tally = Tally(len(ids), succeeded, failed, duplicates, lost)
        print(tally)
        return tally

    def redeliver_overdue(self) -> None:
        """What every worker's consumer does now and then: put messages unacked for longer
        than the visibility timeout back on their queue (kombu's own code, run here now)."""
        with self.app.connection_for_read() as connection:
            connection.default_channel.qos.restore_visible(num=100, interval=1)

    def close(self) -> None:
        """Its workers killed, then its redis-server stopped."""
        for proc in self.workers:
            if proc.poll() is None:
                for child in psutil.Process(proc.pid).children(recursive=True):
                    child.kill()  # a supervisor's workers
                proc.kill()
                proc.wait()
        self.redis_server.close()


def speech(clip: bytes, seconds: float) -> bytes:
    """The first `seconds` of a real clip, as FLAC: short jobs keep the tests quick."""
    audio, rate = sf.read(io.BytesIO(clip), dtype="float32")
    out = io.BytesIO()
    sf.write(out, audio[: int(seconds * rate)], rate, format="FLAC")
    return out.getvalue()


def npy(array: np.ndarray) -> bytes:
    out = io.BytesIO()
    np.save(out, array)
    return out.getvalue()


def wav(samples: np.ndarray, rate: int) -> bytes:
    out = io.BytesIO()
    sf.write(out, samples, rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


def at_rate(clip: bytes, seconds: float, rate: int) -> bytes:
    """The first `seconds` of a 16 kHz clip as a WAV at `rate` (linear interpolation)."""
    audio, source = sf.read(io.BytesIO(clip), dtype="float32")
    audio = audio[: int(seconds * source)]
    at = np.arange(int(len(audio) * rate / source)) * source / rate
    return wav(np.interp(at, np.arange(len(audio)), audio).astype(np.float32), rate)


RUNNING = {"running"}


def make_fleet(tmp_path: Path, storage_server: StorageServer, fsync="everysec", **env) -> Fleet:
    """A fleet on a redis-server of its own (started), with `env` over its settings."""
    redis_server = RedisServer(tmp_path, fsync)
    redis_server.start()
    return Fleet(tmp_path, redis_server, storage_server, **env)


def submit_many(fleet: Fleet, inputs: list[bytes], n: int, **kwargs) -> list[str]:
    return [fleet.submit(inputs[i % len(inputs)], **kwargs) for i in range(n)]
