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
    eot,
    no_timestamps,
    begin,
    last_initial,
    N_VOCAB: tl.constexpr,
    HAS_BLANK: tl.constexpr,
    TIMESTAMPS: tl.constexpr,
    KEEP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
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

    force = ts_row & False
    # pass 1, for a row that predicts timestamps: are they together likelier than any text
    # token? (A row that does not skips it, so one kernel serves batches of both.)
    if TIMESTAMPS:
        if ts_row:
            text_max = -float("inf")
            ts_max = -float("inf")
            ts_sum = 0.0
            for i in range(0, tl.cdiv(N_VOCAB, BLOCK)):
                v = i * BLOCK + tl.arange(0, BLOCK)
                x = _ruled(
                    row_ptr, v, suppress_ptr, blank_ptr, first, early, ts_row, after_pair,
                    after_lone, seen, floor, force, eot, no_timestamps, begin, last_initial,
                    N_VOCAB, HAS_BLANK, TIMESTAMPS,
                )  # fmt: skip
                text_max = tl.maximum(text_max, tl.max(tl.where(v < begin, x, -float("inf")), 0))
                ts = tl.where(v >= begin, x, -float("inf"))
                new_max = tl.maximum(ts_max, tl.max(ts, 0))
                shift = tl.where(new_max == -float("inf"), 0.0, new_max)
                ts_sum = ts_sum * tl.exp(ts_max - shift) + tl.sum(tl.exp(ts - shift), 0)
                ts_max = new_max
            force = ts_row & (ts_max + tl.log(ts_sum) > text_max)

    # pass 2: the greedy choice and its log-probability; with KEEP, a row that samples also
    # keeps its filtered logits to draw from (the others store nothing)
    if KEEP:  # how far to store: the vocabulary, or nothing
        kept = tl.where(tl.load(sampling_ptr + row) > 0, N_VOCAB, 0)
    best = -float("inf")
    best_index = 0
    total = 0.0
    for i in range(0, tl.cdiv(N_VOCAB, BLOCK)):
        v = i * BLOCK + tl.arange(0, BLOCK)
        x = _ruled(
            row_ptr, v, suppress_ptr, blank_ptr, first, early, ts_row, after_pair,
            after_lone, seen, floor, force, eot, no_timestamps, begin, last_initial,
            N_VOCAB, HAS_BLANK, TIMESTAMPS,
        )  # fmt: skip
        if KEEP:
            tl.store(filtered_ptr + row * stride_filtered + v, x, mask=v < kept)
        block_max, block_index = tl.max(x, 0, return_indices=True)  # first of equals
        new_max = tl.maximum(best, block_max)
        shift = tl.where(new_max == -float("inf"), 0.0, new_max)
        total = total * tl.exp(best - shift) + tl.sum(tl.exp(x - shift), 0)
        best_index = tl.where(block_max > best, i * BLOCK + block_index, best_index)
        best = new_max
    tl.store(token_ptr + row, best_index.to(tl.int64))
    tl.store(logprob_ptr + row, -tl.log(total))  # best - logsumexp: total is relative to best
