"""The engine core: a process of its own that holds the models and runs their batchers, so
that the engine's loop never waits for the worker's Python (Celery's consumer, the job
threads reading and storing, Redis) to hand over one interpreter lock. Sharing one, a worker
ran at half the pace of its engine alone (issue 15).

The worker process spawns it (never forks: CUDA breaks in a forked child) and talks to it over
one pipe. A job's thread reads its input (`engine.read_input`: audio decoded by libsndfile or
FFmpeg, which let go of the interpreter lock while they work, so the job threads decode in
parallel; a spectrogram only loaded) and sends the samples; the core prepares them on the
device, batches them with the other jobs' and sends back the result, the input's progress as
its windows finish, and once a second its health and the engine's metrics. Models load and
warm (every graph captured, `Stream.warm`) in the core: a worker loads its default model
before it takes a message.

The fault contract (docs/reliability.md) holds across the two: a GPU fault ends the core
(exit 70), and a worker whose core ended unasked ends too (exit 70), its jobs taken over by
lease. A worker that dies (kill -9) closes its end of the pipe; the core reads that and exits,
so no process is left holding the GPU.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from engine import Transcription, TranscriptionOptions
from engine.inputs import Host, read_input
from worker import logs, metrics
from worker.batching import Batcher, Cancelled, EngineFailed, Ticket
from worker.contract.jobs import QUEUES
from worker.contract.options import JobOptions
from worker.contract.results import TranscriptResult
from worker.contract.settings import Settings
from worker.engines import Engines, engine_options, single_flight, transcript

log = logging.getLogger(__name__)

CUDA_FAULT_EXIT = 70  # the exit status after a GPU fault (the core's, then its worker's)
REPORT_EVERY_S = 1.0  # the core's health and metrics, sent this often
PREPARERS = 4  # core threads moving inputs to the device (long audio: its first pass)


def exit_on_device_fault(error: BaseException) -> None:
    """End the process at once: nothing more can be trusted to the GPU, not even an answer
    to the jobs in flight (they are taken over when their leases lapse)."""
    log.critical("engine fault on the GPU, exiting: %r", error, exc_info=error)
    logging.shutdown()
    os._exit(CUDA_FAULT_EXIT)


def exit_with_core(code: int | None) -> None:
    """End the worker whose engine core ended unasked (a GPU fault ends it with 70; a kill,
    the OOM killer): its jobs are taken over by lease, a supervisor starts a new worker."""
    log.critical("the engine core ended (exit %s); the worker ends too", code)
    logging.shutdown()
    os._exit(CUDA_FAULT_EXIT)


class InProcess:
    """multiprocessing's context with the engine core on threads of this process, for a
    process that is the unit of isolation itself (the quarantine lane: a daemon process,
    which may have no children), and for tests where a monkeypatch must reach the core."""

    Pipe = staticmethod(multiprocessing.Pipe)

    class Process(threading.Thread):
        exitcode = None

        def run(self) -> None:
            conn = self._args[0]  # Thread.run forgets its arguments
            try:
                super().run()
            finally:  # its end of the pipe: the worker's side then sees the core gone
                conn.close()

        def kill(self) -> None:
            """Nothing to kill: the core's loop ends at the end of its pipe."""


@dataclass(eq=False)
class Call:
    """One input sent to the core: its result to come, and how far it has got."""

    id: int
    arrived: float = field(default_factory=time.monotonic)
    future: Future[Transcription] = field(default_factory=Future)
    done_s: float = 0.0
    total_s: float | None = None


