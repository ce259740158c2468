"""Triton source of `engine.kernels.rms` (imported only where Triton is)."""

import triton
import triton.language as tl


@triton.jit
def _normed(x, w_ptr, cols, inside, D, eps, dtype):
    """RMSNorm as torch's code rounds it: normalised in fp32, rounded to the model's dtype,
    then scaled by the weight and rounded again."""
    h = (x * tl.math.rsqrt(tl.sum(x * x, axis=0) / D + eps)).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
    return (w * h).to(dtype)


@triton.jit
def add_rms_kernel(
    x_ptr, y_ptr, w_ptr, s_ptr, h_ptr, D, eps, HAS_Y: tl.constexpr, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64) * D
    cols = tl.arange(0, BLOCK)
    inside = cols < D
    dtype = h_ptr.dtype.element_ty
    x = tl.load(x_ptr + row + cols, mask=inside, other=0.0).to(tl.float32)
    if HAS_Y:
        y = tl.load(y_ptr + row + cols, mask=inside, other=0.0).to(tl.float32)
        x = (x + y).to(dtype)  # rounded as torch's add writes it
        tl.store(s_ptr + row + cols, x, mask=inside)
        x = x.to(tl.float32)
    tl.store(h_ptr + row + cols, _normed(x, w_ptr, cols, inside, D, eps, dtype), mask=inside)


@triton.jit
def norm_rope_kernel(
    x_ptr,  # (rows, heads, D) at strides (stride_r, D, 1)
    w_ptr,
    cos_ptr,  # (rows, D), contiguous
    sin_ptr,
    out_ptr,  # (rows, heads, D) at strides (stride_o, D, 1): x itself, or another
    stride_r,
    stride_o,
    heads,
    eps,
    D: tl.constexpr,
):
    r = tl.program_id(0) // heads
    h = tl.program_id(0) % heads
    half = tl.arange(0, D // 2)
    src = x_ptr + r.to(tl.int64) * stride_r + h * D
    dtype = out_ptr.dtype.element_ty
    x1 = tl.load(src + half).to(tl.float32)
    x2 = tl.load(src + D // 2 + half).to(tl.float32)
    scale = tl.math.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
    w1 = tl.load(w_ptr + half).to(tl.float32)
    w2 = tl.load(w_ptr + D // 2 + half).to(tl.float32)
    n1 = (w1 * (x1 * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    n2 = (w2 * (x2 * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    c1 = tl.load(cos_ptr + r * D + half).to(tl.float32)
    c2 = tl.load(cos_ptr + r * D + D // 2 + half).to(tl.float32)
    s1 = tl.load(sin_ptr + r * D + half).to(tl.float32)
    s2 = tl.load(sin_ptr + r * D + D // 2 + half).to(tl.float32)
    # x * cos + cat(-x2, x1) * sin, each product and the sum rounded as torch's
    o1 = (n1 * c1).to(dtype).to(tl.float32) + (-n2 * s1).to(dtype).to(tl.float32)
    o2 = (n2 * c2).to(dtype).to(tl.float32) + (n1 * s2).to(dtype).to(tl.float32)
    dst = out_ptr + r.to(tl.int64) * stride_o + h * D
    tl.store(dst + half, o1.to(dtype))
    tl.store(dst + D // 2 + half, o2.to(dtype))


@triton.jit
def silu_mul_kernel(x_ptr, out_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = cols < N
    dtype = out_ptr.dtype.element_ty
    g = tl.load(x_ptr + row * 2 * N + cols, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * 2 * N + N + cols, mask=inside, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * N + cols, (silu * u).to(dtype), mask=inside)
