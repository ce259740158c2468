"""Triton source of `engine.kernels.dtw` (imported only where Triton is)."""

import triton
import triton.language as tl


# sizes and strides change with every pass: specialised on them (divisible by 16 or not, one
# or not), each new combination was a compile of about 0.1 s in the decode loop's thread
@triton.jit(do_not_specialize=["X_BATCH", "X_ROW", "C_BATCH", "C_ROW"])
def dtw_kernel(
    cost_ptr, trace_ptr, x_ptr, spans_ptr, X_BATCH, X_ROW, C_BATCH, C_ROW, BLOCK: tl.constexpr
):
    """One window a program, its matrix read in place from the pass's (windows, rows, frames)
    costs: rows from its first, as many as its tokens. Each step reads an anti-diagonal of
    it; cost and trace are skewed (cell (i + 1, k - i) at [k + 1, i + 1]), so each step reads
    two of their rows and writes the next."""
    b = tl.program_id(0)
    first = tl.load(spans_ptr + 3 * b)
    n_tokens = tl.load(spans_ptr + 3 * b + 1)
    n_frames = tl.load(spans_ptr + 3 * b + 2)
    cost_ptr += b.to(tl.int64) * C_BATCH
    trace_ptr += b.to(tl.int64) * C_BATCH
    x_ptr += b.to(tl.int64) * X_BATCH + first * X_ROW
    i = tl.arange(0, BLOCK)
    inside = i < n_tokens
    for k in range(1, n_frames + n_tokens + 1):
        tl.debug_barrier()  # the row written last step is read whole by this one
        diagonal = tl.load(cost_ptr + (k - 1) * C_ROW + i, mask=inside)
        up = tl.load(cost_ptr + k * C_ROW + i, mask=inside)
        left = tl.load(cost_ptr + k * C_ROW + i + 1, mask=inside)
        j = k - 1 - i  # each token's frame on this anti-diagonal; off the matrix, no path
        cell = inside & (j >= 0) & (j < n_frames)
        x = tl.load(x_ptr + i * X_ROW + j, mask=cell, other=float("inf")).to(tl.float64)
        best = tl.minimum(tl.minimum(diagonal, up), left)
        tl.store(cost_ptr + (k + 1) * C_ROW + i + 1, x + best, mask=inside)
        step = tl.where(
            (diagonal < up) & (diagonal < left), 0, tl.where((up < diagonal) & (up < left), 1, 2)
        )
        tl.store(trace_ptr + (k + 1) * C_ROW + i + 1, step.to(tl.int8), mask=inside)


@triton.jit(do_not_specialize=["C_BATCH", "C_ROW", "P_BATCH"])
def backtrace_kernel(trace_ptr, path_ptr, length_ptr, spans_ptr, C_BATCH, C_ROW, P_BATCH):
    """One window a program: the path walked back from its last cell through the skewed
    trace, (token, frame) pairs from the end; the walk's length to `length_ptr`."""
    b = tl.program_id(0)
    i = tl.load(spans_ptr + 3 * b + 1)
    j = tl.load(spans_ptr + 3 * b + 2)
    trace_ptr += b.to(tl.int64) * C_BATCH
    path_ptr += b.to(tl.int64) * P_BATCH
    steps = 0
    while (i > 0) | (j > 0):
        step = tl.load(trace_ptr + (i + j) * C_ROW + i).to(tl.int32)
        step = tl.where(j == 0, 1, tl.where(i == 0, 2, step))  # the edges: up, left
        tl.store(path_ptr + 2 * steps, i - 1)
        tl.store(path_ptr + 2 * steps + 1, j - 1)
        i = tl.where(step == 2, i, i - 1)
        j = tl.where(step == 1, j, j - 1)
        steps += 1
    tl.store(length_ptr + b, steps)
