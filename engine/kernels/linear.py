"""A linear layer for the few rows of a small decode step, with its neighbours fused in.

At batch 1 a decoder layer was some 20 kernels of 2-5 us each, most of them tiny: a layer
norm before each projection, a residual add after each output projection, a GELU between the
MLP's two. And cuBLAS's kernels for a handful of rows stream the weights at about 30 % of the
bandwidth (H200 profile of large-v3 at batch 1, 2026-12-02). The Triton kernel here computes
`residual + act(layer_norm(x) @ W.T + b)` in one pass: each program normalises the rows it
needs (their statistics first, from cache), streams its block of W once, and adds bias,
activation and residual before its only write.

Products with more than `SPLIT_FROM` weights also split over their inputs: each program takes
a share of them and writes its partial sums, and the last program of each block of outputs
to arrive adds the shares in a fixed order (the same bits whatever order the programs ran in)
and finishes the block.

Measured on an H200 (scripts/tune_kernels.py --linear, 2026-12-02), each against torch's
unfused kernels at 1 to 16 rows: tiny's projections (384 wide) 2.9-5.0 us instead of 4.7-8.0;
large-v3's output projections 4.5-4.9 us instead of 5.8-6.7, its second MLP layer (5120
inputs) 6.0-6.2 instead of 8.7-8.9 at its best setting (32 outputs a program, 128 inputs an
iteration, split 8 ways; the defaults below split it 3 ways and were not timed alone), its
first MLP layer and qkv within a microsecond of cuBLAS either way. Each call costs roughly
2.9-4.4 us before its weights matter; beyond that, the split products stream them at up to
about the copy's rate (an estimate from two sizes): at batch 1 the count of kernels more than
their bandwidth is what is left.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from engine.kernels import ceil_div


@dataclass(frozen=True)
class Tile:
    """A launch setting: rows and outputs per program, inputs per loop iteration, warps, and
    pipeline stages."""

    block_m: int
    block_n: int
    block_k: int
    warps: int
    stages: int


MAX_ROWS = 16  # the engine's Triton path for up to this many rows: one block of rows
STREAM = Tile(MAX_ROWS, 16, 256, 4, 3)  # the default setting there
SPLIT_FROM = 1 << 21  # streamed weights of more elements than this are split over their inputs
TARGET_PROGRAMS = 256  # split a product over its inputs until about this many programs run
MAX_SPLIT = 8


def splits(n_blocks: int, k: int, block_k: int) -> int:
    """How many programs share each block of outputs: enough to fill the GPU with loads in
    flight, each with at least two iterations of its loop."""
    return max(1, min(TARGET_PROGRAMS // n_blocks, k // (2 * block_k), MAX_SPLIT))


@functools.cache
def scratch(device: torch.device, n: int, n_blocks: int) -> tuple[Tensor, Tensor]:
    """Partial sums (fp32, MAX_SPLIT x MAX_ROWS x n) and arrival counts (one per block of
    outputs, zero between calls: each call's last program resets its own) for products split
    over their inputs, one pair per device and width. Decoder passes on a device run one at a
    time (on the stepping thread's CUDA stream), so no two calls share them at once."""
    partial = torch.empty(MAX_SPLIT, MAX_ROWS, n, device=device, dtype=torch.float32)
    return partial, torch.zeros(n_blocks, device=device, dtype=torch.int32)


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
    triton: the fused kernel where it pays (on CUDA, fp16, up to MAX_ROWS rows). More rows
        stay on cuBLAS: over tiles of rows the kernel made the encoder 1.6 (tiny) to 2.1
        (large-v3) times slower, its products losing more than the passes it saved (H200,
        2026-12-02).
        bf16 stays on torch's path: through the kernel, tiny.en's bf16 WER on the dev clips
        moved 0.36 points from fp32's (lower, yet past the real-weight check's 0.3), and
        Triton's interpreter cannot check bf16 products on CPUs
    """
    rows = x.numel() // x.shape[-1]
    if triton and rows <= MAX_ROWS and x.is_cuda and x.dtype == torch.float16:
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
    tile: Tile | None = None,
    split: int | None = None,
) -> Tensor:
    """tile: the launch setting (default STREAM; more rows than a tile's take more tiles,
    each loading the weights again: scripts/tune_kernels.py --tiled measures such); split:
    programs sharing each block of outputs, each over a part of the inputs (up to MAX_ROWS
    rows only; default: enough for about TARGET_PROGRAMS programs where the weights have more
    than SPLIT_FROM elements)."""
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
    tile = tile or STREAM
    y = torch.empty(m, n, device=x.device, dtype=x.dtype)
    weight = weight.contiguous()
    n_blocks = ceil_div(n, tile.block_n)
    if split is None:
        streamed = m <= MAX_ROWS and n * k > SPLIT_FROM
        split = splits(n_blocks, k, tile.block_k) if streamed else 1
    elif split > 1 and (m > tile.block_m or tile.block_m != MAX_ROWS or split > MAX_SPLIT):
        raise ValueError(
            f"a split over the inputs takes one block of {MAX_ROWS} rows and {MAX_SPLIT} shares"
        )
    k_chunk = ceil_div(ceil_div(k, split), tile.block_k) * tile.block_k
    split = ceil_div(k, k_chunk)
    partial, tickets = scratch(x.device, n, n_blocks) if split > 1 else (y, y)
    linear_kernel[(n_blocks, ceil_div(m, tile.block_m), split)](
        x2,
        weight,
        bias if bias is not None else weight,
        norm.weight if norm is not None else weight,
        norm.bias if norm is not None else weight,
        r2 if r2 is not None else y,
        y,
        partial,
        tickets,
        m,
        n,
        k,
        x2.stride(0),
        r2.stride(0) if r2 is not None else 0,
        y.stride(0),
        norm.eps if norm is not None else 0.0,
        k_chunk,
        NORM=norm is not None,
        BIAS=bias is not None,
        GELU=gelu,
        RESIDUAL=r2 is not None,
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        BLOCK_K=tile.block_k,
        SPLIT=split,
        num_warps=tile.warps,
        num_stages=tile.stages,
    )
    return y.view(*lead, n)
