"""Triton kernels for the decode step, each beside the torch code it replaces.

A decode step reads little arithmetic and many bytes: the cross-attention K/V of every live
window and the logits of every row. The kernels here read each of those once (the logits
twice for rows that predict timestamps). Every kernel has
a torch path that stays the reference (tests compare them, on the GPU and, with
`TRITON_INTERPRET=1`, on the CPU) and the path used where Triton is not (CPUs, or
`WHISPERFLEET_TRITON=0`).
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch


@functools.cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(t: torch.Tensor) -> bool:
    """Whether `t`'s computation goes through the Triton kernels."""
    enabled = os.environ.get("WHISPERFLEET_TRITON", "1") != "0"
    return t.is_cuda and enabled and _triton_installed()
