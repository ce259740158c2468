"""Each decoding rule on its own, as tensor operations over a batch."""

import pytest
import torch

from engine import TranscriptionOptions
from engine.decoding import (
    ApplyTimestampRules,
    DecodeState,
    SuppressBlank,
    SuppressTokens,
    WindowResult,
    WindowTask,
    prompt_tokens,
)
from engine.longform import Window, split_segments

NEG = float("-inf")


@pytest.fixture(scope="module")
def tok(tiny_en):
    return tiny_en.engine.loaded.tokenizer


def state(tok, sampled: list[list[int]], timestamps=True) -> DecodeState:
    def at(row, k):
        return row[k] if len(row) >= -k else -1

    stamps = [[t for t in row if t >= tok.timestamp_begin] for row in sampled]
    return DecodeState(
        n_sampled=torch.tensor([len(r) for r in sampled]),
        last=torch.tensor([at(r, -1) for r in sampled]),
        penultimate=torch.tensor([at(r, -2) for r in sampled]),
        last_timestamp=torch.tensor([s[-1] if s else -1 for s in stamps]),
        timestamps=torch.tensor([timestamps] * len(sampled)),
        min_tokens=torch.zeros(len(sampled), dtype=torch.long),
    )


def rules(tok, max_initial_index=50):
    return ApplyTimestampRules(tok, 51864, max_initial_index, torch.device("cpu"))


def flat_logits(rows: int) -> torch.Tensor:
    """Text slightly likelier than any single timestamp, but not than all of them together."""
    logits = torch.zeros(rows, 51864)
    logits[:, :50256] = 0.5
    return logits


def ts(tok, seconds: float) -> int:
    return tok.timestamp_begin + round(seconds / 0.02)


def test_first_token_is_a_timestamp_within_the_initial_limit(tok):
    logits = flat_logits(1)
    rules(tok).apply(logits, state(tok, [[]]))
    allowed = (logits[0] > NEG).nonzero()[:, 0]
    assert allowed.min() == tok.timestamp_begin and allowed.max() == tok.timestamp_begin + 50


def test_after_a_lone_timestamp_comes_a_timestamp_or_the_end(tok):
    hello = tok.encode(" hello")
    logits = torch.zeros(1, 51864)
    logits[0, tok.eot] = 10.0  # likelier than all timestamps together: not forced to one
    rules(tok).apply(logits, state(tok, [[ts(tok, 0), *hello, ts(tok, 1.0)]]))
    allowed = (logits[0] > NEG).nonzero()[:, 0]
    assert tok.eot in allowed and not (allowed < tok.eot).any()
    assert allowed[allowed >= tok.timestamp_begin].min() == ts(tok, 1.0)  # closing may repeat it


def test_after_a_pair_comes_text(tok):
    logits = torch.zeros(1, 51864)
    hello = tok.encode(" hello")
    rules(tok).apply(logits, state(tok, [[ts(tok, 0), *hello, ts(tok, 1.0), ts(tok, 1.0)]]))
    assert (logits[0, tok.timestamp_begin :] == NEG).all()
    assert (logits[0, : tok.eot] > NEG).any()


def test_timestamps_never_go_back(tok):
    logits = torch.zeros(1, 51864)
    sampled = [ts(tok, 0), *tok.encode(" a"), ts(tok, 2.0), ts(tok, 2.0), *tok.encode(" b")]
    rules(tok).apply(logits, state(tok, [sampled]))
    assert (logits[0, tok.timestamp_begin : ts(tok, 2.0) + 1] == NEG).all()
    assert logits[0, ts(tok, 2.02)] > NEG


def test_timestamps_win_when_together_likelier_than_any_text(tok):
    logits = torch.zeros(1, 51864)
    logits[0, 100] = 3.0  # one text token, less likely than 1501 timestamps at 0 together
    rules(tok).apply(logits, state(tok, [[ts(tok, 0), *tok.encode(" a")]]))
    assert (logits[0, : tok.timestamp_begin] == NEG).all()


def test_rows_without_timestamps_only_lose_nothing(tok):
    logits = torch.zeros(2, 51864)
    s = state(tok, [[], []])
    s.timestamps = torch.tensor([True, False])
    rules(tok).apply(logits, s)
    assert (logits[1] == 0).all() and (logits[0, : tok.timestamp_begin] == NEG).all()


