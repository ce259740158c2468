"""Decoding real speech from every supported container, and refusing what is not audio."""

import io

import numpy as np
import pytest
import soundfile as sf

from engine.audio import SAMPLE_RATE, AudioError, decode_audio, resample

FORMATS = {
    "WAV": {},
    "FLAC": {},
    "OGG": {"subtype": "VORBIS"},
    "MP3": {"subtype": "MPEG_LAYER_III"},
}


def encode(samples: np.ndarray, rate: int, fmt: str) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format=fmt, **FORMATS[fmt])
    return buf.getvalue()


@pytest.fixture(scope="module")
def jfk(clips) -> np.ndarray:
    return decode_audio(clips["en_jfk"].bytes)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_container_decodes_to_the_same_speech(jfk, fmt):
    decoded = decode_audio(encode(jfk, SAMPLE_RATE, fmt))
    assert decoded.dtype == np.float32 and decoded.ndim == 1
    # MP3 adds encoder delay/padding; lossy codecs change samples but not duration or energy.
    assert abs(len(decoded) - len(jfk)) < 0.1 * SAMPLE_RATE
    assert np.std(decoded) == pytest.approx(np.std(jfk), rel=0.1)


def test_stereo_is_averaged_to_mono(jfk):
    stereo = np.stack([jfk, np.zeros_like(jfk)], axis=1)
    decoded = decode_audio(encode(stereo, SAMPLE_RATE, "WAV"))
    np.testing.assert_allclose(decoded, jfk / 2, atol=1e-4)


@pytest.mark.parametrize("rate", [8000, 22050, 44100, 48000])
def test_other_rates_are_resampled_to_16k(jfk, rate):
    original = resample(jfk, SAMPLE_RATE, rate)
    decoded = decode_audio(encode(original, rate, "WAV"))
    assert abs(len(decoded) - len(jfk)) <= 1
    band_limit = min(rate, SAMPLE_RATE) / 2
    if band_limit >= SAMPLE_RATE / 2:  # nothing of the original band was lost
        err = np.abs(decoded[1000:-1000] - jfk[1000:-1000]).max()
        assert err < 0.02


def test_resample_keeps_a_tone():
    t = np.arange(44100) / 44100
    tone = np.sin(2 * np.pi * 1000 * t).astype(np.float32)
    out = resample(tone, 44100)
    expected = np.sin(2 * np.pi * 1000 * np.arange(len(out)) / SAMPLE_RATE)
    assert len(out) == 16000
    assert np.abs(out[100:-100] - expected[100:-100]).max() < 1e-3


def test_clipping_and_silence_decode(jfk):
    loud = np.clip(jfk * 50, -1, 1)
    assert np.abs(decode_audio(encode(loud, SAMPLE_RATE, "WAV"))).max() <= 1.0
    silent = decode_audio(encode(np.zeros(SAMPLE_RATE, np.float32), SAMPLE_RATE, "FLAC"))
    assert not silent.any()


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "empty"),
        (b"hello, this is not audio at all" * 10, "could not decode"),
        (b"RIFF\x00\x00\x00\x00WAVEjunkjunkjunk", "could not decode"),
    ],
)
def test_not_audio_is_refused_with_what_was_expected(data, message):
    with pytest.raises(AudioError, match=message) as e:
        decode_audio(data)
    assert "expected WAV, FLAC, OGG or MP3" in str(e.value)


@pytest.mark.parametrize("fmt", FORMATS)
def test_truncated_files_are_refused(jfk, fmt):
    data = encode(jfk, SAMPLE_RATE, fmt)
    with pytest.raises(AudioError, match="truncated|could not decode"):
        decode_audio(data[: len(data) // 2])


def test_zero_samples_are_refused():
    with pytest.raises(AudioError, match="no samples"):
        decode_audio(encode(np.zeros(0, np.float32), SAMPLE_RATE, "WAV"))


def test_nan_samples_are_refused():
    samples = np.zeros(1000, np.float32)
    samples[10] = np.nan
    buf = io.BytesIO()
    sf.write(buf, samples, SAMPLE_RATE, format="WAV", subtype="FLOAT")
    with pytest.raises(AudioError, match="NaN"):
        decode_audio(buf.getvalue())
