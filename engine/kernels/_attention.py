"""Triton source of `engine.kernels.attention` (imported only where Triton is)."""

import triton
import triton.language as tl


@triton.jit
def split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    lengths_ptr,
    partial_ptr,  # fp32 (batch * n_head, SPLITS, D + 2): acc, max, sum
    out_ptr,  # (batch, n_head, D), written here when SPLITS == 1
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    n_head,
    n_keys,
    scale,
    HAS_LENGTHS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads a key head serves
    SPLITS: tl.constexpr,
    CHUNK: tl.constexpr,  # positions per split, a multiple of BLOCK_N
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // n_head
    h = bh % n_head
    end = n_keys
    if HAS_LENGTHS:
        end = tl.minimum(tl.load(lengths_ptr + b).to(tl.int32), n_keys)
    start = split * CHUNK
    stop = tl.minimum(start + CHUNK, end)

    dims = tl.arange(0, D)
    # fp32 whatever `scale` arrives as: torch.compile passes a Python float as fp64, which
    # would widen the scores and the running maximum with them
    q = (tl.load(q_ptr + b * stride_qb + h * stride_qh + dims).to(tl.float32) * scale).to(
        tl.float32
    )
    k_row = k_ptr + b * stride_kb + (h // GROUP) * stride_kh
    v_row = v_ptr + b * stride_vb + (h // GROUP) * stride_vh
    m = -float("inf")
    s = 0.0
    acc = tl.zeros([D], dtype=tl.float32)
    # only the blocks before `stop` (none when the split lies wholly past it): a row's
    # length, not the positions the caller allows for, sets what it reads
    for i in range(0, tl.cdiv(tl.maximum(stop - start, 0), BLOCK_N)):
        pos = start + i * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = pos < stop
        k = tl.load(k_row + pos[:, None] * stride_kn + dims[None, :], valid[:, None], other=0.0)
        scores = tl.sum(q[None, :] * k.to(tl.float32), axis=1)
        scores = tl.where(valid, scores, -float("inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        shift = tl.where(m_new == -float("inf"), 0.0, m_new)  # nothing seen yet
        alpha = tl.exp(m - shift)
        p = tl.exp(scores - shift)
        v = tl.load(v_row + pos[:, None] * stride_vn + dims[None, :], valid[:, None], other=0.0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        s = s * alpha + tl.sum(p, axis=0)
        m = m_new

    if SPLITS == 1:
        tl.store(out_ptr + bh * D + dims, (acc / s).to(out_ptr.dtype.element_ty))
    else:
        base = partial_ptr + (bh * SPLITS + split) * (D + 2)
        tl.store(base + dims, acc)
        tl.store(base + D, m)
        tl.store(base + D + 1, s)


@triton.jit
def combine_kernel(
    partial_ptr, out_ptr, SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, D: tl.constexpr
):
    bh = tl.program_id(0)
    splits = tl.arange(0, SPLITS_P2)
    used = splits < SPLITS
    dims = tl.arange(0, D)
    base = partial_ptr + bh * SPLITS * (D + 2)
    m = tl.load(base + splits * (D + 2) + D, mask=used, other=-float("inf"))
    s = tl.load(base + splits * (D + 2) + D + 1, mask=used, other=0.0)
    acc = tl.load(base + splits[:, None] * (D + 2) + dims[None, :], mask=used[:, None], other=0.0)
    top = tl.max(m, axis=0)
    w = tl.where(m == -float("inf"), 0.0, tl.exp(m - top))  # empty splits weigh nothing
    out = tl.sum(w[:, None] * acc, axis=0) / tl.sum(w * s, axis=0)
    tl.store(out_ptr + bh * D + dims, out.to(out_ptr.dtype.element_ty))


@triton.jit
def group_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    lengths_ptr,
    partial_ptr,  # fp32 (batch * n_head, SPLITS, D + 2): acc, max, sum
    out_ptr,  # (batch, n_head, D), written here when SPLITS == 1
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    n_kv_head,
    n_keys,
    scale,
    HAS_LENGTHS: tl.constexpr,
    GROUP: tl.constexpr,  # query heads a key head serves
    ROWS: tl.constexpr,  # GROUP padded to what a product takes (16)
    SPLITS: tl.constexpr,
    CHUNK: tl.constexpr,  # positions per split, a multiple of BLOCK_N
    D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HALF: tl.constexpr,  # products in fp16 (an fp16 query), else fp32 (bf16 exact in TF32)
    PRECISION: tl.constexpr,  # of fp32 products: "tf32" holds bf16 exactly, "ieee" fp32
):
    """`split_kernel` for grouped query heads: one program a key head reads its keys and values
    once for every query head it serves, their scores and sums as products over the group."""
    bk = tl.program_id(0)
    split = tl.program_id(1)
    b = bk // n_kv_head
    kh = bk % n_kv_head
    end = n_keys
    if HAS_LENGTHS:
        end = tl.minimum(tl.load(lengths_ptr + b).to(tl.int32), n_keys)
    start = split * CHUNK
    stop = tl.minimum(start + CHUNK, end)

    dims = tl.arange(0, D)
    rows = tl.arange(0, ROWS)
    used = rows < GROUP
    heads = kh * GROUP + rows
    q_at = q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_at, used[:, None], other=0.0)
    dtype = tl.float16 if HALF else tl.float32
    q = (q.to(tl.float32) * scale).to(dtype)
    k_row = k_ptr + b * stride_kb + kh * stride_kh
    v_row = v_ptr + b * stride_vb + kh * stride_vh
    m = tl.full([ROWS], -float("inf"), tl.float32)
    s = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, D], dtype=tl.float32)
    for i in range(0, tl.cdiv(tl.maximum(stop - start, 0), BLOCK_N)):
        pos = start + i * BLOCK_N + tl.arange(0, BLOCK_N)
        valid = pos < stop
        k = tl.load(k_row + pos[:, None] * stride_kn + dims[None, :], valid[:, None], other=0.0)
        scores = tl.dot(q, tl.trans(k.to(dtype)), input_precision=PRECISION)
        scores = tl.where(valid[None, :], scores, -float("inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        shift = tl.where(m_new == -float("inf"), 0.0, m_new)  # nothing seen yet
        alpha = tl.exp(m - shift)
        p = tl.exp(scores - shift[:, None])
        v = tl.load(v_row + pos[:, None] * stride_vn + dims[None, :], valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(dtype), v.to(dtype), input_precision=PRECISION)
        s = s * alpha + tl.sum(p, axis=1)
        m = m_new

    bh = b * n_kv_head * GROUP + heads
    if SPLITS == 1:
        out = (acc / s[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + bh[:, None] * D + dims[None, :], out, used[:, None])
    else:
        base = partial_ptr + (bh * SPLITS + split) * (D + 2)
        tl.store(base[:, None] + dims[None, :], acc, used[:, None])
        tl.store(base + D, m, used)
        tl.store(base + D + 1, s, used)