def test_suppress_blank_only_at_the_first_step(tok):
    logits = torch.zeros(2, 51864)
    blank = tok.encode(" ") + [tok.eot]
    SuppressBlank(blank, torch.device("cpu")).apply(logits, state(tok, [[], [42]]))
    assert (logits[0, blank] == NEG).all() and (logits[1, blank] == 0).all()


def test_suppress_tokens_every_step(tok):
    logits = torch.zeros(2, 51864)
    SuppressTokens([5, 7], 51864, torch.device("cpu")).apply(logits, state(tok, [[], [42]]))
    assert (logits[:, [5, 7]] == NEG).all() and (logits[:, 6] == 0).all()


def test_prompt_tokens_layout(tok):
    plain = prompt_tokens(tok, WindowTask(language="en", timestamps=False), 448)
    assert plain == [tok.sot, tok.no_timestamps]
    prev = tuple(range(300))
    prompted = prompt_tokens(tok, WindowTask(language="en", prompt=prev), 448)
    assert prompted[0] == tok.sot_prev and prompted[1:-1] == list(range(300 - 223, 300))
    assert prompted[-1] == tok.sot  # timestamps: no <|notimestamps|>


def result(avg_logprob=-0.2, no_speech=0.1, ratio=1.5) -> WindowResult:
    return WindowResult([], "", avg_logprob, no_speech, ratio, 0.0)


def test_fallback_and_silence_rules():
    o = TranscriptionOptions()
    assert not o.needs_fallback(result())
    assert o.needs_fallback(result(ratio=2.5))  # too repetitive
    assert o.needs_fallback(result(avg_logprob=-1.5))  # too improbable
    assert not o.needs_fallback(result(avg_logprob=-1.5, no_speech=0.9))  # silence
    assert o.is_silence(result(avg_logprob=-1.5, no_speech=0.9))
    assert not o.is_silence(result(avg_logprob=-0.5, no_speech=0.9))  # confident text stays


def test_split_segments(tok):
    w = Window(seek=1000, size=3000, mel=torch.zeros(0))
    a, b = tok.encode(" a"), tok.encode(" b")
    paired = [ts(tok, 0), *a, ts(tok, 1.0), ts(tok, 1.0), *b, ts(tok, 2.0)]
    segments, advance = split_segments(paired, tok, w)
    assert [(s, e) for s, e, _ in segments] == [(10.0, 11.0), (11.0, 12.0)]
    assert advance == 3000  # ends on a lone timestamp: nothing after it
    unfinished = [ts(tok, 0), *a, ts(tok, 1.0), ts(tok, 1.0), *b]
    segments, advance = split_segments(unfinished, tok, w)
    assert len(segments) == 1 and advance == 100  # seek back to 1.0 s
    no_pairs = [ts(tok, 0), *a, ts(tok, 4.0)]
    segments, advance = split_segments(no_pairs, tok, w)
    assert segments == [(10.0, 14.0, no_pairs)] and advance == 3000


def test_rows_whose_last_tokens_repeat_are_marked_for_the_hosts_check():
    from engine.decoding import REPEAT_RUN, SlotState

    rows = {
        "one token, 9 times": [5] * (REPEAT_RUN + 1),
        "one token, 8 times: nothing before the run to compare": [5] * REPEAT_RUN,
        "a 3-token phrase, 4 times": [1, 2, 3] * 4,
        "a 32-token phrase, twice and a run": [*range(100, 132), *range(100, 108)],
        "a 33-token phrase, twice and a run": [*range(100, 133), *range(100, 108)],
        "no repetition": list(range(20)),
        "a run, then something new": [5] * 20 + [6],
    }
    state = SlotState.allocate(len(rows), 64, eot=0, device=torch.device("cpu"))
    for i, tokens in enumerate(rows.values()):
        state.sampled[i, : len(tokens)] = torch.tensor(tokens)
        state.n_sampled[i] = len(tokens)
    marked = dict(zip(rows, state.repeating(len(rows)).tolist(), strict=True))
    assert marked == {
        "one token, 9 times": True,
        "one token, 8 times: nothing before the run to compare": False,
        "a 3-token phrase, 4 times": True,
        "a 32-token phrase, twice and a run": True,
        "a 33-token phrase, twice and a run": False,
        "no repetition": False,
        "a run, then something new": False,
    }
