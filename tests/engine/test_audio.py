"""Decoding real speech from every supported container, and refusing what is not audio."""

import io
import subprocess
import sys

import av
import numpy as np
import pytest
import soundfile as sf

from engine.audio import SAMPLE_RATE, Audio, AudioError, Resampler, decode_audio, resample

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
    assert "expected WAV, FLAC, OGG, MP3, M4A/AAC, MP4 or WebM" in str(e.value)


# what only the process knows: object reprs, errno numbers, library names, file paths
INTERNALS = (" at 0x", "<_io", "Errno", "libsndfile", "psf_", "FFmpeg", "avformat", "/usr/", ".py")


@pytest.mark.parametrize(
    "data",
    [
        b"hello, this is not audio at all" * 10,
        b"RIFF\xff\xff\x00\x00WAVEfmt " + bytes(range(256)) * 16,
        b"fLaC" + bytes(4000),
        b"OggS" + bytes(4000),
        b"ID3\x04" + bytes(4000),
        b"\x00\x00\x00\x20ftypisom" + bytes(4000),
    ],
)
def test_refusals_name_the_input_not_the_process(data):
    """Library errors (libsndfile quotes its BytesIO's repr) stay in the log (issue 12)."""
    with pytest.raises(AudioError) as e:
        decode_audio(data)
    assert not [word for word in INTERNALS if word in str(e.value)], str(e.value)


