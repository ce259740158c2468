"""CUDA graph capture, one way for every function the engine captures (engine.runner's Whisper
steps, engine.qwen3_asr's decode step)."""

from __future__ import annotations

from collections.abc import Callable

import torch


def capture(
    fn: Callable[[], None], pool: tuple | None, stream: torch.cuda.Stream
) -> torch.cuda.CUDAGraph:
    """`fn` captured on `stream` into a graph drawing on `pool` (None: a new one; the graph's
    `pool()` serves the next capture). `fn` first runs once for real, so that lazy
    initialisation and kernel compiles happen outside the capture. Other threads may use the
    GPU meanwhile (a worker's engine core takes a first pass over long audio on threads of its
    own), so only this thread's own unsafe calls may break the capture ("thread_local")."""
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    # torch.cuda.graph() would also empty the allocator's cache before each capture: the next
    # warm-up then allocates from the device again, which made capturing every shape at start
    # take seconds
    with torch.cuda.stream(stream):
        fn()
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    return graph
