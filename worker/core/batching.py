"""Micro-batching: the inputs of many jobs through one engine stream per model.

It runs in the engine core (`worker.core.process`): each input the worker's job threads send is
prepared there and handed to its model's batcher, whose result goes back. The batcher's
one thread owns the stream: it submits the inputs that arrived together once `batch_size` wait
or the oldest has waited `max_wait_s` (a lone interactive job is held back no longer), and
steps the stream while any input is in it, handing each result back when its last window is
decoded. Interactive inputs are admitted ahead of bulk ones. While idle, it captures the graphs
the stream's warm-up left for later, one a turn. A job cancelled meanwhile asks its
batcher to take its input out (`Batcher.cancel`), which happens between two steps.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from engine import Stream, StreamStats, Transcription, TranscriptionOptions
from engine.inputs import Prepared
from worker import metrics
from worker.core.calls import Cancelled, EngineFailed

log = logging.getLogger(__name__)

# What to do when the GPU itself faults (a device-side assert, an illegal address): its CUDA
# context cannot be trusted. The worker's entry point decides (it ends the process); without
# one, the batcher fails the inputs in flight as for any engine error.
DeviceFaultHandler = Callable[[BaseException], None]


@dataclass(frozen=True)
class _Cancel:
    """A request, through the inbox, to take `ticket` out."""

    ticket: Ticket


@dataclass(eq=False)
class Ticket:
    """One input handed to a batcher: its result to come, and how far it has got."""

    item: Prepared
    options: TranscriptionOptions
    urgent: bool
    arrived: float = field(default_factory=time.monotonic)
    on_progress: Callable[[float, float], None] | None = None
    future: Future[Transcription] = field(default_factory=Future)
    done_s: float = 0.0
    total_s: float | None = None

    def _progress(self, done_s: float, total_s: float) -> None:
        self.done_s, self.total_s = done_s, total_s
        if self.on_progress:
            self.on_progress(done_s, total_s)


class Batcher:
    """The one thread that runs a model's stream."""

    def __init__(
        self,
        stream: Stream,
        batch_size: int,
        max_wait_s: float,
        on_device_fault: DeviceFaultHandler | None = None,
    ):
        self.stream, self.batch_size, self.max_wait_s = stream, batch_size, max_wait_s
        self.on_device_fault = on_device_fault
        self.last_tick = time.monotonic()  # the loop's last turn: a stalled engine stops here
        self._inbox: queue.SimpleQueue[Ticket | _Cancel] = queue.SimpleQueue()
        self._pending: list[Ticket] = []
        self._cancelled: list[Ticket] = []
        self._closing = False
        self._warming = True  # graphs left to capture while idle (`Stream.warm_next`)
        self._thread = threading.Thread(target=self._run, name="batcher", daemon=True)
        self._thread.start()

    def submit(
        self,
        item: Prepared,
        options: TranscriptionOptions,
        urgent: bool,
        on_progress: Callable[[float, float], None] | None = None,
    ) -> Ticket:
        """Hand an input over; on_progress: (seconds done, in all), called as windows finish."""
        ticket = Ticket(item, options, urgent, on_progress=on_progress)
        self._inbox.put(ticket)
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """Take `ticket`'s input out, from any thread: the batcher's own thread (the only one
        that touches the stream, which is not thread-safe) does it at its next turn, between
        two steps, freeing the input's slots; its future then raises Cancelled. Through the
        inbox, so that an idle batcher wakes, and a ticket is never cancelled before it arrived."""
        self._inbox.put(_Cancel(ticket))

    def close(self, wait: bool = False) -> None:
        """End the thread once the inputs it holds are done (the model is being dropped); wait:
        until it has (a process about to exit, whose daemon thread would otherwise be cut off
        inside torch)."""
        self._closing = True
        if wait:
            self._thread.join()

    def _take(self, busy: bool) -> None:
        """Move arrivals to `_pending` (and cancellations to `_cancelled`); wait for one only
        when there is nothing else to do."""
        if busy:
            timeout = 0.0
        elif self._pending:
            timeout = self._pending[0].arrived + self.max_wait_s - time.monotonic()
        else:
            timeout = 1.0  # and turn the loop (last_tick) while idle
        try:
            first = self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
            self._arrive(first)
            while True:
                self._arrive(self._inbox.get_nowait())
        except queue.Empty:
            pass

    def _arrive(self, message: Ticket | _Cancel) -> None:
        if isinstance(message, _Cancel):
            self._cancelled.append(message.ticket)
        else:
            self._pending.append(message)

    def _drop_cancelled(self) -> None:
        """Take the cancelled inputs out: a pending one is forgotten, one in the stream aborted
        (its windows leave their slots). One that finished already keeps its result."""
        while self._cancelled:
            ticket = self._cancelled.pop()
            if ticket in self._pending:
                self._pending.remove(ticket)
            else:
                self.stream.abort(ticket)
            if not ticket.future.done():
                ticket.future.set_exception(Cancelled("the input was cancelled"))

    def _ready(self) -> list[Ticket]:
        """The pending inputs, once there are enough of them or the oldest has waited enough."""
        if not self._pending:
            return []
        full = len(self._pending) >= self.batch_size
        if full or time.monotonic() - self._pending[0].arrived >= self.max_wait_s:
            ready, self._pending = self._pending, []
            return ready
        return []

    @torch.inference_mode()
    def _run(self) -> None:
        stream = self.stream
        while not (self._closing and not stream.busy and not self._pending):
            self.last_tick = time.monotonic()
            self._take(stream.busy or (self._warming and not self._pending))
            ready: list[Ticket] = []
            try:
                self._drop_cancelled()
                ready = self._ready()
                if ready:
                    metrics.BATCH.observe(len(ready))
                    for t in ready:
                        stream.submit(t, t.item, t.options, urgent=t.urgent, progress=t._progress)
                if stream.busy:
                    before, start = stream.stats, time.perf_counter()
                    finished = stream.step()
                    metrics.ENGINE_BUSY.inc(time.perf_counter() - start)
                    self._count(stream.stats - before)
                    for f in finished:
                        if f.error is not None:
                            self._fail_one(f.owner, f.error)
                            continue
                        metrics.AUDIO_SECONDS.inc(f.transcription.duration)
                        f.owner.future.set_result(f.transcription)
                elif self._warming and not self._pending:
                    self._warming = stream.warm_next()
            except Exception as e:  # noqa: BLE001 - every input in flight gets the error
                self._fail(ready, e)

    @staticmethod
    def _count(stats: StreamStats) -> None:
        metrics.ENGINE_SECONDS.labels("encoder").inc(stats.encode_s)
        metrics.ENGINE_SECONDS.labels("decoder").inc(stats.decode_s)
        metrics.WINDOWS.inc(stats.windows)

    def _fail(self, ready: list[Ticket], error: Exception) -> None:
        """Fail every input in flight with `error`; the stream starts again empty."""
        stream = self.stream
        tickets = set(stream.owners) | set(ready)
        if isinstance(error, torch.AcceleratorError) and self.on_device_fault:
            self.on_device_fault(error)  # the process decides (worker.jobs.lifecycle ends it)
        retry, oom = True, isinstance(error, torch.OutOfMemoryError)
        if oom:
            retry = stream.shrink()  # decode fewer windows at once rather than fail the jobs
            if retry:
                slots = stream.engine.n_slots
                log.warning("out of memory: %s now decodes %d windows", stream.engine.name, slots)
        else:
            log.exception("engine error; failing the %d inputs in flight", len(tickets))
            stream.reset()
        for ticket in tickets:
            if not ticket.future.done():
                ticket.future.set_exception(_failure(error, retry, oom))

    def _fail_one(self, ticket: Ticket, error: Exception) -> None:
        """One input failed alone (finding its speakers, after its windows were decoded): the
        others go on."""
        if isinstance(error, torch.AcceleratorError) and self.on_device_fault:
            self.on_device_fault(error)
        log.error("engine error in one input: %r", error, exc_info=error)
        ticket.future.set_exception(_failure(error, retry=True))


def _failure(error: Exception, retry: bool, oom: bool = False) -> EngineFailed:
    failure = EngineFailed(f"the engine failed: {error!r}", retry, oom)
    failure.__cause__ = error
    return failure