@pytest.mark.parametrize("fmt", FORMATS)
def test_truncated_files_are_refused(jfk, fmt):
    data = encode(jfk, SAMPLE_RATE, fmt)
    with pytest.raises(AudioError, match="truncated|damaged or cut short") as e:
        decode_audio(data[: len(data) // 2])
    assert not [word for word in INTERNALS if word in str(e.value)], str(e.value)


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


# Containers libsndfile cannot read go through PyAV (FFmpeg): (container, codec, rate).
AV_FORMATS = {
    "m4a": ("ipod", "aac", 16000),
    "mp4": ("mp4", "aac", 44100),
    "webm": ("webm", "libopus", 48000),
    "aac": ("adts", "aac", 16000),
}


def encode_av(samples: np.ndarray, kind: str, channels: int = 2) -> bytes:
    container_format, codec, rate = AV_FORMATS[kind]
    layout = "stereo" if channels == 2 else "mono"
    buf = io.BytesIO()
    with av.open(buf, "w", format=container_format) as container:
        stream = container.add_stream(codec, rate=rate)
        stream.layout = layout
        planes = np.ascontiguousarray(np.stack([samples] * channels))
        frame = av.AudioFrame.from_ndarray(planes, format="fltp", layout=layout)
        frame.sample_rate = SAMPLE_RATE
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    return buf.getvalue()


@pytest.mark.parametrize("kind", AV_FORMATS)
def test_ffmpeg_containers_decode_to_the_same_speech(jfk, kind):
    audio = Audio(encode_av(jfk, kind))
    assert audio.backend == "av"
    decoded = audio.decode()
    assert abs(len(decoded) - len(jfk)) < 0.1 * SAMPLE_RATE
    assert np.std(decoded) == pytest.approx(np.std(jfk), rel=0.1)


@pytest.mark.parametrize("kind", ["m4a", "mp4", "webm"])  # raw ADTS AAC carries no length
def test_truncated_ffmpeg_containers_are_refused(jfk, kind):
    data = encode_av(jfk, kind)
    with pytest.raises(AudioError, match="truncated|damaged or cut short|could not decode") as e:
        Audio(data[: len(data) // 2]).decode()
    assert not [word for word in INTERNALS if word in str(e.value)], str(e.value)


def test_a_container_without_audio_is_refused():
    buf = io.BytesIO()
    with av.open(buf, "w", format="mp4") as container:
        stream = container.add_stream("mpeg4", rate=25)
        stream.width, stream.height = 16, 16
        frame = av.VideoFrame.from_ndarray(np.zeros((16, 16, 3), np.uint8), format="rgb24")
        for packet in [*stream.encode(frame), *stream.encode(None)]:
            container.mux(packet)
    with pytest.raises(AudioError, match="no audio stream"):
        Audio(buf.getvalue())


def test_streamed_resampling_equals_resampling_whole():
    """Exactly: libswresample keeps its state between pieces, whatever their sizes."""
    signal = np.random.default_rng(0).standard_normal(44100 * 3).astype(np.float32)
    r = Resampler(44100)
    pieces = [r.push(signal[i : i + 7777]) for i in range(0, len(signal), 7777)] + [r.flush()]
    np.testing.assert_array_equal(np.concatenate(pieces), resample(signal, 44100))


RATES = """
import io, resource, sys
import numpy as np, soundfile as sf
from engine.audio import Audio, AudioError

before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for rate in map(int, sys.argv[1:]):
    n = max(1, rate // 2)  # half a second
    tone = 0.1 * np.sin(2 * np.pi * min(440, rate / 4) * np.arange(n) / rate)
    buf = io.BytesIO()
    sf.write(buf, tone.astype(np.float32), rate, format="WAV", subtype="PCM_16")
    try:
        outcome = len(Audio(buf.getvalue()).decode())
    except AudioError as e:
        outcome = str(e)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024
    print(rate, grown, outcome, sep="\t")
"""


def test_rates_from_8_to_384_khz_are_resampled_in_bounded_memory_the_rest_refused():
    """Issue 12: a WAV at a rate sharing no factor with 16 kHz made the old resampler build a
    table of 16000 x rate entries (2.5 GB at 4,001 Hz). Half a second at each rate, one
    process: its peak memory (every rate's) grows by little."""
    rates = [1, 4001, 8000, 11025, 22050, 44100, 48000, 48001, 96000, 384000, 384001]
    lines = subprocess.run(
        [sys.executable, "-c", RATES, *map(str, rates)], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    for rate, line in zip(rates, lines, strict=True):
        _, grown_mb, outcome = line.split("\t")
        if 8000 <= rate <= 384000:
            assert abs(int(outcome) - SAMPLE_RATE // 2) <= 1, (rate, outcome)
        else:
            assert f"sample rate is {rate} Hz; expected 8000 to 384000 Hz" in outcome
        assert int(grown_mb) < 100, f"decoding at {rate} Hz grew the process by {grown_mb} MB"


TWO_HOURS = """
import io, resource, sys
import numpy as np, soundfile as sf, torch
from engine.audio import Audio
from engine.inputs import audio_sources

rate, minutes = 8000, 120
buf = io.BytesIO()
with sf.SoundFile(buf, "w", rate, 1, format="FLAC", subtype="PCM_16") as f:
    minute = (0.1 * np.sin(2 * np.pi * 440 * np.arange(rate * 60) / rate)).astype(np.float32)
    for _ in range(minutes):
        f.write(minute)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
[source] = audio_sources([Audio(buf.getvalue())], 80, torch.device("cpu"))
frames = sum(source.window(seek).shape[1] for seek in range(0, source.n_frames, 3000))
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
print(source.n_frames, frames, grown // 1024)
"""


def test_two_hours_are_decoded_within_a_bounded_window_of_memory():
    """Both passes over 2 h of 8 kHz audio (pulled window by window, as the decoder would)
    while the process grows by far less than the decoded audio (460 MB at 16 kHz float32) or
    its log-mel (230 MB) would take."""
    out = subprocess.run(
        [sys.executable, "-c", TWO_HOURS], capture_output=True, text=True, check=True
    ).stdout.split()
    n_frames, windows_frames, grown_mb = map(int, out)
    assert n_frames == 2 * 3600 * 100 and windows_frames == 240 * 3000
    assert grown_mb < 150, f"decoding 2 h grew the process by {grown_mb} MB"


WITHOUT_PYAV = """
import sys
sys.modules["av"] = None  # as if PyAV were not installed
from engine.audio import Audio, AudioError
import worker.cli.main, worker.core.engines, worker.jobs.lifecycle  # a worker's start needs none

for path in sys.argv[1:]:
    try:
        print(len(Audio(open(path, "rb").read()).decode()))
    except AudioError as e:
        print(e)
"""


def test_without_pyav_libsndfile_containers_at_16k_decode_and_the_rest_say_what_is_missing(
    jfk, clips, tmp_path
):
    """PyAV is needed only for the containers libsndfile cannot read and for other rates."""
    m4a, wav = tmp_path / "a.m4a", tmp_path / "b.wav"
    m4a.write_bytes(encode_av(jfk, "m4a"))
    wav.write_bytes(encode(resample(jfk, SAMPLE_RATE, 44100), 44100, "WAV"))
    done = subprocess.run(
        [sys.executable, "-c", WITHOUT_PYAV, str(clips["en_jfk"].path), str(m4a), str(wav)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.stdout.splitlines() == [
        str(len(jfk)),
        "audio that is not WAV, FLAC, OGG or MP3 (M4A/AAC, MP4, WebM) needs PyAV "
        "(pip install av), not installed here",
        "resampling 44100 Hz audio needs PyAV (pip install av), not installed here",
    ], done.stderr
