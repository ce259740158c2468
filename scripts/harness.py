"""One way to start and stop a benchmark's stack (its runs are timed and summarised by
scripts/measure.py).

Why: so that the benchmarks measure the same thing the same way: the same processes, started,
waited for and stopped alike (none left running, whatever ends the script).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import boto3
import httpx
from botocore.config import Config

from scripts import seaweed
from tests.conftest import free_port
from worker.contract.settings import Settings
from worker.local import s3_server
from worker.local.embedded import ensure_redis

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "worker.cli"]
PREFIX = "WHISPERFLEET_"

# -- processes


def answers(port: int) -> bool:
    """Whether something listens on this loopback port."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _own_group() -> None:
    """In the child before exec: a process group of its own (stopped as a whole), and a
    SIGTERM when this script dies, however it dies."""
    os.setsid()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _stop(proc: subprocess.Popen, grace: float) -> None:
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def until(check, what: str, timeout: float, alive=None, every: float = 0.2) -> None:
    """Poll `check()` until it holds; `alive()` between polls raises if what it waits on died."""
    deadline = time.monotonic() + timeout
    while not check():
        if alive:
            alive()
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout:.0f} s")
        time.sleep(every)


class Stack:
    """The processes a benchmark started, stopped in reverse order (SIGTERM to the group,
    SIGKILL after `grace` s), each logging to `log_dir/NAME.log`; and the environment they
    share: Redis at `redis_url` (one of the caller's, or one started here on `redis_port`) and
    the storage on `s3_port`, with the caller's `env` over them."""

    def __init__(self, log_dir: Path, env: dict[str, str] | None = None, redis_url: str = ""):
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen, float]] = []
        self.redis_port, self.s3_port = free_port(), free_port()
        self.redis_url = redis_url or f"redis://127.0.0.1:{self.redis_port}/0"
        self.env = {
            **os.environ,
            f"{PREFIX}REDIS_URL": self.redis_url,
            f"{PREFIX}S3_ENDPOINT_URL": f"http://127.0.0.1:{self.s3_port}",
            **(env or {}),
        }

    @property
    def settings(self) -> Settings:
        """The settings the stack's processes read from its environment; its data (Redis's and
        the storage's files) in `log_dir`, this run's alone."""
        given = {k[len(PREFIX) :].lower(): v for k, v in self.env.items() if k.startswith(PREFIX)}
        return Settings(**{**given, "data_dir": self.log_dir})

    def start(self, name: str, argv: list[str], env: dict | None = None, grace: float = 15.0):
        log = open(self.log_dir / f"{name}.log", "w")  # noqa: SIM115
        proc = subprocess.Popen(
            argv, env=env or self.env, stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, preexec_fn=_own_group, cwd=ROOT,
        )  # fmt: skip
        log.close()
        self.procs.append((name, proc, grace))
        return proc

    def stop(self, proc: subprocess.Popen) -> None:
        """Stop it (one that has exited already is only forgotten)."""
        for i, (_, p, grace) in enumerate(self.procs):
            if p is proc:
                del self.procs[i]
                _stop(p, grace)
                return

    def close(self) -> None:
        while self.procs:
            _, proc, grace = self.procs.pop()
            _stop(proc, grace)

    def pid(self, name: str) -> int | None:
        return next((p.pid for n, p, _ in self.procs if n == name), None)

    def check(self) -> None:
        """Raise if a process this script started has exited."""
        for name, proc, _ in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited ({proc.returncode}):\n{self.tail(name)}")

    def tail(self, name: str, lines: int = 30) -> str:
        path = self.log_dir / f"{name}.log"
        text = path.read_text(errors="replace") if path.exists() else ""
        return "".join(text.splitlines(True)[-lines:])

    # -- the services

    def embedded_redis(self) -> None:
        """Redis as `whisperfleet stack` runs it (worker.local.embedded), on `redis_port`."""
        proc = ensure_redis(self.settings, start=True)
        if proc is not None:
            self.procs.append(("redis", proc, 5))

    def redis_server(self, exe: str) -> None:
        """This redis-server on `redis_port`, without persistence."""
        argv = [exe, "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", ""]
        self.start("redis", [*argv, "--appendonly", "no"], grace=5)
        until(lambda: answers(self.redis_port), "redis-server", 20, self.check)

    def storage(self, weed: str | None = None) -> None:
        """The embedded storage on `s3_port`, its objects on disk as the stack keeps them; or
        SeaweedFS, this `weed` binary (scripts/seaweed.py), with the stack's key."""
        if weed:
            settings = self.settings
            key = settings.s3_access_key_id, settings.s3_secret_access_key
            env = {**os.environ, **seaweed.environment(*key)}
            argv = seaweed.command(weed, self.log_dir / "seaweed", self.s3_port)
            self.start("storage", argv, env, grace=10)
        else:
            argv = s3_server.command("127.0.0.1", self.s3_port, self.log_dir / "storage")
            self.start("storage", argv, grace=5)
        s3 = self.s3()
        until(lambda: seaweed.answers(s3), "the storage", 60, self.check)

    def s3(self):
        """A client of the storage, enough connections for a pool of threads."""
        settings = self.settings
        return boto3.client(
            "s3",
            endpoint_url=settings.s3_endpoint_url,
            region_name=settings.s3_region,
            aws_access_key_id=settings.s3_access_key_id,
            aws_secret_access_key=settings.s3_secret_access_key,
            config=Config(max_pool_connections=32, s3={"addressing_style": "path"}),
        )

    def api(self, headers: dict[str, str] | None = None) -> httpx.Client:
        """`whisperfleet api` on a free port, once it reaches Redis and the storage (the
        workers may start after it): a client of it."""
        port = free_port()
        self.start("api", [*CLI, "api", "--port", str(port)], grace=5)
        client = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers, timeout=60)

        def ready() -> bool:
            try:
                checks = client.get("/readyz").json()["checks"]
                return checks["redis"] == checks["storage"] == "ok"
            except httpx.HTTPError:
                return False

        until(ready, "the API", 60, self.check)
        return client

    def worker(
        self, name: str, options: list[str], env: dict | None = None, wrap: Sequence[str] = ()
    ) -> subprocess.Popen:
        """`whisperfleet worker` (under `wrap`, a profiler's command line); its grace lets
        its jobs end or go back to their queue."""
        return self.start(name, [*wrap, *CLI, "worker", *options], env, grace=20)

    def ready(self, ports: list[int], timeout: float = 600) -> None:
        """Until each of these metrics ports says `/ready` (a worker warm: its model loaded,
        its graphs captured)."""
        waiting = [f"http://127.0.0.1:{port}" for port in ports]

        def answered() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                while waiting and httpx.get(f"{waiting[0]}/ready", timeout=1).status_code == 200:
                    waiting.pop(0)
            return not waiting

        until(answered, f"/ready on ports {ports}", timeout, self.check, every=0.05)
