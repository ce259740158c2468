"""Triton source of `engine.kernels.dense` (imported only where Triton is)."""

import triton
import triton.language as tl


@triton.jit
def bn_relu_linear_kernel(
    x_ptr,
    scale_ptr,
    shift_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    N,
    K,
    X_ROW,
    HAS_BIAS: tl.constexpr,
    RELU: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """A (BLOCK_M, BLOCK_N) block of act(relu(x * scale + shift) @ w.T + bias): each block of
    x normalised and rectified as it is loaded, before the product."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        inside = (rows[:, None] < M) & (ks[None, :] < K)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * X_ROW + ks[None, :], mask=inside)
        scale = tl.load(scale_ptr + ks, mask=ks < K)
        shift = tl.load(shift_ptr + ks, mask=ks < K)
        x = tl.maximum(x.to(tl.float32) * scale[None, :] + shift[None, :], 0.0)
        x = tl.where(inside, x, 0.0).to(w_ptr.dtype.element_ty)
        w = tl.load(
            w_ptr + cols[None, :] * K + ks[:, None], mask=(cols[None, :] < N) & (ks[:, None] < K)
        )
        if IEEE:  # fp32 products in fp32, not tf32
            acc = tl.dot(x, w, acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cols < N)[None, :]
    if RELU:
        acc = tl.maximum(acc, 0.0)
    out = out_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def gated_conv_kernel(
    h_ptr,
    w_ptr,
    gate_ptr,
    out_ptr,
    M,
    T,
    SEGMENTS,
    SEGMENT,
    DILATION,
    OUT_ROW,
    K: tl.constexpr,
    N: tl.constexpr,
    TAPS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """BLOCK_M frames of conv1d(h, w, dilation, same padding) * gate: each tap a product of
    the frames DILATION apart (zeros past either end of each window's T frames), the gate of
    each frame's segment applied before the only write."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    t = rows % T
    cols = tl.arange(0, N)
    acc = tl.zeros((BLOCK_M, N), dtype=tl.float32)
    for tap in tl.static_range(TAPS):
        shift = (tap - TAPS // 2) * DILATION
        inside = (rows < M) & (t + shift >= 0) & (t + shift < T)
        for k0 in tl.static_range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            src = (rows + shift).to(tl.int64)[:, None] * K + ks[None, :]
            x = tl.load(h_ptr + src, mask=inside[:, None], other=0.0)
            w = tl.load(w_ptr + cols[None, :] * (TAPS * K) + tap * K + ks[:, None])
            acc = tl.dot(x, w, acc)
    segment = (rows // T) * SEGMENTS + t // SEGMENT
    gate = tl.load(gate_ptr + segment[:, None] * N + cols[None, :], mask=rows[:, None] < M)
    out = out_ptr + rows.to(tl.int64)[:, None] * OUT_ROW + cols[None, :]
    tl.store(out, (acc * gate.to(tl.float32)).to(out_ptr.dtype.element_ty), mask=rows[:, None] < M)
