"""CUDA graph capture, one way for every function the engine captures (engine.runner's Whisper
steps, engine.qwen3_asr's decode step).

Captures run on a stream of torch's high-priority pool, one at a time on each device. Work
anywhere else on the GPU runs on streams of the default-priority pool (`torch.cuda.Stream()`,
as `engine.inputs.own_stream` takes them for first passes and diarization), which torch hands
out in turn to every thread that asks. A capture on one of those would, sooner or later, share
its stream with another thread's first pass: that pass's kernels would be recorded into the
graph instead of running (its log-mel and voice activity never computed), and run again at
every replay, on memory long since reused (seen on an H100, 2026-12-07: no job's text right,
0 of 32, while job threads' first passes ran beside the batcher's captures).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

_streams: dict[torch.device, torch.cuda.Stream] = {}
_locks: dict[torch.device, threading.Lock] = {}
_guard = threading.Lock()


def _capture_stream(device: torch.device) -> tuple[torch.cuda.Stream, threading.Lock]:
    with _guard:
        if device not in _streams:
            _streams[device] = torch.cuda.Stream(device, priority=-1)
            _locks[device] = threading.Lock()
        return _streams[device], _locks[device]


def capture(fn: Callable[[], None], pool: tuple | None) -> torch.cuda.CUDAGraph:
    """`fn` captured into a graph drawing on `pool` (None: a new one; the graph's `pool()`
    serves the next capture). `fn` first runs once for real, so that lazy initialisation and
    kernel compiles happen outside the capture. Other threads may use the GPU meanwhile (a
    worker's engine core takes a first pass over long audio on threads of its own), so only
    this thread's own unsafe calls may break the capture ("thread_local")."""
    device = torch.device("cuda", torch.cuda.current_device())
    stream, lock = _capture_stream(device)
    with lock:
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        # torch.cuda.graph() would also empty the allocator's cache before each capture: the
        # next warm-up then allocates from the device again, which made capturing every shape
        # at start take seconds
        with torch.cuda.stream(stream):
            fn()
            graph.capture_begin(pool=pool, capture_error_mode="thread_local")
            try:
                fn()
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
    return graph