class EngineCore:
    """The worker process's side of its engine core, shared by the job threads. The core
    starts on first use; it is started again if it ended while the worker did not (after
    `on_exit`, if that returns)."""

    def __init__(
        self,
        settings: Settings,
        slots: int | None = None,
        on_exit: Callable[[int | None], None] | None = None,
        context: multiprocessing.context.BaseContext | None = None,
    ):
        """slots: each model's pool of decoding slots (default: as the settings size it).
        on_exit: called with the core's exit status when it ends unasked (default: its
        inputs in flight fail with EngineFailed, and the next call starts a new core).
        context: where the core runs (default: a spawned process; `InProcess`: threads here)."""
        self.settings, self.slots, self.on_exit = settings, slots, on_exit
        self.context = context or multiprocessing.get_context("spawn")
        self._lock = threading.Lock()  # the process and the pipe
        self._send_lock = threading.Lock()
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._calls: dict[int, Call] = {}
        self._loads: dict[str, Future[None]] = {}
        self._ids = itertools.count()
        self._reported = (time.monotonic(), True)  # when the core last reported, and health
        self._closing = False

    # --- the process -------------------------------------------------------------------------

    def _started(self) -> Connection:
        with self._lock:
            if self._process is None:  # not started, or ended and its inputs failed
                mine, theirs = self.context.Pipe()
                process = self.context.Process(
                    target=serve,
                    args=(theirs, self.settings, self.slots),
                    name="engine-core",
                    daemon=True,
                )
                process.start()
                if not isinstance(process, threading.Thread):  # InProcess shares the end
                    theirs.close()  # the core's end: its death then reads as the pipe's end
                self._process, self._conn, self._reported = process, mine, (time.monotonic(), True)
                metrics.core_report([])  # a new core counts from zero, once it reports
                threading.Thread(
                    target=self._receive, args=(mine, process), name="core-receiver", daemon=True
                ).start()
            return self._conn

    def _send(self, message: tuple) -> None:
        conn = self._started()
        try:
            with self._send_lock:
                conn.send(message)
        except OSError as e:  # it ended (the receiver fails what was in flight)
            raise EngineFailed("the engine core is not running", retry=True) from e

    def _receive(self, conn: Connection, process: multiprocessing.process.BaseProcess) -> None:
        while True:
            try:
                batch = conn.recv()
            except (EOFError, OSError):
                break
            for message in batch:
                self._dispatch(message)
        conn.close()
        process.join(timeout=5)
        gone = EngineFailed(f"the engine core ended (exit {process.exitcode})", retry=True)
        for call in list(self._calls.values()):
            if not call.future.done():
                call.future.set_exception(gone)
        with self._lock:
            loads, self._loads = self._loads, {}
        for loading in loads.values():
            if not loading.done():
                loading.set_exception(gone)
        with self._lock:
            if self._process is process:  # the next call starts a new one
                self._process = None
        if not self._closing and self.on_exit:
            self.on_exit(process.exitcode)

    def _dispatch(self, message: tuple) -> None:
        match message:
            case ("progress", call_id, done_s, total_s):
                if call := self._calls.get(call_id):
                    call.done_s, call.total_s = done_s, total_s
            case ("done", call_id, transcription):
                if call := self._calls.pop(call_id, None):
                    call.future.set_result(transcription)
            case ("failed", call_id, error):
                if call := self._calls.pop(call_id, None):
                    call.future.set_exception(error)
            case ("loaded", name, error):
                with self._lock:
                    loading = self._loads.pop(name, None)
                if loading is not None and error is None:
                    loading.set_result(None)
                elif loading is not None:
                    loading.set_exception(error)
            case ("report", healthy, snapshot):
                self._reported = (time.monotonic(), healthy)
                metrics.core_report(snapshot)

    def close(self) -> None:
        """End the core (the worker is stopping). Its end of the pipe then closes, which ends
        the receiving thread; closing ours under that thread would break its read."""
        self._closing = True
        with self._lock:
            process, conn, self._process = self._process, self._conn, None
        if process is not None:
            try:
                with self._send_lock:
                    conn.send(("stop",))
            except OSError:
                pass  # it has ended already
            process.join(timeout=10)
            if process.is_alive():
                process.kill()

    # --- what the worker asks ---------------------------------------------------------------

    def load(self, name: str) -> None:
        """Load and warm model `name` in the core, if it is not yet; wait until it is ready.
        Raises UnknownModel for a model the settings do not name."""
        with self._lock:
            loading, mine = single_flight(self._loads, name)
        if mine:
            self._send(("load", name))
        loading.result()

    def healthy(self, stall_s: float = 60.0) -> bool:
        """Whether the core reported within `stall_s`, saying every batcher turns its loop."""
        at, healthy = self._reported
        return healthy and time.monotonic() - at < stall_s

    def transcribe(
        self,
        name: str,
        data: bytes,
        options: JobOptions,
        urgent: bool = True,
        on_wait: Callable[[Call], bool | None] | None = None,
        wait_s: float = 0.5,
    ) -> TranscriptResult:
        """Decode `data` on this thread, transcribe it in the core among the other jobs'
        inputs, and call `on_wait` every `wait_s` seconds meanwhile (to record progress). When
        it answers True the job was cancelled: its input leaves the stream at the batcher's
        next turn (its slots freed for the others) and Cancelled is raised. `wait_s` bounds
        how long a cancelled job keeps its slots, so it is short: the look is one Redis read."""
        priority = QUEUES[0] if urgent else QUEUES[-1]  # the metrics' label
        asked = engine_options(options, data)
        with metrics.stage("decode", priority):
            host = read_input(data, self.settings.max_audio_s)
        while True:
            call = Call(next(self._ids))
            self._calls[call.id] = call
            try:
                self._send(("submit", call.id, name, host, asked, urgent))
                while True:
                    try:
                        transcription = call.future.result(timeout=wait_s)
                        metrics.JOB_STAGE.labels("engine", priority).observe(
                            time.monotonic() - call.arrived
                        )
                        return transcript(transcription, options)
                    except FutureTimeout:
                        if on_wait and on_wait(call):
                            raise Cancelled("the job was cancelled") from None
            except EngineFailed as e:
                self._calls.pop(call.id, None)
                if not (e.retry and e.oom):  # out of memory: the pool was halved, run it again
                    raise
            except BaseException:
                if self._calls.pop(call.id, None) is not None:  # given up on: slots freed
                    self._send(("cancel", call.id))
                raise


