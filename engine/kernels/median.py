"""The median filter of word timestamps (`engine.timing`): each value the median of the seven
around it along time, edges reflected.

In torch this is a sort of every window of seven (`unfold(...).sort()`): on an H100 a bitonic
sort kernel of 430 us for each window's alignment weights, 165 ms of GPU time, a tenth of it,
in a tiny.en transcription of 16 x 12 minutes with word timestamps (2026-12-07). The kernel
reads each value's neighbours once and sorts them in registers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.kernels import ceil_div

WIDTH = 7  # the kernel's: openai-whisper's medfilt_width
BLOCK = 1024  # positions per program


def median_filter(x: Tensor, width: int, triton: bool = False) -> Tensor:
    """The median of each run of `width` along the last axis, edges reflected (unchanged if
    that axis is too short to reflect). triton: the kernel (on CUDA; `width` 7, finite
    values), else torch's sort."""
    pad = width // 2
    if x.shape[-1] <= pad:
        return x
    if triton and x.is_cuda and width == WIDTH:
        return triton_median_filter(x)
    return torch_median_filter(x, width)


def torch_median_filter(x: Tensor, width: int) -> Tensor:
    pad = width // 2
    rows = F.pad(x.reshape(-1, x.shape[-1]), (pad, pad), mode="reflect")  # of any rank
    return rows.unfold(-1, width, 1).sort()[0][..., pad].view(x.shape)


def triton_median_filter(x: Tensor) -> Tensor:
    from engine.kernels._median import median7_kernel

    rows = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.empty_like(rows)
    length = rows.shape[1]
    median7_kernel[(rows.shape[0], ceil_div(length, BLOCK))](rows, out, length, BLOCK)
    return out.view(x.shape)
