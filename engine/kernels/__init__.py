"""Triton kernels for the decode step and the encoder, each beside the torch code it replaces.

A decode step reads little arithmetic and many bytes: the cross-attention K/V of every live
window and the logits of every row. The kernels here read each of those once (the logits
twice for rows that predict timestamps). At a few rows a step is many small kernels instead:
there each projection takes its layer norm, GELU and residual add in (`linear`). The encoder
adds each product to its residual stream and normalises the sum in one pass (`norm`). Every
kernel has a torch path that stays the reference (tests compare them, on the GPU and, with
`TRITON_INTERPRET=1`, on the CPU) and the path used where Triton is not: on CPUs, or when an
engine is configured with `kernels="torch"` (`engine.EngineConfig`). The choice is made once,
when a stream opens, and passed down to each call (`triton=`), never read from the
environment.
"""

from __future__ import annotations

import functools
import importlib.util


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)
