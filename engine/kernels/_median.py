"""Triton source of `engine.kernels.median` (imported only where Triton is)."""

import triton
import triton.language as tl


@triton.jit
def _reflected(row_ptr, at, inside, length):
    at = tl.abs(at)
    at = tl.where(at > length - 1, 2 * (length - 1) - at, at)
    return tl.load(row_ptr + at, mask=inside, other=0.0)


@triton.jit
def _order(a, b):
    return tl.minimum(a, b), tl.maximum(a, b)


@triton.jit(do_not_specialize=["length"])  # each pass's frames: one compile for all
def median7_kernel(x_ptr, out_ptr, length, BLOCK: tl.constexpr):
    """One row's block of positions a program: the seven values around each (reflected at the
    row's ends), sorted by a 16-comparator network, the middle one kept."""
    row = tl.program_id(0).to(tl.int64)
    at = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = at < length
    x_ptr += row * length
    v0 = _reflected(x_ptr, at - 3, inside, length)
    v1 = _reflected(x_ptr, at - 2, inside, length)
    v2 = _reflected(x_ptr, at - 1, inside, length)
    v3 = _reflected(x_ptr, at, inside, length)
    v4 = _reflected(x_ptr, at + 1, inside, length)
    v5 = _reflected(x_ptr, at + 2, inside, length)
    v6 = _reflected(x_ptr, at + 3, inside, length)
    v0, v6 = _order(v0, v6)
    v2, v3 = _order(v2, v3)
    v4, v5 = _order(v4, v5)
    v0, v2 = _order(v0, v2)
    v1, v4 = _order(v1, v4)
    v3, v6 = _order(v3, v6)
    v0, v1 = _order(v0, v1)
    v2, v5 = _order(v2, v5)
    v3, v4 = _order(v3, v4)
    v1, v2 = _order(v1, v2)
    v4, v6 = _order(v4, v6)
    v2, v3 = _order(v2, v3)
    v4, v5 = _order(v4, v5)
    v1, v2 = _order(v1, v2)
    v3, v4 = _order(v3, v4)
    v5, v6 = _order(v5, v6)
    tl.store(out_ptr + row * length + at, v3, mask=inside)
