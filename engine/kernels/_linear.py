"""Triton source of `engine.kernels.linear` (imported only where Triton is)."""

import triton
import triton.language as tl


@triton.jit
def linear_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    gamma_ptr,
    beta_ptr,
    r_ptr,
    y_ptr,
    partial_ptr,
    ticket_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_rm,
    stride_ym,
    eps,
    k_chunk,
    NORM: tl.constexpr,
    BIAS: tl.constexpr,
    GELU: tl.constexpr,
    RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_in, col_in = rows < M, cols < N
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm
    w_cols = w_ptr + cols[:, None].to(tl.int64) * K
    if NORM:  # the layer norm's statistics in two passes over the rows (they stay in cache)
        total = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            inside = row_in[:, None] & (k0 + ks < K)[None, :]
            total += tl.sum(tl.load(x_rows + k0 + ks[None, :], mask=inside, other=0.0), axis=1)
        mean = total / K
        spread = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            inside = row_in[:, None] & (k0 + ks < K)[None, :]
            x = tl.load(x_rows + k0 + ks[None, :], mask=inside, other=0.0).to(tl.float32)
            centred = tl.where(inside, x - mean[:, None], 0.0)
            spread += tl.sum(centred * centred, axis=1)
        rstd = 1.0 / tl.sqrt(spread / K + eps)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    first = tl.program_id(2) * k_chunk  # this program's share of the inputs
    for k0 in range(first, tl.minimum(first + k_chunk, K), BLOCK_K):
        k_in = k0 + ks < K
        x = tl.load(x_rows + k0 + ks[None, :], mask=row_in[:, None] & k_in[None, :], other=0.0)
        if NORM:
            gamma = tl.load(gamma_ptr + k0 + ks, mask=k_in, other=0.0).to(tl.float32)
            beta = tl.load(beta_ptr + k0 + ks, mask=k_in, other=0.0).to(tl.float32)
            x = (x.to(tl.float32) - mean[:, None]) * rstd[:, None] * gamma[None, :] + beta[None, :]
            x = x.to(w_ptr.dtype.element_ty)
        w = tl.load(w_cols + k0 + ks[None, :], mask=col_in[:, None] & k_in[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    inside = row_in[:, None] & col_in[None, :]
    last = True  # this program finishes its block of outputs
    if SPLIT > 1:  # each share into its own partial sums; the last program to finish adds
        # them in a fixed order (the same sums whatever order the programs ran in)
        share = rows[:, None] * N + cols[None, :]
        tl.store(partial_ptr + tl.program_id(2) * BLOCK_M * N + share, acc, mask=inside)
        tl.debug_barrier()  # every thread's share written before the arrival is counted
        last = tl.atomic_add(ticket_ptr + tl.program_id(0), 1) == SPLIT - 1  # acq_rel
        if last:
            tl.debug_barrier()
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for part in tl.static_range(SPLIT):
                acc += tl.load(
                    partial_ptr + part * BLOCK_M * N + share,
                    mask=inside,
                    other=0.0,
                    cache_modifier=".cg",
                )
            tl.store(ticket_ptr + tl.program_id(0), 0)  # as found, for the next call
    if last:  # bias, activation and residual, then the only write of the outputs
        if BIAS:
            acc += tl.load(b_ptr + cols, mask=col_in, other=0.0).to(tl.float32)[None, :]
        if GELU:  # erf GELU, as Whisper's
            acc = 0.5 * acc * (1.0 + tl.math.erf(acc * 0.7071067811865476))
        if RESIDUAL:
            r_rows = r_ptr + rows[:, None].to(tl.int64) * stride_rm
            acc += tl.load(r_rows + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        y_rows = y_ptr + rows[:, None].to(tl.int64) * stride_ym
        tl.store(y_rows + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=inside)
