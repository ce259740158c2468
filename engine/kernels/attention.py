"""Attention of one new query per row over a cache: the decode step's self- and cross-attention.

A decode step's attention is bound by reading K/V: for each (row, head), one query against up
to 1500 cached positions. Library kernels made for long query blocks give each (row, head) one
thread block, which at small batches leaves most of the GPU idle; they take no fp8 cache, and
a mask for rows of different lengths makes them read at a third of the bandwidth. The Triton
kernel here splits the positions across thread blocks (split-K, as flash-decoding does), reads
K/V once, in whatever dtype the cache holds (fp16, bf16 or fp8), stops at each row's length,
and merges the partial softmaxes in a second small kernel. Large batches of an fp16/bf16
cross-attention cache go to cuDNN, which reads it faster. Grouped query heads (Qwen3's decoder:
more query heads than key heads) read their group's key head where it lies, once for the
group: one program a key head, the group's scores and sums as products.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.kernels import ceil_div

# Settings measured on an H200 (scripts/tune_kernels.py, 2026-11-30): 256 positions per loop
# iteration and 4 warps were best or within 2% of it for batches 1 to 512.
BLOCK_N = 256  # positions per loop iteration
MIN_CHUNK = 128  # positions per split at least
TARGET_PROGRAMS = 1024  # split until this many (row, head, split) programs run
# From this many (row, head) pairs, an fp16/bf16 cross-attention cache goes to cuDNN: it read
# faster at 2560 and 3072 pairs (4.4 TB/s at 128 x 20 and 512 x 6, against 4.0-4.1 here); the
# split over positions won at 6 and 20 (batch 1: 6.3 us against 7.9 for 1500 positions, 20
# heads). The crossover between was not measured.
LIBRARY_FROM = 1024
# positions per loop iteration of the grouped kernel: its keys and values go through products,
# tiles of (positions, D) each (not measured yet; flash-decoding's size)
GROUP_BLOCK_N = 64


def decode_attention(
    q: Tensor, k: Tensor, v: Tensor, lengths: Tensor | None = None, triton: bool = False
) -> Tensor:
    """
    q: shape = (batch, n_head, d_head), one query per row
    k, v: shape = (batch, n_kv_head, n_keys, d_head), any float dtype (fp8 is widened); query
      head h reads key head h // (n_head // n_kv_head)
    lengths: shape = (batch,), how many leading keys each row sees (default: all n_keys)
    triton: use the Triton kernel where it pays (on CUDA), else SDPA
    returns: shape = (batch, n_head, d_head), in q's dtype
    """
    library = lengths is None and k.dtype == q.dtype and q.shape[0] * q.shape[1] >= LIBRARY_FROM
    if triton and q.is_cuda and not library:
        return triton_decode_attention(q, k, v, lengths)
    return torch_decode_attention(q, k, v, lengths)


def torch_decode_attention(
    q: Tensor, k: Tensor, v: Tensor, lengths: Tensor | None = None
) -> Tensor:
    mask = None
    if lengths is not None:
        mask = torch.arange(k.shape[2], device=k.device) < lengths[:, None, None, None]
    out = F.scaled_dot_product_attention(
        q[:, :, None], k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
        enable_gqa=q.shape[1] != k.shape[1],
    )  # fmt: skip
    return out[:, :, 0]


def n_splits(batch: int, n_head: int, n_keys: int, target: int, min_chunk: int) -> int:
    """How many parts each (row, head)'s positions are split into."""
    want = ceil_div(target, batch * n_head)
    return max(1, min(want, n_keys // min_chunk))


def triton_decode_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lengths: Tensor | None = None,
    block_n: int = BLOCK_N,
    target_programs: int = TARGET_PROGRAMS,
    min_chunk: int = MIN_CHUNK,
    num_warps: int = 4,
    num_stages: int | None = None,
) -> Tensor:
    from engine.kernels._attention import combine_kernel, group_kernel, split_kernel

    b, kv_heads, n_keys, d = k.shape
    h = q.shape[1]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("the last dimension of q, k and v must be contiguous")
    group = h // kv_heads
    # grouped heads: one program a key head (its queries a product), else one a query head
    programs = kv_heads if group > 1 else h
    splits = n_splits(b, programs, n_keys, target_programs, min_chunk)
    if group > 1:
        block_n = min(block_n, GROUP_BLOCK_N)
    chunk = ceil_div(ceil_div(n_keys, splits), block_n) * block_n
    out = torch.empty(b, h, d, device=q.device, dtype=q.dtype)
    partial = torch.empty(b, h, splits, d + 2, device=q.device, dtype=torch.float32)
    args = (
        q,
        k,
        v,
        lengths if lengths is not None else q,
        partial,
        out,
        *q.stride()[:2],
        *k.stride()[:3],
        *v.stride()[:3],
    )
    settings = dict(
        HAS_LENGTHS=lengths is not None,
        GROUP=group,
        SPLITS=splits,
        CHUNK=chunk,
        D=d,
        BLOCK_N=block_n,
        num_warps=num_warps,
        **({"num_stages": num_stages} if num_stages else {}),
    )
    scale = 1.0 / math.sqrt(d)
    if group > 1:
        rows = max(16, 1 << (group - 1).bit_length())
        half, precision = q.dtype == torch.float16, "ieee" if q.dtype == torch.float32 else "tf32"
        group_kernel[(b * kv_heads, splits)](
            *args, kv_heads, n_keys, scale, ROWS=rows, HALF=half, PRECISION=precision, **settings
        )
    else:
        split_kernel[(b * h, splits)](*args, h, n_keys, scale, **settings)
    if splits > 1:
        p2 = 1 << (splits - 1).bit_length()
        combine_kernel[(b * h,)](partial, out, SPLITS=splits, SPLITS_P2=p2, D=d, num_warps=1)
    return out
