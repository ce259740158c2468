"""A linear layer for the few rows of a small decode step, with its neighbours fused in.

At batch 1 a decoder layer was some 20 kernels of 2-5 us each, most of them tiny: a layer
norm before each projection, a residual add after each output projection, a GELU between the
MLP's two. And cuBLAS's kernels for a handful of rows stream the weights at about 30 % of the
bandwidth (H200 profile of large-v3 at batch 1, 2026-12-02). The Triton kernel here computes
`residual + act(layer_norm(x) @ W.T + b)` in one pass: each program normalises the rows it
needs (their statistics first, from cache), streams its block of W once, and adds bias,
activation and residual before its only write.

Measured on an H200 (scripts/tune_kernels.py --linear, 2026-12-02), each against torch's
unfused kernels: tiny's projections (384 wide) took 2.9-5.2 us instead of 4.7-8.0 at 1 to 32
rows; large-v3's 1280 x 1280 output projections 4.5-5.0 us instead of 5.9-6.7. Its larger
weights (1280 x 3840 to 5120 x 1280) streamed at 0.9-1.5 TB/s either way, cuBLAS ahead from 4
rows (and for 5120 inputs from one), so weights above `MAX_WEIGHT` elements stay with cuBLAS,
as do more than `MAX_ROWS` rows. Neither reads at the copy bandwidth (4.2 TB/s): a split over
the inputs would.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.kernels import ceil_div

MAX_ROWS = 16  # the Triton kernel for up to this many rows; one block of rows
MAX_WEIGHT = 1 << 21  # and weights of up to this many elements
BLOCK_N = 16  # outputs per program
BLOCK_K = 256  # inputs per loop iteration
WARPS = 4
STAGES = 3


def fused_linear(
    x: Tensor,
    linear: nn.Linear,
    norm: nn.LayerNorm | None = None,
    gelu: bool = False,
    residual: Tensor | None = None,
    triton: bool = False,
) -> Tensor:
    """`residual + act(linear(norm(x)))`, each part optional.

    x: shape = (..., in_features); residual: shape = (..., out_features)
    gelu: apply erf GELU after the bias
    triton: the fused kernel where it pays (on CUDA, fp16, up to MAX_ROWS rows and MAX_WEIGHT
        weights). bf16 stays on torch's path: through the kernel, tiny.en's bf16 WER on the
        dev clips moved 0.36 points from fp32's (lower, yet past the real-weight check's
        0.3), and Triton's interpreter cannot check bf16 products on CPUs
    """
    rows = x.numel() // x.shape[-1]
    small = rows <= MAX_ROWS and linear.weight.numel() <= MAX_WEIGHT
    if triton and small and x.is_cuda and x.dtype == torch.float16:
        return triton_linear(x, linear.weight, linear.bias, norm, gelu, residual)
    return torch_linear(x, linear.weight, linear.bias, norm, gelu, residual)


def torch_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    norm: nn.LayerNorm | None,
    gelu: bool,
    residual: Tensor | None,
) -> Tensor:
    if norm is not None:
        x = F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
    y = F.linear(x, weight, bias)
    if gelu:
        y = F.gelu(y)
    return y if residual is None else residual + y


def triton_linear(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    norm: nn.LayerNorm | None,
    gelu: bool,
    residual: Tensor | None,
    block_n: int = BLOCK_N,
    block_k: int = BLOCK_K,
    warps: int = WARPS,
    stages: int = STAGES,
) -> Tensor:
    from engine.kernels._linear import linear_kernel

    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    r2 = None
    if residual is not None:
        r2 = residual.reshape(-1, n)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    weight = weight.contiguous()
    linear_kernel[(ceil_div(n, block_n), ceil_div(m, MAX_ROWS))](
        x2,
        weight,
        bias if bias is not None else weight,
        norm.weight if norm is not None else weight,
        norm.bias if norm is not None else weight,
        r2 if r2 is not None else y,
        y,
        m,
        n,
        k,
        x2.stride(0),
        r2.stride(0) if r2 is not None else 0,
        y.stride(0),
        norm.eps if norm is not None else 0.0,
        NORM=norm is not None,
        BIAS=bias is not None,
        GELU=gelu,
        RESIDUAL=r2 is not None,
        BLOCK_M=MAX_ROWS,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    return y.view(*lead, n)
