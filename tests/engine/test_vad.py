"""Voice activity (engine.vad): the wheel's own model, batched, gives its probabilities."""

import warnings

import numpy as np
import pytest
import torch
from silero_vad import get_speech_timestamps, load_silero_vad

from engine import vad
from engine.audio import decode_audio


@pytest.fixture(scope="module")
def reference():
    return load_silero_vad()


def silero_probabilities(model, samples: np.ndarray) -> np.ndarray:
    """The wheel's own loop: one 32 ms chunk a call, the last zero-padded."""
    model.reset_states()
    out = []
    with torch.inference_mode():
        for i in range(0, len(samples), vad.CHUNK):
            chunk = samples[i : i + vad.CHUNK]
            chunk = np.pad(chunk, (0, vad.CHUNK - len(chunk)))
            out.append(model(torch.from_numpy(chunk), 16000).item())
    return np.array(out)


def test_probabilities_and_regions_are_the_wheels_own(reference, clips):
    for clip in clips.values():
        samples = decode_audio(clip.bytes)
        ours = vad.speech_probabilities(samples)
        np.testing.assert_allclose(ours, silero_probabilities(reference, samples), atol=1e-4)
        theirs = get_speech_timestamps(
            torch.from_numpy(samples), reference, return_seconds=True, time_resolution=3
        )
        regions = vad.speech_regions(ours, len(samples) / 16000)
        assert regions, clip.path.name
        assert np.array(regions) == pytest.approx(
            np.array([(t["start"], t["end"]) for t in theirs]), abs=1e-3
        )


def test_fed_in_blocks_of_any_size_equals_fed_whole(clips):
    samples = decode_audio(clips["en_jfk"].bytes)
    detector = vad.Detector()
    for start in range(0, len(samples), 7777):  # not a multiple of the chunk
        detector.feed(samples[start : start + 7777])
    np.testing.assert_allclose(detector.finish(), vad.speech_probabilities(samples), atol=1e-6)


@pytest.mark.requires_cuda
def test_on_a_gpu_blocks_sent_there_give_the_cpus_probabilities(clips, monkeypatch):
    """A first pass sends each 131 s block to the device once, for its log-mel and for Silero
    (`engine.inputs`): fed those device tensors, the detector gives the probabilities of the
    CPU fed arrays, over minutes of speech and silence. As they run they were up to 7e-3 off
    on an H100 (2026-12-07), most likely cuDNN multiplying in TF32 (torch's default for its
    LSTM and convolutions): with TF32 off they must agree to 1e-3, and with it on the same
    regions must come of them."""
    names = ("en_jfk", "en_librispeech_1272-128104-0000", "en_ljspeech_LJ050-0131")
    speech = [decode_audio(clips[n].bytes) for n in names]
    samples = np.concatenate([*speech, np.zeros(16000 * 40, np.float32)] * 4)  # 4.3 minutes
    expected = vad.speech_probabilities(samples)
    step = vad.BLOCK_CHUNKS * vad.CHUNK

    def on_gpu() -> np.ndarray:
        detector = vad.Detector("cuda")
        for start in range(0, len(samples), step):
            detector.feed(torch.from_numpy(samples[start : start + step]).to("cuda"))
        return detector.finish()

    as_run = on_gpu()
    with monkeypatch.context() as fp32:
        fp32.setattr(torch.backends.cudnn, "allow_tf32", False)
        exact = on_gpu()
    assert len(exact) == len(as_run) == len(expected)
    assert np.abs(exact - expected).max() < 1e-3
    seconds = len(samples) / 16000
    regions = vad.speech_regions(expected, seconds)
    assert len(regions) >= 12  # each of the 12 clips holds speech
    assert np.array(vad.speech_regions(as_run, seconds)) == pytest.approx(
        np.array(regions), abs=vad.CHUNK / 16000
    )


def test_silence_and_room_tone_hold_no_speech():
    rng = np.random.default_rng(0)
    for samples in (
        np.zeros(16000 * 20, np.float32),
        (rng.standard_normal(16000 * 20) * 3e-3).astype(np.float32),
    ):
        assert vad.regions_of(samples) == []


