"""Python's collector beside a running engine.

A full collection walks every object the collector tracks, and stops every thread while it
does: torch, transformers and a loaded model are some 230,000 of them, which took 130 ms on a
CPU here and 150–230 ms on an H100's host (2026-12-07), once or twice each 2-second run of
word timestamps, whose words outlive the young generations. Those objects live as long as the
process, so once a model is loaded and warmed they are frozen (`gc.freeze`, as vLLM does after
its warm-up): moved to the permanent generation, which collections leave alone (a full one then
took 10–34 ms on that host, docs/benchmarks.md, thirteenth round). Objects frozen
are still freed when nothing refers to them; only a cycle among them would never be, so what
is dropped for good is handed back: a model's objects (`thaw`), and a slot pool halved after
running out of device memory (collected at once, `settle`).
"""

from __future__ import annotations

import gc


def settle() -> int:
    """Collect what is garbage now, then freeze every object still alive; returns how many
    are frozen. One full collection's pause (a fifth of a second): for when a model is
    warmed or a slot pool given up, not between decode steps."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw() -> None:
    """Hand every frozen object back to the collector (a model dropped: its cycles must be
    collectable); the next `settle` freezes what is alive then."""
    gc.unfreeze()
