"""The quarantine lane: a job whose worker died under it runs again alone, in a process of its
own, so that a death there is evidence against the job.

A worker killed under a batch (by an operator, the OOM killer, a GPU fault, another job)
cannot say which job killed it, and counting starts would fail good jobs whose workers died
around them. So a start that never ended sends a job here. Each worker process keeps one
quarantine process, spawned on first use (forking after CUDA is initialised breaks CUDA),
which runs quarantined jobs one at a time through an engine of one slot (its core on a
thread of that process: `worker.core.process.InProcess`). If it dies running a
job, that job killed it: the task counts the death (`JobRecord.quarantine_deaths`) and fails
the job as poison at `MAX_ATTEMPTS`. If the worker itself dies, its quarantine process ends
too (it watches its parent) and nothing is counted: that death is unexplained again. A job
cancelled while it runs there is stopped by killing its process: the worker looks at its
record every half second meanwhile, and a suspect job's process may not be answering.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection

import redis

from worker.contract.jobs import JobRecord, JobStore
from worker.contract.settings import Settings, get_settings
from worker.jobs.execute import TRANSIENT, JobCancelled, JobFailed, Stored, execute

log = logging.getLogger(__name__)


class Died(RuntimeError):
    """The quarantine process died running the job."""


class Unavailable(RuntimeError):
    """The quarantine process could not run the job now (storage, Redis or the engine away)."""


class Quarantine:
    """The worker process's side of its quarantine process."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self._lock = threading.Lock()  # one job at a time: alone is the point
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None

    def _start(self) -> None:
        context = multiprocessing.get_context("spawn")
        self._conn, theirs = context.Pipe()
        self._process = context.Process(
            target=serve, args=(theirs, os.getpid()), name="quarantine", daemon=True
        )
        self._process.start()
        theirs.close()

    def run(self, record: JobRecord, cancelled: Callable[[], bool] = lambda: False) -> Stored:
        """Run the job alone. Raises JobFailed (it cannot succeed), Unavailable (try again
        later), Died (the process died running it) or JobCancelled (`cancelled()`, asked
        every half second, said so: the process is killed, a new one takes the next job)."""
        with self._lock:
            if self._process is None or not self._process.is_alive():
                self._start()
            try:
                self._conn.send(record.id)
            except OSError:  # it died idle, after the look above: a new one takes the job
                self._start()
                self._conn.send(record.id)
            while not self._conn.poll(0.5):
                if not self._process.is_alive():
                    break
                if cancelled():
                    self._process.kill()
                    self._process.join()
                    self._process = None
                    self._conn.close()
                    raise JobCancelled(record.id)
            try:
                outcome = self._conn.recv()
            except (EOFError, OSError):
                code = self._process.exitcode
                self._process = None
                raise Died(f"the quarantine process died (exit {code})") from None
        match outcome:
            case ("stored", duration):
                return Stored(duration=duration, result_key=record.result_key)
            case ("cancelled",):  # it saw the cancel first
                raise JobCancelled(record.id)
            case ("failed", code, message):
                raise JobFailed(code, message)
            case ("unavailable", message):
                raise Unavailable(message)
        raise RuntimeError(f"unexpected answer from the quarantine process: {outcome!r}")


def _watch(parent: int) -> None:
    """End this process when the worker that started it is gone (killed: no one else will)."""
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(0)


def serve(conn: Connection, parent: int) -> None:
    """The quarantine process: run the jobs the worker sends, one at a time, with one slot."""
    from worker import logs
    from worker.core.process import EngineCore, InProcess, exit_with_core
    from worker.jobs.looks import Looks
    from worker.storage import Storage

    threading.Thread(target=_watch, args=(parent,), daemon=True).start()
    settings = get_settings()
    logs.configure(settings.log_format)
    store = JobStore(redis.Redis.from_url(settings.redis_url))
    storage, looks = Storage(settings), Looks(store)
    threading.Thread(target=looks.loop, args=(threading.Event(),), daemon=True).start()
    # its core on this process's threads: a daemon process may have no children
    engines = EngineCore(settings, slots=1, on_exit=exit_with_core, context=InProcess)
    while True:
        try:
            job_id = conn.recv()
            conn.send(_run(job_id, store, storage, engines, looks))
        except (EOFError, OSError):  # the worker is gone: so is this process's purpose
            return


def _run(job_id: str, store: JobStore, storage, engines, looks) -> tuple:
    """One job, alone: its outcome as the worker reads it."""
    from worker.logs import current_job

    current_job.set(job_id)
    try:
        record = store.get(job_id)
        if record is None:
            raise JobFailed("not_found", "the job's record is gone")
        return ("stored", execute(record, store, storage, engines, looks).duration)
    except JobFailed as e:
        return ("failed", *e.args)
    except JobCancelled:
        return ("cancelled",)
    except TRANSIENT as e:
        log.warning("job %s: transient error in quarantine: %s", job_id, e)
        return ("unavailable", f"{type(e).__name__}")
    except Exception:  # a bug, not the input's fault
        log.exception("job %s: unexpected error in quarantine", job_id)
        return ("failed", "internal", "the worker failed on this job")
