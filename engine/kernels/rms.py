"""Qwen3's element-wise work in a decode step, a kernel each: RMSNorm (with the residual add
before it), the per-head RMSNorm and rotary embedding of queries and keys, and SiLU's gate.

A Qwen3 decoder layer written as torch ops is some 50 kernels a step: an RMSNorm alone is
seven (a cast, a square, a mean, an add, a reciprocal root, two products), a rotation five.
Each takes a few microseconds whatever the batch, and replayed from a CUDA graph they still
run one after another: a 0.6B step at batch 1 took 4 ms for its 28 layers, where reading its
1.2 GB of weights takes 0.4 (H100, 2026-12-06). Here each is one kernel that reads its input
once and rounds where torch's ops round (to the model's dtype after each op), so its results
are torch's but for the order of a sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm as Qwen3 writes it: normalised in fp32, then scaled in x's dtype."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotated(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary embedding, the halves rotated (x: (..., heads, d); cos, sin: (..., 1, d))."""
    half = x.shape[-1] // 2
    turned = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + turned * sin


def add_rms_norm(
    x: Tensor, y: Tensor | None, weight: Tensor, eps: float, triton: bool = False
) -> tuple[Tensor, Tensor]:
    """(s, rms_norm(s)), s = x + y (x itself when y is None).

    x, y: shape = (..., d), contiguous
    triton: one Triton kernel (on CUDA), else torch's ops
    """
    if triton and x.is_cuda:
        return triton_add_rms_norm(x, y, weight, eps)
    s = x if y is None else x + y
    return s, rms_norm(s, weight, eps)


def norm_rope(
    x: Tensor,
    weight: Tensor,
    eps: float,
    cos: Tensor,
    sin: Tensor,
    out: Tensor,
    triton: bool = False,
) -> Tensor:
    """Each head's RMSNorm, then its rotary embedding, written to `out` (which may be x
    itself): Qwen3's queries and keys.

    x, out: shape = (rows, heads, d), each head's d contiguous and the heads side by side
        (views of a fused projection are fine)
    cos, sin: shape = (rows, d)
    """
    if triton and x.is_cuda:
        return triton_norm_rope(x, weight, eps, cos, sin, out)
    return out.copy_(rotated(rms_norm(x, weight, eps), cos.unsqueeze(-2), sin.unsqueeze(-2)))


def silu_mul(x: Tensor, triton: bool = False) -> Tensor:
    """silu(gate) * up, x the gate and up projections side by side: (..., 2n) -> (..., n)."""
    if triton and x.is_cuda:
        return triton_silu_mul(x)
    n = x.shape[-1] // 2
    return F.silu(x[..., :n]) * x[..., n:]


def triton_add_rms_norm(
    x: Tensor, y: Tensor | None, weight: Tensor, eps: float
) -> tuple[Tensor, Tensor]:
    import triton

    from engine.kernels._rms import add_rms_kernel

    d = x.shape[-1]
    if not x.is_contiguous() or (y is not None and not y.is_contiguous()):
        raise ValueError("add_rms_norm takes contiguous rows")
    s = x if y is None else torch.empty_like(x)
    h = torch.empty_like(x)
    block = triton.next_power_of_2(d)
    add_rms_kernel[(x.numel() // d,)](
        x, x if y is None else y, weight, s, h, d, eps,
        HAS_Y=y is not None, BLOCK=block, num_warps=8 if block >= 2048 else 4,
    )  # fmt: skip
    return s, h


def triton_norm_rope(
    x: Tensor, weight: Tensor, eps: float, cos: Tensor, sin: Tensor, out: Tensor
) -> Tensor:
    from engine.kernels._rms import norm_rope_kernel

    rows, heads, d = x.shape
    for t in (x, out):
        if t.stride(2) != 1 or t.stride(1) != d:
            raise ValueError("norm_rope takes heads of contiguous values, side by side")
    if not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("norm_rope takes contiguous cos and sin")
    norm_rope_kernel[(rows * heads,)](
        x, weight, cos, sin, out, x.stride(0), out.stride(0), heads, eps, D=d
    )  # fmt: skip
    return out


def triton_silu_mul(x: Tensor) -> Tensor:
    from engine.kernels._rms import silu_mul_kernel

    if not x.is_contiguous():
        raise ValueError("silu_mul takes contiguous rows")
    n = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], n, device=x.device, dtype=x.dtype)
    block = 1024
    silu_mul_kernel[(x.numel() // (2 * n), -(-n // block))](x, out, n, BLOCK=block)
    return out
