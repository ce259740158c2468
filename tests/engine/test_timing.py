"""Word timestamps (engine.timing): the path search and the word rules against openai-whisper's,
and the words of real speech against transformers' own on the same weights."""

import dataclasses
import gc
import weakref

import numpy as np
import pytest
import torch

from engine import timing
from engine.kernels.dtw import dtw
from engine.kernels.median import median_filter
from engine.options import TranscriptionOptions
from engine.timing import (
    WordTiming,
    alignment_heads,
    merge_punctuation,
    split_words,
)
from tests.conftest import long_speech, open_stream, transcribe
from tools.evaluate import Clip as ManifestClip
from tools.word_timing import OPTIONS, compare, pooled

WORDS = TranscriptionOptions(word_timestamps=True)


def openai_dtw(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """openai-whisper's dtw_cpu and backtrace, cell by cell."""
    n, m = x.shape
    cost = np.full((n + 1, m + 1), np.inf)
    trace = -np.ones((n + 1, m + 1))
    cost[0, 0] = 0
    for j in range(1, m + 1):
        for i in range(1, n + 1):
            c0, c1, c2 = cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1]
            if c0 < c1 and c0 < c2:
                c, t = c0, 0
            elif c1 < c0 and c1 < c2:
                c, t = c1, 1
            else:
                c, t = c2, 2
            cost[i, j] = x[i - 1, j - 1] + c
            trace[i, j] = t
    trace[0, :], trace[:, 0] = 2, 1
    i, j, path = n, m, []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        i, j = {0: (i - 1, j - 1), 1: (i - 1, j), 2: (i, j - 1)}[trace[i, j]]
    return tuple(np.array(path[::-1]).T)


@pytest.mark.parametrize("shape", [(1, 1), (1, 7), (7, 1), (12, 40), (30, 90), (25, 25)])
def test_the_path_search_finds_openai_whispers_path(shape):
    rng = np.random.default_rng(sum(shape))
    for _ in range(5):
        x = rng.normal(size=shape)
        ours, theirs = dtw(x), openai_dtw(x)
        assert np.array_equal(ours[0], theirs[0]) and np.array_equal(ours[1], theirs[1])


