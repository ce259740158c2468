"""The speaker network's dense layers (CAM++, `engine.speakers`) in two kernels each.

Each layer reads every channel its block has made so far through its own batch norm and ReLU
before a 1x1 convolution. In torch that is a strided read and a write of the normalised copy,
a pass to rectify it, and the product's read of it again: on an H100, those element-wise
kernels took three to four times the product's own time (torch.profiler, 2026-12-06).
`bn_relu_linear` normalises and rectifies each block of the input as it loads it, so the
input is read once, in place in the block's buffer. The layer's gated dilated convolution was
a pad, a gather of its three taps side by side, a product and a multiply into the block;
`gated_conv` reads each tap's frames where they are and writes the gated product into its
channels of the block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.kernels import ceil_div

BLOCK_M, BLOCK_N, BLOCK_K, WARPS, STAGES = 128, 128, 64, 4, 3
GATED_BLOCK_M, GATED_BLOCK_K, GATED_WARPS = 64, 128, 4


def bn_relu_linear(
    x: Tensor,
    scale: Tensor,
    shift: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    relu: bool = False,
    triton: bool = False,
) -> Tensor:
    """act(relu(x * scale + shift) @ weight.T + bias) over (..., K) x whose last dimension is
    contiguous (a slice of a wider buffer will do); act: ReLU if relu. triton: one kernel (on
    CUDA), else torch's."""
    if triton and x.is_cuda:
        return triton_bn_relu_linear(x, scale, shift, weight, bias, relu)
    return torch_bn_relu_linear(x, scale, shift, weight, bias, relu)


def torch_bn_relu_linear(
    x: Tensor, scale: Tensor, shift: Tensor, weight: Tensor, bias: Tensor | None, relu: bool
) -> Tensor:
    out = F.linear(F.relu(torch.addcmul(shift, x, scale)), weight, bias)
    return F.relu(out) if relu else out


def triton_bn_relu_linear(
    x: Tensor, scale: Tensor, shift: Tensor, weight: Tensor, bias: Tensor | None, relu: bool
) -> Tensor:
    from engine.kernels._dense import bn_relu_linear_kernel

    *lead, k = x.shape
    rows = x.flatten(0, -2) if x.dim() > 2 else x  # a view: the rows keep their stride
    assert rows.stride(-1) == 1, "the input's channels must be contiguous"
    m, n = rows.shape[0], weight.shape[0]
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    grid = (ceil_div(m, BLOCK_M), ceil_div(n, BLOCK_N))
    bn_relu_linear_kernel[grid](
        rows,
        scale,
        shift,
        weight,
        out if bias is None else bias,
        out,
        m,
        n,
        k,
        rows.stride(0),
        HAS_BIAS=bias is not None,
        RELU=relu,
        IEEE=x.dtype == torch.float32,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        num_warps=WARPS,
        num_stages=STAGES,
    )
    return out.view(*lead, n)


def gated_conv(
    h: Tensor, weight: Tensor, dilation: int, gate: Tensor, segment: int, out: Tensor, triton: bool
) -> None:
    """out = conv1d(h, weight, dilation, same padding) * gate, over (n, frames, channels)
    windows; weight (outputs, taps * channels), tap-major; gate (n, segments, outputs), each
    for `segment` frames of its window; out (n, frames, outputs) with contiguous channels (a
    slice of a wider buffer will do), written in place. triton: one kernel (on CUDA), which
    reads each tap's frames where they are; else torch's, which copies them side by side."""
    if triton and h.is_cuda:
        triton_gated_conv(h, weight, dilation, gate, segment, out)
    else:
        torch_gated_conv(h, weight, dilation, gate, segment, out)


def torch_gated_conv(
    h: Tensor, weight: Tensor, dilation: int, gate: Tensor, segment: int, out: Tensor
) -> None:
    taps = weight.shape[1] // h.shape[2]
    reach = taps // 2 * dilation
    frames = F.pad(h, (0, 0, reach, reach)).unfold(1, 2 * reach + 1, 1)[..., ::dilation]
    if gate.shape[1] > 1:
        gate = gate.repeat_interleave(segment, 1)[:, : h.shape[1]]
    torch.mul(F.linear(frames.transpose(2, 3).flatten(2), weight), gate, out=out)


def triton_gated_conv(
    h: Tensor, weight: Tensor, dilation: int, gate: Tensor, segment: int, out: Tensor
) -> None:
    from engine.kernels._dense import gated_conv_kernel

    n, t, k = h.shape
    assert h.is_contiguous() and gate.is_contiguous() and out.stride(2) == 1
    assert out.stride(0) == t * out.stride(1), "out's frames must be evenly spaced"
    grid = (ceil_div(n * t, GATED_BLOCK_M),)
    gated_conv_kernel[grid](
        h,
        weight,
        gate,
        out,
        n * t,
        t,
        gate.shape[1],
        segment,
        dilation,
        out.stride(1),
        K=k,
        N=weight.shape[0],
        TAPS=weight.shape[1] // k,
        BLOCK_M=GATED_BLOCK_M,
        BLOCK_K=GATED_BLOCK_K,
        num_warps=GATED_WARPS,
    )
