"""Triton source of `engine.kernels.greedy` (imported only where Triton is)."""

import triton
import triton.language as tl


@triton.jit
def _ruled(
    row_ptr,
    v,
    suppress_ptr,
    blank_ptr,
    first,
    early,
    ts_row,
    after_pair,
    after_lone,
    seen,
    floor,
    force,
    eot,
    no_timestamps,
    begin,
    last_initial,
    N_VOCAB: tl.constexpr,
    HAS_BLANK: tl.constexpr,
    TIMESTAMPS: tl.constexpr,
):
    """One block of a row's logits (fp32) with every rule's -inf applied."""
    inside = v < N_VOCAB
    x = tl.load(row_ptr + v, mask=inside, other=-float("inf")).to(tl.float32)
    drop = tl.load(suppress_ptr + v, mask=inside, other=1) != 0
    drop = drop | (early & (v == eot))
    if HAS_BLANK:
        drop = drop | (first & (tl.load(blank_ptr + v, mask=inside, other=0) != 0))
    if TIMESTAMPS:
        is_ts = v >= begin
        is_text = v < begin
        drop = drop | (ts_row & (v == no_timestamps))
        drop = drop | (after_pair & is_ts)
        drop = drop | (after_lone & (v < eot))
        drop = drop | (seen & is_ts & (v < floor))
        drop = drop | (ts_row & first & is_text)
        drop = drop | (ts_row & first & (v > last_initial))
        drop = drop | (force & is_text)
    return tl.where(drop, -float("inf"), x)


@triton.jit
def _merged(best, index, total, other_best, other_index, other_total):
    """Two (max, index of its first occurrence, sum of exp(x - max)), the first over entries
    before the second's: as one. Every path merges the blocks' own in vocabulary order, one
    after another: the same arithmetic in the same order, however a row's blocks were shared
    out."""
    new_max = tl.maximum(best, other_best)
    shift = tl.where(new_max == -float("inf"), 0.0, new_max)
    total = total * tl.exp(best - shift) + other_total * tl.exp(other_best - shift)
    index = tl.where(other_best > best, other_index, index)
    return new_max, index, total


@triton.jit
def _block_choice(x, v0):
    """A block's (max, its first index in the vocabulary, sum of exp(x - max))."""
    block_max, block_index = tl.max(x, 0, return_indices=True)  # first of equals
    shift = tl.where(block_max == -float("inf"), 0.0, block_max)
    return block_max, v0 + block_index, tl.sum(tl.exp(x - shift), 0)


@triton.jit
def _block_mass(x, v, begin):
    """A block's best text logit, and its timestamps' (max, sum of exp(x - max))."""
    text_max = tl.max(tl.where(v < begin, x, -float("inf")), 0)
    ts = tl.where(v >= begin, x, -float("inf"))
    ts_max = tl.max(ts, 0)
    shift = tl.where(ts_max == -float("inf"), 0.0, ts_max)
    return text_max, ts_max, tl.sum(tl.exp(ts - shift), 0)


