"""A residual add and the layer norm after it, in one pass: the encoder's element-wise work.

Each encoder block adds a product's output to the residual stream twice and normalises the
sum for the next product. In torch that is an add (reading two tensors, writing one) and a
layer norm (reading it again, writing the normalised copy), and torch's layer norm streams a
large-v3 batch at about 1.5 TB/s: with the GELU, 17 % of the encoder's time (H200 profile of
16 windows, 2026-12-02). The kernel here reads the stream and the product's output once and
writes the sum and its normalised copy, a row a program.

Fusing these into the products instead (the tiled `engine.kernels.linear`: layer norm before,
GELU or residual after, in the same kernel) was measured first and lost: the encoder ran 1.6
(tiny) to 2.1 (large-v3) times slower, Triton's tiles losing more to cuBLAS than the passes
they save (docs/benchmarks.md, "Engine speed, fourth round").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def add_norm(
    x: Tensor, y: Tensor, norm: nn.LayerNorm, triton: bool = False
) -> tuple[Tensor, Tensor]:
    """(x + y, norm(x + y)), the sum rounded to the inputs' dtype before it is normalised, as
    torch's two kernels do.

    x, y: shape = (..., n_state), contiguous
    triton: one Triton kernel (on CUDA), else torch's add and layer norm
    """
    if triton and x.is_cuda:
        return triton_add_norm(x, y, norm)
    return torch_add_norm(x, y, norm)


def torch_add_norm(x: Tensor, y: Tensor, norm: nn.LayerNorm) -> tuple[Tensor, Tensor]:
    s = x + y
    return s, F.layer_norm(s, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


def triton_add_norm(x: Tensor, y: Tensor, norm: nn.LayerNorm) -> tuple[Tensor, Tensor]:
    import triton

    from engine.kernels._norm import add_norm_kernel

    d = x.shape[-1]
    x2, y2 = x.reshape(-1, d), y.reshape(-1, d)
    if not (x2.is_contiguous() and y2.is_contiguous()):
        raise ValueError("add_norm takes contiguous rows")
    s, h = torch.empty_like(x2), torch.empty_like(x2)
    block = triton.next_power_of_2(d)
    add_norm_kernel[(x2.shape[0],)](
        x2,
        y2,
        norm.weight,
        norm.bias,
        s,
        h,
        d,
        norm.eps,
        BLOCK=block,
        num_warps=8 if block >= 1024 else 4,
    )
    return s.view(x.shape), h.view(x.shape)