def test_speech_among_silence_is_found_where_it_is(clips):
    speech = decode_audio(clips["en_librispeech_1272-128104-0000"].bytes)
    alone = vad.regions_of(speech)
    padded = np.concatenate([np.zeros(16000 * 10, np.float32), speech, np.zeros(16000 * 5)])
    [(start, end)] = vad.regions_of(padded.astype(np.float32))
    assert start == pytest.approx(10 + alone[0][0], abs=0.1)
    assert end == pytest.approx(10 + alone[-1][1], abs=0.1)


def test_loading_the_wheels_model_warns_of_nothing():
    """torch deprecates reading TorchScript, the one form of the weights the wheel ships
    that torch reads: not a warning for a user of ours to act on."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        vad.load.__wrapped__()
    assert not [str(w.message) for w in caught]


def test_clips_together_are_each_alone(clips):
    """Several clips in one pass (the stream's, for the clips that ask): each one's
    probabilities as if it were alone, the shorter ones' padding read by none."""
    samples = [decode_audio(c.bytes) for c in clips.values()]
    samples += [samples[0][:1000], np.zeros(0, np.float32)]
    together = vad.clip_probabilities(samples)
    for x, probs in zip(samples, together, strict=True):
        np.testing.assert_allclose(probs, vad.speech_probabilities(x), atol=1e-5)


def silero_stretches(probs: np.ndarray, duration: float, options: vad.VadOptions) -> list:
    """`get_speech_timestamps`' loop, chunk by chunk, to the stretches of speech it finds."""
    chunk_s, threshold = vad.CHUNK / 16000, options.threshold
    neg = options.neg_threshold if options.neg_threshold is not None else threshold - 0.15
    found, start, quiet_since = [], None, None
    for i, p in enumerate(probs.tolist()):
        t = i * chunk_s
        if p >= threshold:
            quiet_since = None
            if start is None:
                start = t
        elif start is not None and p < neg:
            if quiet_since is None:
                quiet_since = t
            if t - quiet_since >= options.min_silence_s:
                found.append([start, quiet_since])
                start, quiet_since = None, None
    if start is not None:
        found.append([start, duration])
    return found


@pytest.mark.parametrize(
    "options",
    [vad.VadOptions(), vad.VadOptions(threshold=0.6, neg_threshold=0.3, min_silence_s=0.2)],
)
def test_speech_found_run_by_run_is_the_chunk_by_chunk_loops(options):
    """Probabilities in runs of speech, silence and in between (which changes nothing),
    jittered around the thresholds: the same stretches as Silero's loop."""
    rng = np.random.default_rng(1)
    for _ in range(1500):
        n = int(rng.integers(0, 300))
        levels = rng.choice([0.05, 0.2, 0.3, 0.45, 0.5, 0.6, 0.97], size=n // 4 + 1)
        probs = np.repeat(levels, rng.integers(1, 8, size=len(levels)))[:n]
        probs = (probs + rng.normal(0, 0.03, size=len(probs))).astype(np.float32)
        duration = n * vad.CHUNK / 16000 + rng.uniform(0, 0.03)
        found = vad.stretches(probs, duration, options)
        assert found == silero_stretches(probs, duration, options)
        assert all(type(x) is float for r in found for x in r)


def test_voiced_seconds_counts_the_speech_inside():
    rng = np.random.default_rng(2)
    probs = (rng.random(3000) ** 3).astype(np.float32)
    regions = vad.speech_regions(probs, 96.0)
    assert len(regions) > 20
    inside = [(s + 0.75 * (e - s), s + 0.25 * (e - s)) for s, e in regions[:5]]  # backwards
    for start, end in [*rng.uniform(-5, 100, size=(500, 2)), *inside]:
        overlap = sum(max(0.0, min(e, end) - max(s, start)) for s, e in regions)
        assert vad.voiced_seconds(regions, start, end) == pytest.approx(overlap, abs=1e-9)
