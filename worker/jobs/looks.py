"""A job process's looks at the records of the jobs it runs: one read of them all every
LOOK_EVERY_S, and their progress written together every PROGRESS_EVERY_S, instead of a read
per job every half second and a transaction per job for its progress (4.6 Redis commands a
running job-second: docs/benchmarks.md, "One Redis for a fleet"). A job's thread learns from
the last look that its job was cancelled, so it stops within LOOK_EVERY_S and its own wait.
Redis being away stops no job: the looks go on when it is back."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import redis

from worker.contract.jobs import JobRecord, JobStatus, JobStore, Progress

if TYPE_CHECKING:
    from worker.core.process import Call

log = logging.getLogger(__name__)

LOOK_EVERY_S = 0.25  # and a job's thread asks as often: a cancel shows within half a second
PROGRESS_EVERY_S = 2.0  # keeps the job's place among the reconciler's active jobs fresh too


def cancelled(record: JobRecord | None) -> bool:
    """Whether this record (None: gone) says its job must stop and leave nothing behind."""
    return record is None or record.status is JobStatus.cancelled


class Looks:
    """The process's running jobs, looked at by one thread (`loop`), or by `look` calls."""

    def __init__(
        self,
        store: JobStore,
        every_s: float = LOOK_EVERY_S,
        progress_every_s: float = PROGRESS_EVERY_S,
    ):
        self.store, self.every_s, self.progress_every_s = store, every_s, progress_every_s
        self._lock = threading.Lock()
        self._progress: dict[str, Progress | None] = {}  # running here: its last known progress
        self._cancelled: set[str] = set()  # of those, found cancelled or gone
        self._failing = False  # the last look failed

    @contextmanager
    def running(self, job_id: str) -> Iterator[Callable[[Call], bool]]:
        """While the job runs in this process: looked at with the others. Yields its `on_wait`
        for `EngineCore.transcribe`: takes the call's progress (`done_s`, `total_s`) for the
        next write, and answers whether a look found the job cancelled."""
        with self._lock:
            self._progress[job_id] = None

        def on_wait(call: Call) -> bool:
            self._progress[job_id] = Progress(done_s=call.done_s, total_s=call.total_s)
            return job_id in self._cancelled

        try:
            yield on_wait
        finally:
            with self._lock:
                self._progress.pop(job_id, None)
                self._cancelled.discard(job_id)

    def look(self, write_progress: bool = False) -> None:
        """Read every running job's record in one round trip; with `write_progress`, write
        the progress of those still running in one call (a record that moved meanwhile, to
        `cancelled` say, keeps its move)."""
        with self._lock:
            progress = dict(self._progress)
        if not progress:
            return
        seen = dict(zip(progress, self.store.read_many(list(progress)), strict=True))
        gone = {job_id for job_id, read in seen.items() if cancelled(read and read.record)}
        with self._lock:
            self._cancelled.update(gone & self._progress.keys())
        if write_progress:
            running = {
                job_id: progress[job_id]
                for job_id, read in seen.items()
                if read and read.record.status is JobStatus.running and progress[job_id]
            }
            self.store.set_progress_many(seen, running)

    def loop(self, stop: threading.Event) -> None:
        """Look every `every_s` (and write progress every `progress_every_s`) until `stop`."""
        written = time.monotonic()
        while not stop.wait(self.every_s):
            write = time.monotonic() - written >= self.progress_every_s
            try:
                self.look(write_progress=write)
            except Exception as e:  # noqa: BLE001 - Redis away (or a bug) stops no job
                if not self._failing:
                    bug = not isinstance(e, redis.RedisError)
                    log.warning("running jobs not looked at (%s); they go on", e, exc_info=bug)
                self._failing = True
                continue
            if self._failing:
                log.info("running jobs looked at again")
            self._failing = False
            if write:
                written = time.monotonic()
