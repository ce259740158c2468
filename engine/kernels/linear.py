"""A linear layer for the few rows of a small decode step, with its neighbours fused in.

At batch 1 a decoder layer was some 20 kernels of 2-5 us each, most of them tiny: a layer
norm before each projection, a residual add after each output projection, a GELU between the
MLP's two. And cuBLAS's kernels for a handful of rows stream the weights at about 30 % of the
bandwidth (H200 profile of large-v3 at batch 1, 2026-12-02). The Triton kernel here computes
`residual + act(layer_norm(x) @ W.T + b)` in one pass: each program normalises the rows it
needs (their statistics first, from cache), streams its block of W once, and adds bias,
activation and residual before its only write. Above `MAX_ROWS` rows cuBLAS's matrix products
win and the torch path runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.kernels import ceil_div

MAX_ROWS = 16  # the Triton kernel for up to this many rows; one block of rows
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
    triton: the fused kernel where it pays (on CUDA, fp16, up to MAX_ROWS rows). bf16 stays
        on torch's path: through the kernel, tiny.en's bf16 WER on the dev clips moved 0.36
        points from fp32's (lower, yet past the real-weight check's 0.3), and Triton's
        interpreter cannot check bf16 products on CPUs
    """
    rows = x.numel() // x.shape[-1]
    if triton and x.is_cuda and x.dtype == torch.float16 and rows <= MAX_ROWS:
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