@triton.jit
def greedy_kernel(
    logits_ptr,
    stride_row,
    suppress_ptr,
    blank_ptr,
    n_sampled_ptr,
    last_ptr,
    penultimate_ptr,
    last_timestamp_ptr,
    timestamps_ptr,
    min_tokens_ptr,
    token_ptr,
    logprob_ptr,
    filtered_ptr,
    stride_filtered,
    sampling_ptr,
    mass_ptr,
    part_ptr,
    eot,
    no_timestamps,
    begin,
    last_initial,
    N_VOCAB: tl.constexpr,
    HAS_BLANK: tl.constexpr,
    TIMESTAMPS: tl.constexpr,
    KEEP: tl.constexpr,
    BLOCK: tl.constexpr,
    SPLITS: tl.constexpr,
    MASS: tl.constexpr,
):
    """Program (row, split): the greedy choice over the split's share of the row's blocks.
    One split: the timestamp rule's pass and the choice here, the token and its
    log-probability written. Several: a launch with MASS first writes the timestamp rule's
    numbers of each block to `mass_ptr` (a row that predicts no timestamps, none); then one
    without reads them all, and writes each block's choice to `part_ptr` (`choice_kernel`
    merges them)."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    row_ptr = logits_ptr + row * stride_row
    n = tl.load(n_sampled_ptr + row)
    first = n == 0
    early = n < tl.load(min_tokens_ptr + row)
    ts_row = tl.load(timestamps_ptr + row) != 0
    last = tl.load(last_ptr + row)
    last_ts = (n >= 1) & (last >= begin)
    penultimate_ts = (n < 2) | (tl.load(penultimate_ptr + row) >= begin)
    after_pair = ts_row & last_ts & penultimate_ts
    after_lone = ts_row & last_ts & (penultimate_ts == 0)
    last_timestamp = tl.load(last_timestamp_ptr + row)
    seen = ts_row & (last_timestamp >= 0)
    floor = tl.where(after_lone, last_timestamp, last_timestamp + 1)
    n_blocks = tl.cdiv(N_VOCAB, BLOCK)
    share = tl.cdiv(n_blocks, SPLITS)
    lo = split * share
    hi = tl.minimum(lo + share, n_blocks)

    force = ts_row & False
    # pass 1, for a row that predicts timestamps: are they together likelier than any text
    # token? (A row that does not skips it, so one kernel serves batches of both.)
    if TIMESTAMPS and not MASS:
        if ts_row:
            text_max = -float("inf")
            ts_max = -float("inf")
            ts_sum = 0.0
            for i in range(0, n_blocks):
                if SPLITS == 1:
                    v = i * BLOCK + tl.arange(0, BLOCK)
                    x = _ruled(
                        row_ptr, v, suppress_ptr, blank_ptr, first, early, ts_row, after_pair,
                        after_lone, seen, floor, force, eot, no_timestamps, begin,
                        last_initial, N_VOCAB, HAS_BLANK, TIMESTAMPS,
                    )  # fmt: skip
                    b_text, b_max, b_sum = _block_mass(x, v, begin)
                else:
                    at = mass_ptr + (row * n_blocks + i) * 3
                    b_text, b_max, b_sum = tl.load(at), tl.load(at + 1), tl.load(at + 2)
                text_max = tl.maximum(text_max, b_text)
                ts_max, _, ts_sum = _merged(ts_max, 0, ts_sum, b_max, 0, b_sum)
            force = ts_row & (ts_max + tl.log(ts_sum) > text_max)

    # pass 2: the greedy choice and its log-probability (with MASS, pass 1's numbers of each
    # block instead); with KEEP, a row that samples also keeps its filtered logits to draw
    # from (the others store nothing)
    if KEEP:  # how far to store: the vocabulary, or nothing
        kept = tl.where(tl.load(sampling_ptr + row) > 0, N_VOCAB, 0)
    best = -float("inf")
    best_index = 0
    total = 0.0
    for i in range(lo, hi):
        v = i * BLOCK + tl.arange(0, BLOCK)
        x = _ruled(
            row_ptr, v, suppress_ptr, blank_ptr, first, early, ts_row, after_pair,
            after_lone, seen, floor, force, eot, no_timestamps, begin, last_initial,
            N_VOCAB, HAS_BLANK, TIMESTAMPS,
        )  # fmt: skip
        if MASS:
            if ts_row:
                b_text, b_max, b_sum = _block_mass(x, v, begin)
                at = mass_ptr + (row * n_blocks + i) * 3
                tl.store(at, b_text)
                tl.store(at + 1, b_max)
                tl.store(at + 2, b_sum)
        else:
            if KEEP:
                tl.store(filtered_ptr + row * stride_filtered + v, x, mask=v < kept)
            b_max, b_index, b_sum = _block_choice(x, i * BLOCK)
            if SPLITS == 1:
                best, best_index, total = _merged(best, best_index, total, b_max, b_index, b_sum)
            else:
                at = part_ptr + (row * n_blocks + i) * 3
                tl.store(at, b_max)
                tl.store(at + 1, b_index.to(tl.float32))  # exact: the vocabulary is below 2**24
                tl.store(at + 2, b_sum)
    if SPLITS == 1:
        tl.store(token_ptr + row, best_index.to(tl.int64))
        tl.store(logprob_ptr + row, -tl.log(total))  # best - logsumexp: total is relative


@triton.jit
def choice_kernel(part_ptr, token_ptr, logprob_ptr, N_BLOCKS: tl.constexpr):
    """Program row: its blocks' choices merged in vocabulary order."""
    row = tl.program_id(0)
    best = -float("inf")
    best_index = 0.0
    total = 0.0
    for i in range(0, N_BLOCKS):
        at = part_ptr + (row * N_BLOCKS + i) * 3
        best, best_index, total = _merged(
            best, best_index, total, tl.load(at), tl.load(at + 1), tl.load(at + 2)
        )
    tl.store(token_ptr + row, best_index.to(tl.int64))
    tl.store(logprob_ptr + row, -tl.log(total))
