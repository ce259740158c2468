"""The engine core: a process of its own that holds the models and runs their batchers, so
that the engine's loop never waits for the worker's Python (Celery's consumer, the job
threads reading and storing, Redis) to hand over one interpreter lock. Sharing one, a worker
ran at half the pace of its engine alone (issue 15).

The worker process spawns it (never forks: CUDA breaks in a forked child) and talks to it over
one pipe. A job's thread reads its input (`engine.host.read_input`: audio decoded by libsndfile or
FFmpeg, which let go of the interpreter lock while they work, so the job threads decode in
parallel; a spectrogram only loaded) and sends the samples; the core prepares them on the
device, batches them with the other jobs' and sends back the result, the input's progress as
its windows finish, and once a second its health and the engine's metrics. Models load and
warm (`Stream.warm`) in the core: a worker loads its default model before it takes a message.

One core can also serve several job processes (`whisperfleet worker --processes N`): the
process that spawned it (the owner) lets it listen on a Unix socket, and job processes connect
there with a key, each with its own calls, so that Celery, boto3 and the job threads are spread
over N interpreter locks while the GPU's batches stay whole.

The fault contract (docs/reliability.md) holds across them: a GPU fault ends the core (exit
70), and a worker whose core ended unasked ends too (exit 70), its jobs taken over by lease.
When the owner dies (kill -9) its end of the pipe closes; the core reads that and exits, so no
process is left holding the GPU, and the job processes connected to it end with it. A job
process that dies only takes its own inputs out of the batches.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import os
import pickle
import queue
import secrets
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from multiprocessing.connection import AuthenticationError, Client, Connection, Listener
from typing import TYPE_CHECKING

from worker import logs, metrics
from worker.contract.jobs import QUEUES
from worker.contract.options import JobOptions
from worker.contract.results import TranscriptResult
from worker.contract.settings import Settings
from worker.core.calls import Cancelled, EngineFailed, single_flight
from worker.core.transcripts import engine_options, transcript

if TYPE_CHECKING:  # torch is imported only in the core: a worker spawns its core before it
    # imports anything heavy, so the two start together, and its job processes never import it
    from engine import Transcription, TranscriptionOptions
    from engine.host import Host
    from worker.core.batching import Batcher, Ticket

log = logging.getLogger(__name__)

CUDA_FAULT_EXIT = 70  # the exit status after a GPU fault (the core's, then its worker's)
REPORT_EVERY_S = 1.0  # the core's health and metrics, sent this often
PREPARERS = 4  # core threads moving inputs to the device (long audio: its first pass)
CONNECT_WAIT_S = 60.0  # how long a job process waits for a shared core's socket to appear


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
                super().run()  # which closes its end of the pipe as it ends
            except BaseException:
                conn.close()  # the worker's side then sees the core gone
                raise

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


SHARED_ENV = "WHISPERFLEET_ENGINE_CORE"  # a shared core's socket and key, for its job processes


def shared_core() -> tuple[str, bytes] | None:
    """The shared engine core this process is to use (`whisperfleet worker --processes`
    sets it for its job processes), else None: the process spawns its own."""
    address, _, key = os.environ.get(SHARED_ENV, "").partition(" ")
    return (address, bytes.fromhex(key)) if address else None


class EngineCore:
    """The worker process's side of its engine core, shared by the job threads. The core
    starts on first use; it is started again if it ended while the worker did not (after
    `on_exit`, if that returns).

    The core is this process's own (spawned here), or one it shares with other job processes
    (`connect`: the core of `whisperfleet worker --processes`, which one process spawned with
    `listen` and the others connect to). Only the spawning process's end stops the core."""

    def __init__(
        self,
        settings: Settings,
        slots: int | None = None,
        on_exit: Callable[[int | None], None] | None = None,
        context: multiprocessing.context.BaseContext | None = None,
        listen: bool = False,
        connect: tuple[str, bytes] | None = None,
    ):
        """slots: each model's pool of decoding slots (default: as the settings size it).
        on_exit: called with the core's exit status when it ends unasked (default: its
        inputs in flight fail with EngineFailed, and the next call starts a new core).
        context: where the core runs (default: a spawned process; `InProcess`: threads here).
        listen: the core also serves job processes, at `address` with `authkey`.
        connect: (address, authkey) of a shared core to use instead of spawning one."""
        self.settings, self.slots, self.on_exit = settings, slots, on_exit
        self.context = context or multiprocessing.get_context("spawn")
        self.connect = connect
        self.address = self.authkey = None
        if listen:  # a socket in a folder of its own that only this user may enter
            self._folder = tempfile.TemporaryDirectory(prefix="whisperfleet-core-")
            self.address = os.path.join(self._folder.name, "core.sock")
            self.authkey = secrets.token_bytes(32)
        self._lock = threading.Lock()  # the process and the pipe
        self._send_lock = threading.Lock()
        self._process: multiprocessing.process.BaseProcess | None = None
        self._conn: Connection | None = None
        self._calls: dict[int, Call] = {}
        self._loads: dict[str, Future[None]] = {}
        self._ids = itertools.count()
        self._reported = (time.monotonic(), True)  # when the core last reported, and health
        self._closing = False
        self.job_processes = 0  # connected to this (listening) core, and warm

    @property
    def shared(self) -> str:
        """What a job process is given (`SHARED_ENV`) to use this core."""
        return f"{self.address} {self.authkey.hex()}"

    # --- the process -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the core now, not on first use: its imports and warm-up then run beside
        whatever else the worker starts."""
        self._started()

    def _started(self) -> Connection:
        with self._lock:
            if self._conn is None:  # not started, or ended and its inputs failed
                mine, process = self._connect() if self.connect else self._spawn()
                self._process, self._conn, self._reported = process, mine, (time.monotonic(), True)
                threading.Thread(
                    target=self._receive, args=(mine, process), name="core-receiver", daemon=True
                ).start()
            return self._conn

    def _spawn(self) -> tuple[Connection, multiprocessing.process.BaseProcess]:
        mine, theirs = self.context.Pipe()
        listen = (self.address, self.authkey) if self.address else None
        process = self.context.Process(
            target=serve,
            args=(theirs, self.settings, self.slots, listen),
            name="engine-core",
            daemon=True,
        )
        process.start()
        if not isinstance(process, threading.Thread):  # InProcess shares the end
            theirs.close()  # the core's end: its death then reads as the pipe's end
        metrics.core_report([])  # a new core counts from zero, once it reports
        return mine, process

    def _connect(self) -> tuple[Connection, None]:
        """The shared core; a job process starts beside it, so its socket may not be there
        yet for a while (the core's imports)."""
        deadline = time.monotonic() + CONNECT_WAIT_S
        while True:
            try:
                return Client(self.connect[0], "AF_UNIX", authkey=self.connect[1]), None
            except (FileNotFoundError, ConnectionRefusedError) as e:
                if time.monotonic() > deadline:
                    raise EngineFailed("the engine core is not running", retry=True) from e
                time.sleep(0.1)
            except (OSError, AuthenticationError) as e:
                raise EngineFailed("the engine core is not running", retry=True) from e

    def _send(self, message: tuple) -> None:
        conn = self._started()
        try:
            with self._send_lock:
                conn.send(message)
        except OSError as e:  # it ended (the receiver fails what was in flight)
            raise EngineFailed("the engine core is not running", retry=True) from e

    def _receive(
        self, conn: Connection, process: multiprocessing.process.BaseProcess | None
    ) -> None:
        while True:
            try:
                batch = conn.recv()
            except (EOFError, OSError):
                break
            for message in batch:
                self._dispatch(message)
        conn.close()
        code = None
        if process is not None:
            process.join(timeout=5)
            code = process.exitcode
        gone = EngineFailed(f"the engine core ended (exit {code})", retry=True)
        for call in list(self._calls.values()):
            if not call.future.done():
                call.future.set_exception(gone)
        with self._lock:
            loads, self._loads = self._loads, {}
        for loading in loads.values():
            if not loading.done():
                loading.set_exception(gone)
        with self._lock:
            if self._conn is conn:  # the next call starts a new one
                self._process = self._conn = None
        if not self._closing and self.on_exit:
            self.on_exit(code)

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
            case ("job processes", warm):
                self.job_processes = warm
            case ("report", healthy, snapshot):
                self._reported = (time.monotonic(), healthy)
                if snapshot is not None:  # the engine's metrics go to the spawning process
                    metrics.core_report(snapshot)

    def close(self) -> None:
        """Stop using the core (the worker is stopping); a core this process spawned ends.
        The core's side closes the pipe, which ends the receiving thread; closing ours under
        that thread would break its read."""
        self._closing = True
        with self._lock:
            process, conn = self._process, self._conn
            self._process = self._conn = None
        if conn is not None:
            try:
                with self._send_lock:
                    conn.send(("stop",))
            except OSError:
                pass  # it has ended already
        if process is not None:
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
        how long a cancelled job keeps its slots, so it is short: the worker's `on_wait`
        only reads what its process's last look found (`worker.jobs.looks`)."""
        from engine.host import read_input  # numpy and soundfile: not before the core spawns

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


@dataclass(eq=False)
class _Client:
    """A process at one end of a connection to the core: what the core sends it waits in its
    outbox, sent by a thread of its own, so that a slow reader stalls no other."""

    conn: Connection
    warm: bool = False  # it has loaded a model: a job process then takes jobs
    outbox: queue.SimpleQueue[tuple | None] = field(default_factory=queue.SimpleQueue)

    def send(self) -> None:
        """Send what the outbox holds, all that is there at once in one message, until None."""
        while True:
            batch = [self.outbox.get()]
            try:
                while True:
                    batch.append(self.outbox.get_nowait())
            except queue.Empty:
                pass
            last = None in batch
            try:
                if messages := [m for m in batch if m is not None]:
                    self.conn.send(messages)
            except OSError:  # it is gone: its receiving loop sees that too
                return
            if last:
                self.conn.close()
                return


Key = tuple[_Client, int]  # a call, by the client that sent it and the client's id for it


class _Core:
    """The core process's state: the models, the inputs in them, and the processes it serves."""

    def __init__(self, settings: Settings, slots: int | None, conn: Connection):
        """conn: the owner's end (the process that spawned the core): its end closing ends
        the core, and its reports carry the engine's metrics."""
        from worker.core.engines import Engines

        self.engines = Engines(settings, on_device_fault=exit_on_device_fault, slots=slots)
        self.preparers = ThreadPoolExecutor(PREPARERS, thread_name_prefix="prepare")
        self._lock = threading.Lock()
        self._clients: list[_Client] = []
        self._tickets: dict[Key, tuple[Batcher, Ticket]] = {}
        self._preparing: dict[Key, bool] = {}  # not yet at a batcher: whether cancelled
        self.gone = threading.Event()  # the owner's end of the pipe closed
        self.owner = self.connect(conn)

    def connect(self, conn: Connection) -> _Client:
        client = _Client(conn)
        with self._lock:
            self._clients.append(client)
        threading.Thread(target=client.send, name="core-sender", daemon=True).start()
        return client

    def receive(self, client: _Client) -> None:
        """Serve `client`'s messages until it stops or its end closes."""
        while True:
            try:
                message = client.conn.recv()
            except (EOFError, OSError):  # its process died
                message = ("stop",)
            match message:
                case ("load", name):
                    self.preparers.submit(self.load, client, name)
                case ("submit", call_id, name, host, options, urgent):
                    self.submit((client, call_id), name, host, options, urgent)
                case ("cancel", call_id):
                    self.cancel((client, call_id))
                case ("stop",):
                    return self.drop(client)

    def drop(self, client: _Client) -> None:
        """Forget a client that stopped: what it had in flight leaves the batches (a job
        process killed under its jobs: they are run again elsewhere, by lease)."""
        with self._lock:
            self._clients.remove(client)
            keys = [k for k in (*self._tickets, *self._preparing) if k[0] is client]
        for key in keys:
            self.cancel(key)
        client.outbox.put(None)
        if client.warm:
            self._tell_owner()

    def _tell_owner(self) -> None:
        """How many job processes take jobs now: the owner's readiness waits for them."""
        with self._lock:
            warm = sum(c.warm for c in self._clients if c is not self.owner)
        self.owner.outbox.put(("job processes", warm))

    def _tell(self, key: Key, *message: object) -> None:
        key[0].outbox.put((message[0], key[1], *message[1:]))

    def load(self, client: _Client, name: str) -> None:
        try:
            self.engines.batcher(name)
            client.outbox.put(("loaded", name, None))
            if not client.warm:
                client.warm = True
                self._tell_owner()
        except Exception as e:  # noqa: BLE001 - the worker decides what a failed load means
            log.exception("model %s failed to load", name)
            client.outbox.put(("loaded", name, _sendable(e)))

    def submit(
        self, key: Key, name: str, host: Host, options: TranscriptionOptions, urgent: bool
    ) -> None:
        """Prepare the input on the device and hand it to its model's batcher, on a preparing
        thread (a long file's first pass takes a while)."""
        with self._lock:
            self._preparing[key] = False
        self.preparers.submit(self._prepare, key, name, host, options, urgent)

    def _prepare(
        self, key: Key, name: str, host: Host, options: TranscriptionOptions, urgent: bool
    ) -> None:
        try:
            batcher = self.engines.batcher(name)
            checked = batcher.stream.check(options)
            prepared = batcher.stream.prepare(host, checked)
        except Exception as e:  # noqa: BLE001 - the input's error is its job's
            with self._lock:
                del self._preparing[key]
            self._tell(key, "failed", _sendable(e))
            return

        def progress(done_s: float, total_s: float) -> None:
            self._tell(key, "progress", done_s, total_s)

        ticket = batcher.submit(prepared, checked, urgent, progress)
        with self._lock:
            self._tickets[key] = (batcher, ticket)
            if self._preparing.pop(key):  # cancelled meanwhile
                batcher.cancel(ticket)
        ticket.future.add_done_callback(lambda f: self._finished(key, f))

    def _finished(self, key: Key, future: Future[Transcription]) -> None:
        with self._lock:
            self._tickets.pop(key, None)
        error = future.exception()
        if error is None:
            self._tell(key, "done", future.result())
        elif not isinstance(error, Cancelled):  # a cancelled call's worker has stopped asking
            self._tell(key, "failed", _sendable(error))

    def cancel(self, key: Key) -> None:
        with self._lock:
            held = self._tickets.get(key)
            if held is not None:
                held[0].cancel(held[1])
            elif key in self._preparing:
                self._preparing[key] = True  # at the batcher, it is taken out
            # else it ended already: nothing to take out

    def report(self) -> None:
        """Every client's heartbeat (whether every batcher turns); the owner's also carries
        the engine's metrics, so that they are served once however many processes ask."""
        while not self.gone.wait(REPORT_EVERY_S):
            healthy = self.engines.healthy()
            with self._lock:
                clients = list(self._clients)
            for client in clients:
                snapshot = metrics.engine_snapshot() if client is self.owner else None
                client.outbox.put(("report", healthy, snapshot))

    def accept(self, listener: Listener) -> None:
        """Serve each job process that connects (`whisperfleet worker --processes`)."""
        while True:
            try:
                conn = listener.accept()
            except AuthenticationError:
                log.warning("engine core: a connection without the key was refused")
                continue
            except OSError:  # closed
                return
            client = self.connect(conn)
            threading.Thread(
                target=self.receive, args=(client,), name="core-receiver", daemon=True
            ).start()


def serve(
    conn: Connection,
    settings: Settings,
    slots: int | None,
    listen: tuple[str, bytes] | None = None,
) -> None:
    """The engine core process: serve the worker at the other end of `conn` (its owner) until
    it stops, and with `listen` (a Unix socket's address, its key) the job processes that
    connect there too."""
    logs.configure(settings.log_format)
    core = _Core(settings, slots, conn)
    threading.Thread(target=core.report, name="core-report", daemon=True).start()
    if listen is not None:  # listening before the owner hears of any load: no connect races it
        listener = Listener(listen[0], "AF_UNIX", authkey=listen[1])
        threading.Thread(target=core.accept, args=(listener,), daemon=True).start()
    core.receive(core.owner)  # until the owner stops or dies: nothing is left to do
    if threading.current_thread() is not threading.main_thread():
        core.gone.set()
        return  # a core in the worker's own process (InProcess)
    os._exit(0)  # now: not after the threads that may be loading a model
