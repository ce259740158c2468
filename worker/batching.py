"""Micro-batching: the inputs of many jobs through one engine stream per model.

Celery's threads pool runs each job on a thread of its own: it reads the input, decodes it
there (CPU work, many at once) and hands it to the model's batcher, then waits. The batcher's
one thread owns the engine: it starts the inputs that arrived together once `batch_size` wait
or the oldest has waited `max_wait_s` (a lone interactive job is held back no longer), and
runs decode steps while any input is live, handing each result back when its last window is
decoded. Interactive inputs are admitted ahead of bulk ones.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from engine.inputs import Prepared
from engine.longform import TranscriptionOptions
from engine.result import Transcription
from engine.transcribe import Stream, Submission, Transcriber
from worker import metrics

log = logging.getLogger(__name__)

CUDA_FAULT_EXIT = 70  # the process's exit status after a CUDA fault; its supervisor restarts it


def _device_fault(error: Exception) -> bool:
    """An error of the GPU itself (a device-side assert, an illegal address, a failed CUDA or
    library call), after which its context cannot be trusted; not running out of memory."""
    if isinstance(error, torch.OutOfMemoryError):
        return False
    if isinstance(error, getattr(torch, "AcceleratorError", ())):
        return True
    words = ("CUDA error", "CUBLAS_STATUS", "CUDNN_STATUS", "device-side assert")
    return isinstance(error, RuntimeError) and any(w in str(error) for w in words)


class EngineFailed(RuntimeError):
    """The engine failed while this input was in flight; the input itself may be fine.
    `retry`: whether running it again can succeed (false: out of memory at one slot)."""

    def __init__(self, message: str, retry: bool):
        super().__init__(message)
        self.retry = retry


@dataclass(eq=False)
class Ticket:
    """One input handed to a batcher: its result to come, and how far it has got."""

    item: Prepared
    options: TranscriptionOptions
    urgent: bool
    arrived: float = field(default_factory=time.monotonic)
    future: Future[Transcription] = field(default_factory=Future)
    done_s: float = 0.0
    total_s: float | None = None

    def _progress(self, done_s: float, total_s: float) -> None:
        self.done_s, self.total_s = done_s, total_s


class Batcher:
    """The one thread that runs a model's engine."""

    def __init__(self, transcriber: Transcriber, batch_size: int, max_wait_s: float):
        self.transcriber, self.batch_size, self.max_wait_s = transcriber, batch_size, max_wait_s
        self.last_tick = time.monotonic()  # the loop's last turn: a stalled engine stops here
        self._inbox: queue.SimpleQueue[Ticket] = queue.SimpleQueue()
        self._pending: list[Ticket] = []
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="batcher", daemon=True)
        self._thread.start()

    def submit(self, item: Prepared, options: TranscriptionOptions, urgent: bool) -> Ticket:
        ticket = Ticket(item, options, urgent)
        self._inbox.put(ticket)
        return ticket

    def close(self) -> None:
        """End the thread once the inputs it holds are done (the model is being dropped)."""
        self._closing = True

    def _take(self, busy: bool) -> None:
        """Move arrivals to `_pending`; wait for one only when there is nothing else to do."""
        if busy:
            timeout = 0.0
        elif self._pending:
            timeout = self._pending[0].arrived + self.max_wait_s - time.monotonic()
        else:
            timeout = 1.0  # and turn the loop (last_tick) while idle
        try:
            first = self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
            self._pending.append(first)
            while True:
                self._pending.append(self._inbox.get_nowait())
        except queue.Empty:
            pass

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
        stream = self.transcriber.stream()
        while not (self._closing and not stream.busy and not self._pending):
            self.last_tick = time.monotonic()
            self._take(stream.busy)
            ready: list[Ticket] = []
            try:
                ready = self._ready()
                if ready:
                    metrics.BATCH.observe(len(ready))
                    stream.add(
                        [Submission(t, t.item, t.options, t.urgent, t._progress) for t in ready]
                    )
                if stream.busy:
                    before = dict(stream.stats)
                    finished = stream.step()
                    self._count(before, stream.stats)
                    for ticket, result in finished:
                        metrics.AUDIO_SECONDS.inc(result.duration)
                        ticket.future.set_result(result)
            except Exception as e:  # noqa: BLE001 - every input in flight gets the error
                stream = self._fail(stream, ready, e)

    @staticmethod
    def _count(before: dict, after: dict) -> None:
        metrics.ENGINE_SECONDS.labels("encoder").inc(after["encode_s"] - before["encode_s"])
        metrics.ENGINE_SECONDS.labels("decoder").inc(after["decode_s"] - before["decode_s"])
        metrics.WINDOWS.inc(after["windows"] - before["windows"])

    def _fail(self, stream: Stream, ready: list[Ticket], error: Exception) -> Stream:
        """Fail every input in flight with `error` and start a fresh stream."""
        t = self.transcriber
        if _device_fault(error):
            # the CUDA context may be unusable: end the process; its supervisor starts a new
            # one and the jobs in flight are taken over when their leases lapse
            log.critical("engine fault on the GPU, exiting: %r", error, exc_info=error)
            logging.shutdown()
            os._exit(CUDA_FAULT_EXIT)
        retry = True
        if isinstance(error, torch.OutOfMemoryError):
            retry = t.n_slots > 1
            if retry:
                t.shrink()  # decode fewer windows at once rather than fail the jobs
                log.warning("out of memory: %s now decodes %d windows", t.loaded.name, t.n_slots)
        else:
            log.exception("engine error; failing the %d inputs in flight", len(stream.live))
        tickets = {s.owner for s in stream.live} | set(ready)
        stream.sched.reset()
        for ticket in tickets:
            if not ticket.future.done():
                failure = EngineFailed(f"the engine failed: {error!r}", retry)
                failure.__cause__ = error
                ticket.future.set_exception(failure)
        return t.stream()
