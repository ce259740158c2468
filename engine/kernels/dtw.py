"""Dynamic time warping for word timestamps: the cheapest monotonic path through each window's
token-by-frame cost, with openai-whisper's recurrence and tie-breaking.

On the host a token's row is a few array operations (`trace_of`): 2 to 3 ms for a window of
100 tokens by 1,500 frames on one core, paid in the stream's stepping thread while the GPU
waits, for every window whose words are timed. On CUDA with Triton one kernel searches all the
windows of an alignment pass at once, a program a window stepping along the anti-diagonals
(openai-whisper's `dtw_kernel`, batched), and another walks each path back on the device
(on the host, the walk took as long as the search: a Python step a cell of the path).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

# the search's lanes at least: a window's text is up to 224 tokens, so four sizes of the
# kernel serve every pass (each size a compile the first time a process meets it)
MIN_BLOCK = 32


def host_paths(costs: np.ndarray, spans: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """The cheapest path through each window's (tokens, frames) cost matrix, as (token
    indices, frame indices) in order, with numpy's rows. costs: (windows, rows, frames), every
    window's matrix padded to the longest; spans: (windows, 3), each window's first row, rows
    and frames."""
    return [dtw(costs[b, f : f + n, :m]) for b, (f, n, m) in enumerate(spans.tolist())]


def dtw(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return backtrace(trace_of(x))


def trace_of(x: np.ndarray) -> np.ndarray:
    """(n + 1, m + 1) int8: where each cell's cheapest path comes from (0: diagonal, 1: up, 2:
    left). Within a row, cost[i, j] = x[i, j] + min(cost[i-1, j-1], cost[i-1, j], cost[i, j-1])
    unrolls into a running minimum over prefix sums, so each row is a few array operations."""
    n, m = x.shape
    cost = np.full((n + 1, m + 1), np.inf)
    cost[0, 0] = 0.0
    trace = np.full((n + 1, m + 1), 2, dtype=np.int8)
    for i in range(1, n + 1):
        above = cost[i - 1]
        diagonal_or_up = np.minimum(above[:-1], above[1:])
        sums = np.concatenate(([0.0], np.cumsum(x[i - 1])))
        cost[i, 1:] = np.minimum.accumulate(diagonal_or_up - sums[:-1]) + sums[1:]
        c0, c1, c2 = above[:-1], above[1:], cost[i, :-1]
        trace[i, 1:] = np.where((c0 < c1) & (c0 < c2), 0, np.where((c1 < c0) & (c1 < c2), 1, 2))
    return trace


def backtrace(trace: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The path walked back from the last cell of `trace` (changed: its edges are set)."""
    trace[:, 0] = 1
    trace[0, :] = 2
    i, j = trace.shape[0] - 1, trace.shape[1] - 1
    path = []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        step = trace[i, j]
        i, j = (i - 1, j - 1) if step == 0 else (i - 1, j) if step == 1 else (i, j - 1)
    tokens, frames = np.array(path[::-1]).T
    return tokens, frames


def search(costs: Tensor, spans: Tensor) -> tuple[Tensor, Tensor]:
    """`host_paths` on one CUDA device, launched and not waited for: the search in one kernel,
    in float64 as on the host, and the walk back in another. Returns (walked, lengths) on the
    device, for `walked_back`. The kernels read the sizes on the device, so the buffers are
    the padded costs' (what the host knows without waiting)."""
    import triton

    from engine.kernels._dtw import backtrace_kernel, dtw_kernel

    windows, most_tokens, most_frames = costs.shape
    diagonals = most_tokens + most_frames
    device, costs = costs.device, costs.contiguous()
    spans = spans.to(device=device, dtype=torch.int32).contiguous()
    shape = (windows, diagonals + 2, most_tokens + 2)
    cost = torch.full(shape, float("inf"), dtype=torch.float64, device=device)
    cost[:, 0, 0] = 0.0
    trace = torch.full(shape, 2, dtype=torch.int8, device=device)
    grid = (windows,)
    block = max(MIN_BLOCK, triton.next_power_of_2(most_tokens))
    dtw_kernel[grid](
        cost, trace, costs, spans, costs.stride(0), costs.stride(1), cost.stride(0),
        cost.stride(1), block,
    )  # fmt: skip
    walked = torch.empty(windows, diagonals, 2, dtype=torch.int32, device=device)
    lengths = torch.empty(windows, dtype=torch.int32, device=device)
    backtrace_kernel[grid](
        trace, walked, lengths, spans, trace.stride(0), trace.stride(1), walked.stride(0)
    )
    return walked, lengths


def walked_back(walked: np.ndarray, lengths: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """The paths of `search`, read back: each in order from its first cell."""
    return [tuple(walked[b, :k][::-1].T.astype(np.int64)) for b, k in enumerate(lengths.tolist())]