# --- the core process --------------------------------------------------------------------------


def _sendable(error: BaseException) -> BaseException:
    """The error as the worker can receive it: its own (the input's errors, EngineFailed), or
    only its type and words when it does not pickle."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any error must reach the job
        return RuntimeError(f"{type(error).__name__}: {error}")


class _Core:
    """The core process's state: the models, the inputs in them, and the outbox."""

    def __init__(self, settings: Settings, slots: int | None):
        self.engines = Engines(settings, on_device_fault=exit_on_device_fault, slots=slots)
        self.outbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self.preparers = ThreadPoolExecutor(PREPARERS, thread_name_prefix="prepare")
        self._lock = threading.Lock()
        self._tickets: dict[int, tuple[Batcher, Ticket]] = {}
        self._preparing: dict[int, bool] = {}  # not yet at a batcher: whether cancelled
        self.gone = threading.Event()  # the worker's end of the pipe closed

    def load(self, name: str) -> None:
        try:
            self.engines.batcher(name)
            self.outbox.put(("loaded", name, None))
        except Exception as e:  # noqa: BLE001 - the worker decides what a failed load means
            log.exception("model %s failed to load", name)
            self.outbox.put(("loaded", name, _sendable(e)))

    def submit(
        self, call_id: int, name: str, host: Host, options: TranscriptionOptions, urgent: bool
    ) -> None:
        """Prepare the input on the device and hand it to its model's batcher, on a preparing
        thread (a long file's first pass takes a while)."""
        with self._lock:
            self._preparing[call_id] = False
        self.preparers.submit(self._prepare, call_id, name, host, options, urgent)

    def _prepare(
        self, call_id: int, name: str, host: Host, options: TranscriptionOptions, urgent: bool
    ) -> None:
        try:
            batcher = self.engines.batcher(name)
            checked = batcher.stream.check(options)
            prepared = batcher.stream.prepare(host)
        except Exception as e:  # noqa: BLE001 - the input's error is its job's
            with self._lock:
                del self._preparing[call_id]
            self.outbox.put(("failed", call_id, _sendable(e)))
            return

        def progress(done_s: float, total_s: float) -> None:
            self.outbox.put(("progress", call_id, done_s, total_s))

        ticket = batcher.submit(prepared, checked, urgent, progress)
        with self._lock:
            self._tickets[call_id] = (batcher, ticket)
            if self._preparing.pop(call_id):  # cancelled meanwhile
                batcher.cancel(ticket)
        ticket.future.add_done_callback(lambda f: self._finished(call_id, f))

    def _finished(self, call_id: int, future: Future[Transcription]) -> None:
        with self._lock:
            self._tickets.pop(call_id, None)
        error = future.exception()
        if error is None:
            self.outbox.put(("done", call_id, future.result()))
        elif not isinstance(error, Cancelled):  # a cancelled call's worker has stopped asking
            self.outbox.put(("failed", call_id, _sendable(error)))

    def cancel(self, call_id: int) -> None:
        with self._lock:
            held = self._tickets.get(call_id)
            if held is not None:
                held[0].cancel(held[1])
            elif call_id in self._preparing:
                self._preparing[call_id] = True  # at the batcher, it is taken out
            # else it ended already: nothing to take out

    def report(self) -> None:
        while not self.gone.wait(REPORT_EVERY_S):
            self.outbox.put(("report", self.engines.healthy(), metrics.engine_snapshot()))

    def send(self, conn: Connection) -> None:
        """Send what the outbox holds, all that is there at once in one message."""
        while True:
            batch = [self.outbox.get()]
            try:
                while True:
                    batch.append(self.outbox.get_nowait())
            except queue.Empty:
                pass
            try:
                conn.send(batch)
            except OSError:  # the worker is gone: the receiving loop ends the core
                self.gone.set()
                return


def serve(conn: Connection, settings: Settings, slots: int | None) -> None:
    """The engine core process: serve the worker at the other end of `conn` until it stops."""
    logs.configure(settings.log_format)
    core = _Core(settings, slots)
    for target, args in ((core.send, (conn,)), (core.report, ())):
        threading.Thread(target=target, args=args, daemon=True).start()
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the worker died
            message = ("stop",)
        match message:
            case ("load", name):
                core.preparers.submit(core.load, name)
            case ("submit", call_id, name, host, options, urgent):
                core.submit(call_id, name, host, options, urgent)
            case ("cancel", call_id):
                core.cancel(call_id)
            case ("stop",):  # nothing left to do
                if threading.current_thread() is not threading.main_thread():
                    core.gone.set()
                    return  # a core in the worker's own process (InProcess)
                os._exit(0)  # now: not after the threads that may be loading a model
