"""Sampling depends on the input alone: its seed, the window, the attempt and the step, never on
the batch around it, the slot it sits in or what the stream ran before (issue 12, finding 5)."""

import numpy as np
import pytest
import torch

from engine import OptionsError, TranscriptionOptions
from engine.audio import decode_audio
from engine.sampling import draw, gumbel, gumbel_from_bits, window_key
from tests.conftest import open_stream, transcribe

SAMPLED = TranscriptionOptions(temperature=(0.6,), seed=7)
# every window falls back (any text is "too repetitive" here) and is decoded again at 0.6
FALLBACK = TranscriptionOptions(temperature=(0.0, 0.6), compression_ratio_threshold=0.0, seed=3)
GREEDY = TranscriptionOptions(temperature=(0.0,))
OTHERS = ["en_librispeech_1272-128104-0000", "en_ljspeech_LJ050-0131"]


def tokens(transcription) -> list[list[int]]:
    return [s.tokens for s in transcription.segments]


def run(stream, jobs: list[tuple[bytes, TranscriptionOptions]]) -> list[list[list[int]]]:
    """Each job's tokens, all submitted to `stream` together, in this order."""
    for i, (data, options) in enumerate(jobs):
        stream.submit(i, stream.prepare(data), options)
    results = {}
    while stream.busy:
        results.update((f.owner, tokens(f.transcription)) for f in stream.step())
    return [results[i] for i in range(len(jobs))]


def test_draws_follow_the_tempered_distribution():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 40_000
    keys = torch.tensor([window_key(7, seek, 0) for seek in range(n)])
    for temperature in (1.0, 0.5):
        drawn = draw(
            p.log().expand(n, -1).contiguous(),
            torch.full((n,), temperature),
            keys,
            torch.zeros(n, dtype=torch.long),
        )
        expected = p ** (1 / temperature) / (p ** (1 / temperature)).sum()
        seen = torch.bincount(drawn, minlength=4) / n
        assert torch.allclose(seen, expected, atol=0.01), (temperature, seen, expected)


def test_the_noise_is_finite_for_every_bit_pattern():
    """The extreme patterns stand for the extreme uniforms, which must stay inside (0, 1): at 1.0
    the noise is infinite, and added to a token every rule forbids (-inf) it made NaN, which
    argmax picks."""
    bits = torch.tensor([0, 1, 2**31, 2**32 - 512, 2**32 - 1])
    noise = gumbel_from_bits(bits)
    assert torch.isfinite(noise).all()
    assert noise[-1] > noise[2] > noise[0]


def test_windows_that_fall_back_sample_only_what_the_rules_allow(tiny_en, clips):
    """Reversed speech: tiny.en's greedy text fails the fallback's checks, and the window is
    sampled at every temperature up to 1.0 (about 1,000 draws). Before the noise was kept
    finite, a draw here took a text token right after a lone timestamp, whose log-probability
    (-inf) became the window's average."""
    names = ["en_jfk", "en_librispeech_1272-128104-0000", "en_ljspeech_LJ050-0131"]
    reversed_speech = np.concatenate([decode_audio(clips[n].bytes)[::-1] for n in names])
    begin = tiny_en.engine.loaded.tokenizer.timestamp_begin
    segments = transcribe(tiny_en, reversed_speech, TranscriptionOptions(seed=0)).segments
    assert {(s.temperature, s.avg_logprob) for s in segments} == {(1.0, segments[0].avg_logprob)}
    assert np.isfinite(segments[0].avg_logprob)
    stamps = [t >= begin for s in segments for t in s.tokens]
    lone_then_text = [
        i for i in range(2, len(stamps)) if stamps[i - 1] and not stamps[i - 2] and not stamps[i]
    ]
    assert stamps[0] and not lone_then_text


def test_a_rows_noise_is_its_own():
    keys = torch.tensor([window_key(1, 0, 0), window_key(1, 0, 1), window_key(2, 0, 0)])
    steps = torch.tensor([0, 0, 5])
    together = gumbel(keys, steps, 51864)
    for row in range(3):
        alone = gumbel(keys[row : row + 1], steps[row : row + 1], 51864)[0]
        assert torch.equal(alone, together[row])
    decodes = [(seed, seek, a) for seed in (0, 1, 2**62) for seek in (0, 3000) for a in (0, 1)]
    assert len({window_key(*decode) for decode in decodes}) == len(decodes)


def test_a_sampled_input_draws_the_same_tokens_in_any_company(tiny_en, clips):
    jfk, others = clips["en_jfk"].bytes, [clips[n].bytes for n in OTHERS]
    alone = tokens(transcribe(tiny_en, jfk, SAMPLED))
    fallback = transcribe(tiny_en, jfk, FALLBACK)
    assert {s.temperature for s in fallback.segments} == {0.6}
    # other work on the stream first, then batches of other sizes, orders, options and seeds
    tiny_en.transcribe(others, TranscriptionOptions(temperature=(1.0,), seed=11))
    batches = [
        [(others[0], GREEDY), (jfk, SAMPLED)],
        [(jfk, SAMPLED), (others[1], FALLBACK), (others[0], SAMPLED), (jfk, FALLBACK)],
        [(others[1], TranscriptionOptions(temperature=(1.0,))), (jfk, FALLBACK), (jfk, SAMPLED)],
    ]
    for batch in batches:
        for (data, options), got in zip(batch, run(tiny_en, batch), strict=True):
            if data is jfk:
                assert got == (alone if options is SAMPLED else tokens(fallback)), batch
    # fewer slots than inputs: windows wait and join later, in other slots, and compact
    narrow = open_stream("tiny.en", slots=2)
    got = run(narrow, [(others[0], SAMPLED), (others[1], GREEDY), (jfk, FALLBACK), (jfk, SAMPLED)])
    assert got[2] == tokens(fallback) and got[3] == alone


def test_other_seeds_draw_other_tokens(tiny_en, clips):
    jfk = clips["en_jfk"].bytes
    hot = [TranscriptionOptions(temperature=(1.0,), seed=seed) for seed in range(4)]
    drawn = [tokens(transcribe(tiny_en, jfk, options)) for options in hot]
    assert len({str(t) for t in drawn}) > 1
    assert drawn[0] == tokens(transcribe(tiny_en, jfk, hot[0]))  # and the same seed the same


def test_a_seed_out_of_range_is_refused_before_work(tiny_en, clips):
    for seed in (-1, 2**63):
        with pytest.raises(OptionsError, match=f"seed {seed}: expected 0 <= seed < 2\\*\\*63"):
            transcribe(tiny_en, clips["en_jfk"].bytes, TranscriptionOptions(seed=seed))
