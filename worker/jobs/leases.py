"""Who runs a job: a lease with a heartbeat, and the reconciler that takes over the jobs of
workers that died.

A lease is a Redis key `whisperfleet:lease:<job id>` holding the worker's id, set only if
absent and expiring `ttl_s` after its last renewal. A delivery of a job that someone holds is
dropped: the holder finishes it, or dies and lets the lease lapse. Every worker runs a
reconciler; one at a time (a lock in Redis) it looks at the active jobs not looked at lately:
a job whose result is stored ends `succeeded`; a job older than its age limit ends `expired`;
a running job without a lease lost its worker and is queued again, for the quarantine lane
(`worker.jobs.quarantine`); a queued job whose message is gone (see `JobStore`) gets a new one. So
a dead worker's jobs are taken over once they are stale (`stale_after_s`, and `ttl_s` since
the lease's last renewal) and at the reconciler's next turn: about a minute by default, not
after Redis's visibility timeout.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
from collections.abc import Callable
from datetime import UTC, datetime

import redis
from botocore.exceptions import BotoCoreError, ClientError

from worker.contract.jobs import (
    QUEUES,
    TASK_NAME,
    TERMINAL,
    JobError,
    JobRecord,
    JobStatus,
    JobStore,
    Progress,
    TransitionError,
)

log = logging.getLogger(__name__)

AUDIT_LIMIT = 5_000  # messages: queues up to this long are read to find lost messages

# renew or drop a lease only if it is still ours
_RENEW = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then "
    "return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0"
)
_RELEASE = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
)


class Leases:
    def __init__(
        self, client: redis.Redis, worker_id: str, ttl_s: float, prefix: str = "whisperfleet"
    ):
        self.redis, self.worker_id, self.prefix = client, worker_id, prefix
        self.ttl_ms = int(ttl_s * 1000)
        self._renew = client.register_script(_RENEW)
        self._release = client.register_script(_RELEASE)
        self.held: set[str] = set()  # renewed by the heartbeat while this worker runs them

    def _key(self, job_id: str) -> str:
        return f"{self.prefix}:lease:{job_id}"

    def acquire(self, job_id: str) -> bool:
        if self.redis.set(self._key(job_id), self.worker_id, nx=True, px=self.ttl_ms):
            self.held.add(job_id)
            return True
        return False

    def holder(self, job_id: str) -> str | None:
        value = self.redis.get(self._key(job_id))
        return value.decode() if value is not None else None

    def renew(self, job_id: str) -> bool:
        """False: the lease lapsed (or another worker holds it now)."""
        return bool(self._renew(keys=[self._key(job_id)], args=[self.worker_id, self.ttl_ms]))

    def release(self, job_id: str) -> None:
        self.held.discard(job_id)
        self._release(keys=[self._key(job_id)], args=[self.worker_id])

    def heartbeat(self, healthy: Callable[[], bool], stop: threading.Event) -> None:
        """Renew every held lease each third of its time to live, whatever the job's thread is
        waiting for (the engine, a slow storage read), while `healthy()`: a stalled engine
        stops renewing, so other workers take its jobs over."""
        while not stop.wait(self.ttl_ms / 3000):
            if not healthy():
                log.error("the engine has stalled: leases are not renewed")
                continue
            for job_id in list(self.held):
                try:
                    if not self.renew(job_id):
                        log.warning("job %s: its lease lapsed; another worker may run it", job_id)
                except redis.RedisError as e:
                    log.warning("heartbeat: Redis unavailable (%s); trying again", e)
                    break


def poison(record: JobRecord, max_attempts: int) -> JobError | None:
    """A job whose process in the quarantine lane, where it ran alone, died `max_attempts`
    times kills its workers by itself: fail it rather than run it again."""
    if record.quarantine_deaths < max_attempts:
        return None
    reason = f"the job killed its process {record.quarantine_deaths} times, running alone"
    return JobError(code="poison", message=reason)


def expired(record: JobRecord, max_age_s: float) -> JobError | None:
    """A job that could not finish within `max_age_s` of its acceptance, for whatever reason
    (storage or Redis away for long, no worker to take it), ends rather than waits on."""
    age = (datetime.now(UTC) - record.created_at).total_seconds()
    if age <= max_age_s:
        return None
    reason = f"the job did not finish within {max_age_s:.0f} s of its submission"
    return JobError(code="expired", message=reason)


def _job_id(raw: bytes) -> str | None:
    """The job id a queued Celery message (kombu's JSON, base64 body) carries."""
    try:
        message = json.loads(raw)
        args, _, _ = json.loads(base64.b64decode(message["body"]))
        return args[0] if message["headers"].get("task") == TASK_NAME else None
    except (ValueError, KeyError, TypeError, IndexError):
        return None


class Reconciler:
    def __init__(
        self,
        store: JobStore,
        leases: Leases,
        send: Callable[[JobRecord], None],
        stored: Callable[[JobRecord], float | None],
        stale_after_s: float,
        max_age_s: float,
        sweep: Callable[[], None] = lambda: None,  # a turn of worker.jobs.orphans.OrphanSweeper
    ):
        """stored: the duration of a job's stored result, None if there is none."""
        self.store, self.leases, self.send, self.stored = store, leases, send, stored
        self.stale_after_s, self.max_age_s = stale_after_s, max_age_s
        self.sweep = sweep

    def run_once(self) -> dict[str, int]:
        """Look at the active jobs not looked at for `stale_after_s`; counts of what was done."""
        done = {"requeued": 0, "resent": 0, "succeeded": 0, "expired": 0}
        waiting: set[str] | None = None  # read once, when first needed
        for job_id in self.store.stale(self.stale_after_s):
            record = self.store.get(job_id)
            if record is None or record.status in TERMINAL:
                self.store.redis.zrem(self.store.active, job_id)
                continue
            if self.leases.holder(job_id) is not None:
                self.store.touch(job_id)  # someone runs it
                continue
            if record.status is JobStatus.queued and self.store.is_sent(job_id):
                if waiting is None:
                    waiting = self._waiting()
                if waiting is None or job_id in waiting:
                    self.store.touch(job_id)  # its message waits in a queue
                    continue
            try:
                outcome = self._take_over(record)
            except TransitionError:
                continue  # it moved meanwhile: its mover has it
            except (BotoCoreError, ClientError) as e:  # storage away: next time
                log.warning(
                    "reconciler: job %s left for later: storage unavailable (%s)", job_id, e
                )
                continue
            done[outcome] += 1
        return done

    def _take_over(self, record: JobRecord) -> str:
        """A job nobody runs and no message waits for: end it, or send it again."""
        job_id = record.id
        if record.attempts and (duration := self.stored(record)) is not None:
            progress = Progress(done_s=duration, total_s=duration)
            self.store.transition(job_id, JobStatus.succeeded, progress=progress, error=None)
            log.warning("job %s: its result was stored; succeeded", job_id)
            return "succeeded"
        if error := expired(record, self.max_age_s):
            self.store.transition(job_id, JobStatus.failed, error=error)
            log.warning("job %s expired: %s", job_id, error.message)
            return "expired"
        if record.status is JobStatus.running:
            # its worker died (or stalled) under it: it runs again, alone
            record = self.store.transition(job_id, JobStatus.queued, quarantined=True)
            outcome = "requeued"
        else:
            self.store.touch(job_id)
            outcome = "resent"
        log.warning(
            "job %s (%s on %s) has no live worker: sent again", job_id, record.status, record.worker
        )
        self.send(record)
        return outcome

    def _waiting(self) -> set[str] | None:
        """The jobs whose message is in a queue, read from the queues themselves; None when
        they are too long to read (then a sent mark is trusted). A mark alone can outlive its
        message: a worker killed between taking a message and recording that it did leaves
        the mark, and the message in Redis's unacked set until the visibility timeout."""
        r = self.store.redis
        if sum(r.llen(q) for q in QUEUES) > AUDIT_LIMIT:
            return None
        return {_job_id(raw) for q in QUEUES for raw in r.lrange(q, 0, -1)} - {None}

    def loop(self, every_s: float, stop: threading.Event) -> None:
        """Run `run_once` every `every_s` while this worker holds the reconciler's lock."""
        lock = f"{self.leases.prefix}:reconciler"
        me, ttl_ms = self.leases.worker_id, int(every_s * 3000)
        while not stop.wait(every_s):
            try:
                r = self.store.redis
                if r.set(lock, me, nx=True, px=ttl_ms) or r.get(lock) == me.encode():
                    r.pexpire(lock, ttl_ms)
                    counts = self.run_once()
                    if any(counts.values()):
                        log.info("reconciler: %s", counts)
                    self.sweep()
            except redis.RedisError as e:
                log.warning("reconciler: Redis unavailable (%s); trying again", e)
