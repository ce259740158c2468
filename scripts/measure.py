"""One way to time and summarise a benchmark's runs, and the clips they read: the same clock,
the same median and range, for the engine's benchmarks and the stacks' (scripts/harness.py)
alike. Nothing here needs more than the engine's own dependencies, so that the engine's
benchmarks run on a GPU machine without the stack's.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from pathlib import Path

from tqdm import tqdm


def timed(run, runs: int, desc: str | None = None) -> tuple[object, list[float]]:
    """`run()` `runs` times: the last run's result and every run's seconds (`desc`: with a
    progress bar of that name)."""
    result, seconds = None, []
    for _ in tqdm(range(runs), desc=desc, disable=desc is None):
        start = time.perf_counter()
        result = run()
        seconds.append(time.perf_counter() - start)
    return result, seconds


@contextlib.contextmanager
def gc_pauses():
    """Python's garbage collections while in it, as (generation, seconds) pairs: a full
    collection stops every thread of the process, the stepping thread's too."""
    pauses, started = [], []

    def record(phase, info):
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            pauses.append((info["generation"], time.perf_counter() - started.pop()))

    gc.callbacks.append(record)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(record)


def spread(values: list[float], digits: int = 2, form: str = "{median} ({low}–{high})") -> str:
    """The median and range of `values` to `digits`, as `form` writes them (each table keeps
    its own brackets and dash); "—" for none."""
    if not values:
        return "—"
    median, low, high = (
        f"{v:.{digits}f}" for v in (statistics.median(values), min(values), max(values))
    )
    return form.format(median=median, low=low, high=high)


def percentile(values: list[float], q: float) -> float:
    """Linear between the closest ranks (numpy's default); NaN for none."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    pos = (len(ordered) - 1) * q / 100
    low = int(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def read_clips(audio_dir: Path) -> list[tuple[bytes, float]]:
    """The manifest's clips of up to 30 s: (bytes, seconds)."""
    from tools.evaluate import read_manifest  # torch: not for the stacks' benchmarks

    found = read_manifest(audio_dir / "manifest.jsonl")
    return [(c.path.read_bytes(), c.seconds) for c in found if c.seconds <= 30]
