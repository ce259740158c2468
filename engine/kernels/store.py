"""Writing new keys and values into a layer's cache: one kernel for K and V together.

A decode step writes one position of every live row's self-attention cache per layer, and an
admitted window writes all 1500 positions of its cross-attention cache per layer. In torch
the first is two indexed writes (`index_put`: 19 us each at batch 256 for large-v3, for
0.65 MB) and the second a copy that changes the layout from the projection's (position, head,
d) to the cache's (head, position, d), plus a clamp and a cast for an fp8 cache: each a pass
over 123 MB for 32 large-v3 windows, at a third of the copy bandwidth (H200 profile,
2026-12-02). The Triton kernel reads each value once and writes it once, in the cache's
layout and dtype, and takes its slots from a tensor, so a CUDA graph can write to slots that
are chosen after capture (`engine.runner`: admitted windows land where the pool has room).
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.kernels import ceil_div

FP8_MAX = 448.0  # largest float8_e4m3fn; values past it are clamped, the cast would make NaN
BLOCK_T = 64  # positions per program


def store_kv(
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    rows: Tensor,
    start: Tensor | None = None,
    triton: bool = False,
) -> None:
    """
    k, v: shape = (n, t, n_state), each row's t new keys and values (the last dimension
        contiguous; views of a fused projection are fine)
    k_cache, v_cache: shape = (n_slots, n_head, ctx, d_head), one layer's cache, any float
        dtype (an fp8 cache gets the values clamped to its range)
    rows: shape = (n,), the slot of each row
    start: shape = (n,), the position of each row's first new key (default 0); they follow
    triton: use the Triton kernel (on CUDA), else indexed writes in torch
    """
    if triton and k.is_cuda:
        triton_store_kv(k, v, k_cache, v_cache, rows, start)
    else:
        torch_store_kv(k, v, k_cache, v_cache, rows, start)


def torch_store_kv(
    k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, rows: Tensor, start: Tensor | None
) -> None:
    n, t, c = k.shape
    h = k_cache.shape[1]
    positions = torch.arange(t, device=k.device).expand(n, t)
    if start is not None:
        positions = positions + start[:, None]
    for new, cache in ((k, k_cache), (v, v_cache)):
        new = new.reshape(n, t, h, c // h)
        if cache.dtype == torch.float8_e4m3fn:
            new = new.clamp(-FP8_MAX, FP8_MAX)
        # index tensors split by a slice put their axes first: the target is (n, t, head, d)
        cache[rows[:, None], :, positions] = new.to(cache.dtype)


def triton_store_kv(
    k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, rows: Tensor, start: Tensor | None
) -> None:
    from engine.kernels._store import store_kernel

    n, t, c = k.shape
    h, d = k_cache.shape[1], k_cache.shape[3]
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("the last dimension of k, v and the caches must be contiguous")
    if k.stride()[:2] != v.stride()[:2] or k_cache.stride() != v_cache.stride():
        raise ValueError("k and v, and their caches, must be laid out alike")
    rows, t_blocks = rows.contiguous(), ceil_div(t, BLOCK_T)
    store_kernel[(n * t_blocks, h)](
        k,
        v,
        k_cache,
        v_cache,
        rows,
        start.contiguous() if start is not None else rows,
        *k.stride()[:2],
        *k_cache.stride()[:3],
        t,
        t_blocks,
        HAS_START=start is not None,
        FP8=k_cache.dtype == torch.float8_e4m3fn,
        D=d,
        BLOCK_T=BLOCK_T,
        num_warps=4,
    )
