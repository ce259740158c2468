"""A tensor's rows as float8 e4m3, each with its scale, for `engine.quantize`'s products.

In torch the cast is three passes over the row and an fp32 copy of it (its largest magnitude,
the division, the cast): measured on an H100, enough to make large-v3-turbo's fp8 encoder
slower than its fp16 one (142 against 199 windows a second). The kernel reads each row once
and writes its e4m3 values and scale.
"""

from __future__ import annotations

import torch
from torch import Tensor

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


def require_fp8(device: torch.device, what: str) -> None:
    """Refuse `what` in fp8 on a CUDA device without fp8 arithmetic (compute capability below
    8.9: before Ada and Hopper); the CPU emulates it."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        raise ValueError(f"{what} in fp8 needs compute capability 8.9+")


def rowwise_fp8(x: Tensor, triton: bool = False) -> tuple[Tensor, Tensor]:
    """x (rows, k) as e4m3 and the fp32 scale of each row (rows, 1): x ~ q * scale.
    triton: one kernel (on CUDA), else torch's passes."""
    if triton and x.is_cuda:
        return triton_rowwise_fp8(x)
    return torch_rowwise_fp8(x)


def torch_rowwise_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    scale = x.abs().amax(dim=-1, keepdim=True).float().clamp_min(1e-12) / FP8_MAX
    return (x / scale).to(FP8), scale


def triton_rowwise_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    from engine.kernels._fp8 import rowwise_fp8_kernel

    x = x.contiguous()
    rows, k = x.shape
    q = torch.empty(rows, k, device=x.device, dtype=FP8)
    scale = torch.empty(rows, 1, device=x.device, dtype=torch.float32)
    block = 1 << (k - 1).bit_length()
    rowwise_fp8_kernel[(rows,)](x, q, scale, k, FP8_MAX=FP8_MAX, BLOCK=block, num_warps=4)
    return q, scale
