"""fp8 products for the encoder: most of a window's work for large-v3-turbo and the distilled
models, whose decoders are small.

Each of an encoder block's four products (qkv, out, fc1, fc2) keeps its weight in float8 e4m3
with a scale per output row, made once at load, and casts its input to e4m3 with a scale per
row (per frame) as it comes; `torch._scaled_mm` multiplies them on fp8 tensor cores (twice
fp16's rate on Hopper) and applies both scales and the bias as it writes fp16. Attention, the
layer norms and the convolutions stay in the model's dtype. On the CPU the same rounding runs
in fp32 arithmetic: what the accuracy checks measure there. An experiment so far: on an H100
the casts cost more than the products saved (docs/benchmarks.md), and base's WER moves by more
than the 0.3 allowed (docs/accuracy.md), likely because one scale per activation row is too
coarse for the encoder's outlier channels (not yet measured).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from engine.kernels.fp8 import rowwise_fp8


class Fp8Linear(nn.Module):
    """`linear` with its weight in e4m3, a scale per output row; its input cast per row
    (triton: in one kernel on CUDA, `engine.kernels.fp8`)."""

    def __init__(self, linear: nn.Linear, triton: bool = False):
        super().__init__()
        self.triton = triton
        weight, scale = rowwise_fp8(linear.weight.detach())
        self.register_buffer("weight", weight)  # (out, in), row-major: its .t() is what
        self.register_buffer("weight_scale", scale.t().contiguous())  # _scaled_mm takes
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())
        self.out_dtype = linear.weight.dtype

    def forward(self, x: Tensor) -> Tensor:
        rows, scale = rowwise_fp8(x.reshape(-1, x.shape[-1]), self.triton)
        out = torch._scaled_mm(
            rows,
            self.weight.t(),
            scale_a=scale,
            scale_b=self.weight_scale,
            bias=self.bias,
            out_dtype=self.out_dtype,
        )
        return out.view(*x.shape[:-1], out.shape[-1])


def fp8_encoder(encoder: nn.Module, triton: bool = False) -> None:
    """Each encoder block's products as `Fp8Linear`s, in place (the fp16 weights let go)."""
    for block in encoder.blocks:
        block.attn.qkv = Fp8Linear(block.attn.qkv, triton)
        block.attn.out = Fp8Linear(block.attn.out, triton)
        block.fc1 = Fp8Linear(block.fc1, triton)
        block.fc2 = Fp8Linear(block.fc2, triton)
