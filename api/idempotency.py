"""`Idempotency-Key`: a retried submission gets the job of the first one, never a second job.

The first request with a key claims it in Redis (SET NX) before it stores anything, and on
success settles it with its fingerprint (what it asked for: the route, the fields, the file's
SHA-256) and its job's id, kept `idempotency_ttl_s`. A request that finds the key claimed reads
its own body without storing it, waits for the first to settle, and answers the same job if
the fingerprints match, 409 `idempotency_conflict` if not. A first request that fails releases
the key, so a retry after a refusal is a new request.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time

import redis
from starlette.concurrency import run_in_threadpool

from api.errors import ApiError

PENDING = b"pending"
# a claim outlives any upload it guards (200 MiB at a few hundred KB/s), and lapses if the API
# died under it
CLAIM_S = 3600
WAIT_S = 60.0  # how long a retry waits for the first request to settle
MAX_KEY = 255


def fingerprint(route: str, fields: dict[str, object], digest: str = "") -> str:
    canonical = json.dumps([route, sorted(fields.items()), digest], default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


class Idempotency:
    def __init__(self, client: redis.Redis, tenant: str, key: str, ttl_s: float):
        if not 0 < len(key) <= MAX_KEY or not key.isprintable():
            raise ApiError(
                422,
                "invalid_request",
                f"Idempotency-Key must be 1 to {MAX_KEY} printable characters",
            )
        self.redis, self.ttl_s = client, ttl_s
        self.name = f"whisperfleet:idempotency:{tenant}:{hashlib.sha256(key.encode()).hexdigest()}"

    def claim(self) -> bool:
        """True if this request is the first with the key."""
        return bool(self.redis.set(self.name, PENDING, nx=True, ex=CLAIM_S))

    def settle(self, print_: str, job_id: str) -> None:
        value = json.dumps({"fingerprint": print_, "job": job_id})
        self.redis.set(self.name, value, ex=max(1, int(self.ttl_s)))

    def release(self) -> None:
        self.redis.delete(self.name)

    async def replay(self, print_: str) -> str:
        """The job of the first request with this key, once it settled; 409 if it asked for
        something else, or if it failed, or is still going after WAIT_S."""
        deadline = time.monotonic() + WAIT_S
        while True:
            value = await run_in_threadpool(self.redis.get, self.name)
            if value is None:
                raise ApiError(
                    409,
                    "idempotency_conflict",
                    "the first request with this Idempotency-Key failed; send it again",
                )
            if value != PENDING:
                first = json.loads(value)
                if first["fingerprint"] != print_:
                    raise ApiError(
                        409,
                        "idempotency_conflict",
                        "this Idempotency-Key was used for a different request",
                    )
                return first["job"]
            if time.monotonic() > deadline:
                raise ApiError(
                    409,
                    "idempotency_conflict",
                    "a request with this Idempotency-Key is still in progress; try again later",
                    {"Retry-After": "5"},
                )
            await asyncio.sleep(0.05)
