"""Triton source of `engine.kernels.store` (imported only where Triton is)."""

import triton
import triton.language as tl


@triton.jit
def store_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    rows_ptr,
    start_ptr,
    stride_n,
    stride_t,
    stride_slot,
    stride_head,
    stride_pos,
    t,
    t_blocks,
    HAS_START: tl.constexpr,
    FP8: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    pid = tl.program_id(0)
    head = tl.program_id(1)
    row = pid // t_blocks
    first = (pid % t_blocks) * BLOCK_T
    slot = tl.load(rows_ptr + row).to(tl.int64)
    offset = 0
    if HAS_START:
        offset = tl.load(start_ptr + row).to(tl.int32)
    steps = first + tl.arange(0, BLOCK_T)
    inside = steps < t
    dims = tl.arange(0, D)
    src = row.to(tl.int64) * stride_n + steps[:, None] * stride_t + head * D + dims[None, :]
    dst = (
        slot * stride_slot
        + head * stride_head
        + (offset + steps)[:, None].to(tl.int64) * stride_pos
        + dims[None, :]
    )
    mask = inside[:, None]
    k = tl.load(k_ptr + src, mask=mask)
    v = tl.load(v_ptr + src, mask=mask)
    if FP8:
        k = tl.clamp(k, -448.0, 448.0)
        v = tl.clamp(v, -448.0, 448.0)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)
