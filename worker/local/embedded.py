"""The embedded defaults: a local Redis and moto's S3 server, started when nothing answers.

Used by `whisperfleet stack`, which stops what it started when it stops.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from urllib.parse import urlparse

import redis

from worker.contract.settings import Settings
from worker.local import s3_server


class ServiceError(SystemExit):
    """A service the stack needs is missing; the message says what to do."""


def _answers(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _wait(check, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise ServiceError(f"{what} did not come up within {timeout:.0f} s")
        time.sleep(0.1)


def redis_answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=0.5).ping())
    except redis.RedisError:
        return False


def ensure_redis(settings: Settings, start: bool) -> subprocess.Popen | None:
    """Return None if Redis answers; else start a local one (if allowed) and return it."""
    url = settings.redis_url
    if redis_answers(url):
        return None
    hint = "set WHISPERFLEET_REDIS_URL to a Redis that runs, or run `whisperfleet stack`"
    if not (start and settings.redis_is_local):
        raise ServiceError(f"Redis does not answer at {url}; {hint}")
    exe = shutil.which("redis-server")
    if exe is None:
        raise ServiceError(
            f"Redis does not answer at {url} and redis-server is not installed: "
            "install it (e.g. `apt-get install -y redis-server`) or set WHISPERFLEET_REDIS_URL"
        )
    port = urlparse(url).port or 6379
    kept = settings.data_dir / "redis"
    kept.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(kept), "--save", ""]
        + ["--appendonly", "yes", "--appendfsync", "everysec"],
        stdout=subprocess.DEVNULL,
        process_group=0,  # stopped by the stack after its workers, not by Ctrl-C before them
    )
    _wait(lambda: redis_answers(url), f"redis-server on port {port}")
    return proc


def storage_answers(settings: Settings) -> bool:
    endpoint = urlparse(settings.s3_endpoint_url)
    return _answers(endpoint.hostname or "127.0.0.1", endpoint.port or 80)


def ensure_storage(settings: Settings, start: bool) -> subprocess.Popen | None:
    """Return None if the S3 endpoint answers; else start moto's server there, its objects
    kept under the data directory, and return it."""
    if storage_answers(settings):
        return None
    url = settings.s3_endpoint_url
    if not (start and settings.storage_is_local):
        raise ServiceError(
            f"no S3 endpoint answers at {url}; set WHISPERFLEET_S3_ENDPOINT_URL or run "
            "`whisperfleet stack`, which starts an embedded one"
        )
    endpoint = urlparse(url)
    proc = subprocess.Popen(
        s3_server.command(endpoint.hostname, endpoint.port, settings.data_dir / "storage"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        process_group=0,  # as Redis's
    )
    _wait(lambda: storage_answers(settings), f"moto's S3 server at {url}")
    return proc