def test_the_median_filter_reflects_at_the_edges():
    x = torch.randn(2, 3, 20, generator=torch.Generator().manual_seed(0))
    padded = np.pad(x.numpy(), ((0, 0), (0, 0), (3, 3)), mode="reflect")
    windows = np.lib.stride_tricks.sliding_window_view(padded, 7, axis=-1)
    assert np.allclose(median_filter(x, 7).numpy(), np.median(windows, axis=-1))
    short = torch.randn(1, 1, 3)
    assert torch.equal(median_filter(short, 7), short)  # too short to filter


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_pass_weighs_each_window_as_it_would_alone(device):
    """The pass's windows padded to the longest, in one set of operations: each window's
    weights as openai-whisper's steps give them for it alone, whatever its tokens and frames
    (three and fewer frames: too few to reflect, left unfiltered); on CUDA with the median
    filter's kernel."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    g = torch.Generator().manual_seed(3)
    rows, frames = [12, 7, 5, 9, 2], [40, 17, 3, 2, 4]
    qk = torch.randn(len(rows), 3, max(rows), 50, generator=g) * 4
    qk[1, :, 7:] = float("nan")  # past a window's tokens: never read
    on = torch.device(device)
    sizes = (torch.tensor(rows, device=on), torch.tensor(frames, device=on))
    batched = timing.alignment_weights(qk.to(on), *sizes, max(frames), device == "cuda").cpu()
    for k, (n, f) in enumerate(zip(rows, frames, strict=True)):
        a = qk[k, :, :n, :f].softmax(dim=-1)
        std, mean = torch.std_mean(a, dim=-2, keepdim=True, unbiased=False)
        alone = median_filter((a - mean) / std, 7).mean(dim=0)
        torch.testing.assert_close(batched[k, :n, :f], alone, rtol=1e-5, atol=1e-5)


def test_an_alignment_pass_spells_its_attention_out(tiny_en, monkeypatch):
    """A pass that keeps cross-attention weights (word timestamps') has sizes of its own each
    time, so its attention is plain products and a softmax, never the fused kernel (on Hopper
    torch prefers cuDNN's, which builds a plan for each new shape): the fused pass's logits."""
    from engine.model import CrossWeights, KVCache

    m = tiny_en.engine.loaded
    d, g = m.dims, torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 1000, (3, 9), generator=g)
    positions = torch.arange(9).expand(3, -1)
    cache = KVCache.allocate(d, 3, "cpu", m.dtype, text_ctx=9)
    cache.cross_k.normal_(generator=g), cache.cross_v.normal_(generator=g)
    fused = m.model.decoder(tokens, positions, slice(0, 3), cache, 9)

    def refused(*args, **kwargs):
        raise AssertionError("the fused attention in an alignment pass")

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", refused)
    weights = CrossWeights(timing.alignment_heads(m))
    spelt = m.model.decoder(tokens, positions, slice(0, 3), cache, 9, weights=weights)
    torch.testing.assert_close(spelt, fused, rtol=1e-4, atol=1e-4)
    assert len(weights.qk) == len(weights.heads)


def test_a_pass_reads_each_text_tokens_probability_as_it_would_alone():
    g = torch.Generator().manual_seed(4)
    eot, width = 30, 9
    logits = torch.randn(3, width, 32, generator=g)
    tokens = torch.randint(0, eot + 2, (3, width), generator=g)
    ours = timing.token_probabilities(logits, tokens, eot)
    for k in range(3):
        for r in range(width - 1):
            if tokens[k, r + 1] < eot:
                alone = logits[k, r, :eot].softmax(dim=-1)[tokens[k, r + 1]]
                torch.testing.assert_close(ours[k, r], alone)


def test_words_split_at_spaces_and_keep_their_punctuation(tiny_en):
    tok = tiny_en.engine.loaded.tokenizer
    tokens = tok.encode(' "Well," she said (quietly), it\'s done.')
    words, groups = split_words(tok, tokens + [tok.eot], "en")
    assert "".join(words) == ' "Well," she said (quietly), it\'s done.'
    assert sum(map(len, groups)) == len(tokens) + 1 and words[-1] == ""  # end-of-text
    timed = [
        WordTiming(w, g, float(i), i + 1.0, 1.0)
        for i, (w, g) in enumerate(zip(words, groups, strict=False))
    ]
    merged = [t.word for t in merge_punctuation(timed) if t.word]
    assert merged == [' "Well,"', " she", " said", " (quietly),", " it's", " done."]
    cut = tok.encode(" 日本語 text")[1:]  # a segment may start inside a character's bytes
    words, groups = split_words(tok, cut, "en")
    assert "".join(words) == tok.decode(cut) and sum(map(len, groups)) == len(cut)


def test_the_alignment_heads_are_the_models_own_or_the_upper_half(tiny_en):
    assert alignment_heads(tiny_en.engine.loaded) == {1: [0], 2: [0, 5], 3: [0, 1, 2, 3, 4]}
    random = open_stream("random:tiny")  # 4 layers of 6 heads, no list of its own
    assert alignment_heads(random.engine.loaded) == {2: list(range(6)), 3: list(range(6))}


@pytest.fixture(scope="module")
def compared(tiny_en, english_clips):
    clips = [
        ManifestClip(c.path.name, c.path, c.reference, c.language, c.duration)
        for c in english_clips
    ]
    return compare(tiny_en, clips)


def test_the_words_are_transformers_words_at_nearly_the_same_times(compared):
    """transformers' `return_timestamps="word"` on the same weights and alignment heads: the
    same words; starts, and the ends of words inside a phrase, within 0.1 s on average and
    0.3 s for 95% of words. A phrase's last word ends where the speech does here, as in
    openai-whisper, and no later than in transformers, which merges the punctuation after it
    with its time, the pause included (docs/accuracy.md)."""
    assert compared and all(r.same_words for r in compared), [(r.ours, r.theirs) for r in compared]
    gaps = pooled(compared)
    for kind in ("start", "end"):
        assert gaps[kind].mean() <= 0.1 and np.quantile(gaps[kind], 0.95) <= 0.3, kind
    for r in compared:
        for ours, theirs in zip(r.ours, r.theirs, strict=True):
            if ours[0].strip().endswith((".", ",", "!", "?")):
                assert ours[2] <= theirs[2] + 0.1, (r.file, ours, theirs)


def test_a_windows_words_are_the_same_alone_or_batched(tiny_en, clips, monkeypatch):
    """The pass over several windows at once gives each window what it gives it alone, and
    so do passes split to bound their memory."""
    jfk = clips["en_jfk"].bytes
    alone = transcribe(tiny_en, jfk, OPTIONS).words
    others = [clips["en_librispeech_1272-128104-0000"].bytes, clips["fr_fleurs_000"].bytes]
    batch = [others[0], jfk, jfk, others[1]]  # the two copies finish in the same step
    together = tiny_en.transcribe(batch, OPTIONS)
    assert together[1].words == together[2].words == alone
    monkeypatch.setattr(timing, "PASS_BYTES", 1)  # a window a pass
    assert tiny_en.transcribe(batch, OPTIONS) == together


def test_an_input_aborted_while_its_words_are_timed_never_comes_back(tiny_en, clips):
    """A window's words are timed in a pass the stream takes a step later: an input aborted
    in between is dropped then, and the others' words are what they are alone. (The first
    clip's 17 words end before JFK's 22.)"""
    other = clips["en_jfk"].bytes
    tiny_en.submit("gone", tiny_en.prepare(clips["en_librispeech_1272-128104-0000"].bytes), OPTIONS)
    tiny_en.submit("kept", tiny_en.prepare(other), OPTIONS)
    before = tiny_en.stats.timed
    while tiny_en.stats.timed == before:  # a pass launched: its windows wait for the next step
        assert tiny_en.step() == []
    assert tiny_en.abort("gone")
    finished = []
    while tiny_en.busy:
        finished += tiny_en.step()
    assert [f.owner for f in finished] == ["kept"]
    assert finished[0].transcription.words == transcribe(tiny_en, other, OPTIONS).words


def test_a_pass_timing_only_aborted_inputs_lets_go_of_its_copies(tiny_en, clips, monkeypatch):
    """Once every input is aborted the stream is idle, and nobody steps it: the pass it
    launched holds pinned copies of the slots' keys and values, which go with the last abort."""
    passes = []

    def launch(aligner, cache, windows):
        pending = launched(aligner, cache, windows)
        passes.append(weakref.ref(pending))
        return pending

    launched = timing.Aligner.launch
    monkeypatch.setattr(timing.Aligner, "launch", launch)
    tiny_en.submit("gone", tiny_en.prepare(clips["en_jfk"].bytes), OPTIONS)
    while not passes:  # a pass launched: its windows wait for the next step
        assert tiny_en.step() == []
    assert passes[0]() is not None
    assert tiny_en.abort("gone") and not tiny_en.busy
    gc.collect()
    assert passes[0]() is None


@pytest.mark.parametrize("mode", ["sequential", "chunked"])
def test_the_words_of_long_audio_follow_the_segments_they_are_in(tiny_en, mode):
    """Three windows and more: each segment's words spell its text, in order, inside it."""
    audio = long_speech(66)
    result = transcribe(tiny_en, audio, dataclasses.replace(WORDS, mode=mode))
    assert result.words == [w for s in result.segments for w in s.words]
    assert result.words[-1].end > 60
    previous = 0.0
    for s in result.segments:
        assert "".join(w.word for w in s.words).strip() == s.text.strip()
        for w in s.words:
            assert previous <= w.start <= w.end and s.start - 0.01 <= w.start
            assert w.end <= s.end + 0.01 and 0 <= w.probability <= 1
            previous = w.start
    assert previous <= result.duration


def test_without_the_option_there_are_no_words(tiny_en, clips):
    result = transcribe(tiny_en, clips["en_jfk"].bytes)
    assert result.words is None and all(s.words is None for s in result.segments)
    worded = transcribe(tiny_en, clips["en_jfk"].bytes, WORDS)
    assert worded.text == result.text  # the words change no text


def test_words_without_segment_timestamps(tiny_en, clips):
    result = transcribe(
        tiny_en, clips["en_jfk"].bytes, dataclasses.replace(WORDS, timestamps=False)
    )
    assert [w.word for w in result.words][-1].strip() == "country."
    assert result.words[0].start < 1.0 and 10.0 < result.words[-1].end <= result.duration


def test_a_forced_aligners_textgrid_pairs_with_the_words_spelt_alike(tmp_path):
    """The check against forced alignments (scripts/word_timestamps_check.py --textgrids)
    reads Praat's short TextGrids, UTF-16 as Praat may write them, and pairs words by
    spelling, whatever their case and punctuation."""
    from tools.word_timing import against_alignment, textgrid_words

    grid = "\n".join(
        ['File type = "ooTextFile"', 'Object class = "TextGrid"', "", "0", "3.0", "<exists>"]
        + ["1", '"IntervalTier"', '"words"', "0", "3.0", "4"]
        + ["0", "0.5", '""', "0.5", "1.1", '"mister"', "1.1", "2.0", '"quilter"']
        + ["2.0", "3.0", '"spoke"']
    )
    (tmp_path / "a.TextGrid").write_text(grid, encoding="utf-16")
    truth = textgrid_words(tmp_path / "a.TextGrid")
    assert truth == [("mister", 0.5, 1.1), ("quilter", 1.1, 2.0), ("spoke", 2.0, 3.0)]
    ours = [(" Mr.", 0.4, 1.0), (" Quilter,", 1.0, 2.1), (" spoke.", 2.1, 2.9)]
    compared = against_alignment("a", ours, truth)
    assert compared.same_words and compared.ours == ours[1:]
    gaps = compared.gaps()
    assert gaps["start"] == pytest.approx([0.1, 0.1]) and gaps["end of phrase"] == pytest.approx(
        [0.1, 0.1]
    )
    (tmp_path / "b.TextGrid").write_text(grid.replace('"words"', '"phones"'))
    assert textgrid_words(tmp_path / "b.TextGrid") is None
