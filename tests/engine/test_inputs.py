"""Spectrogram input: validated, and equal to the audio it came from."""

import dataclasses
import io
import re

import numpy as np
import pytest
import soundfile as sf
import torch
from transformers import WhisperFeatureExtractor

from engine import AudioError, InputTooLong, SpectrogramError, TranscriptionOptions
from engine.audio import Audio, decode_audio, resample
from engine.inputs import LongAudio, audio_sources, open_audio, read_input, spectrogram_source
from engine.options import SpeakerCount
from tests.conftest import long_speech, open_stream, transcribe

CPU = torch.device("cpu")


def extractor_features(audio: np.ndarray, long: bool = False) -> np.ndarray:
    fe = WhisperFeatureExtractor(feature_size=80)
    if long:
        return fe(
            audio, sampling_rate=16000, truncation=False, padding="longest", return_tensors="np"
        ).input_features
    return fe(audio, sampling_rate=16000, return_tensors="np").input_features


def tokens(result):
    return [t for s in result.segments for t in s.tokens]


@pytest.mark.parametrize("form", ["2d", "3d", "npy", "float64"])
def test_a_window_spectrogram_gives_the_tokens_of_its_audio(tiny_en, clips, form):
    clip = clips["en_jfk"]
    mel = extractor_features(decode_audio(clip.bytes))  # (1, 80, 3000)
    item = {"2d": mel[0], "3d": mel, "float64": mel.astype(np.float64)}.get(form)
    if form == "npy":
        buf = io.BytesIO()
        np.save(buf, mel)
        item = buf.getvalue()
    from_mel = transcribe(tiny_en, item)
    from_audio = transcribe(tiny_en, clip.bytes)
    assert tokens(from_mel) == tokens(from_audio)
    assert from_mel.duration == pytest.approx(clip.duration, abs=0.02)  # from where silence starts


def test_a_long_spectrogram_gives_the_tokens_of_its_audio(tiny_en, clips):
    audio = np.concatenate(
        [
            decode_audio(clips[n].bytes)
            for n in ("en_jfk", "en_librispeech_1272-128104-0000", "en_jfk", "en_jfk")
        ]
    )
    mel = extractor_features(audio, long=True)[0]
    assert mel.shape[1] > 3000
    options = TranscriptionOptions(temperature=(0.0,))
    assert tokens(transcribe(tiny_en, mel, options)) == tokens(transcribe(tiny_en, audio, options))


def test_long_audio_frames_equal_the_extractor_and_the_last_window_pads_with_zeros(clips):
    audio = np.concatenate([decode_audio(clips["en_jfk"].bytes)] * 3)  # 33 s
    expected = extractor_features(audio, long=True)[0]
    [source] = audio_sources([audio], 80, CPU)
    assert source.n_frames == expected.shape[1]
    first, last = source.window(0).numpy(), source.window(3000).numpy()
    np.testing.assert_allclose(first, expected[:, :3000], atol=1e-5)
    np.testing.assert_allclose(last[:, : expected.shape[1] - 3000], expected[:, 3000:], atol=1e-5)
    # as openai-whisper, faster-whisper and transformers' long-form pad a window past the end
    assert not last[:, expected.shape[1] - 3000 :].any()
    spectrogram = spectrogram_source(expected, 80, CPU)
    np.testing.assert_allclose(spectrogram.window(3000).numpy(), last, atol=1e-5)


def test_long_audio_read_on_the_host_is_streamed_without_decoding_its_start_again(
    clips, monkeypatch
):
    """A worker's job thread reads an input (`read_input`) and the engine core opens it: audio
    past 30 s is decoded there once to find out, then streamed in its two passes, and not
    decoded from the start a third time to find out again."""
    samples = np.concatenate([decode_audio(clips["en_jfk"].bytes)] * 3)  # 33 s
    buffer = io.BytesIO()
    sf.write(buffer, samples, 16000, format="FLAC")
    passes, blocks = [], Audio.blocks

    def counted(self, *args, **kwargs):
        passes.append(1)
        return blocks(self, *args, **kwargs)

    monkeypatch.setattr(Audio, "blocks", counted)
    host = read_input(buffer.getvalue())
    assert isinstance(host, LongAudio) and len(passes) == 1
    assert read_input(host) is host  # read already
    source = open_audio(host, 80, CPU)
    assert source.n_frames == len(samples) // 160 and len(passes) == 3
    [expected] = audio_sources([samples], 80, CPU)
    np.testing.assert_allclose(source.window(0).numpy(), expected.window(0).numpy(), atol=1e-5)


def test_clips_opened_together_equal_each_opened_alone(clips):
    """Short clips share one log-mel pass, each scaled by its own maximum; long ones stream."""
    jfk, libri = decode_audio(clips["en_jfk"].bytes), decode_audio(clips["fr_fleurs_000"].bytes)
    items = [jfk, np.concatenate([jfk] * 3), 0.01 * libri, libri[:16000]]
    together = audio_sources(items, 80, CPU)
    for item, source in zip(items, together, strict=True):
        [alone] = audio_sources([item], 80, CPU)
        assert (source.n_frames, source.duration) == (alone.n_frames, alone.duration)
        assert source.floor == pytest.approx(alone.floor, abs=1e-6)
        for seek in range(0, source.n_frames, 3000):
            np.testing.assert_allclose(source.window(seek), alone.window(seek), atol=1e-5)
    short = [i for i, item in enumerate(items) if len(item) <= 480000]
    np.testing.assert_allclose(  # against the extractor, not only against ourselves
        np.stack([together[i].window(0) for i in short]),
        np.concatenate([extractor_features(items[i]) for i in short]),
        atol=1e-3,
    )


@pytest.mark.parametrize("rate", [8000, 44100, 48001])
def test_resampled_audio_gets_the_extractors_log_mel_and_the_same_words(tiny_en, clips, rate):
    """A clip stored at another rate: its log-mel is the extractor's on the samples it
    resamples to, and the transcript keeps the words."""
    buf = io.BytesIO()
    sf.write(buf, resample(decode_audio(clips["en_jfk"].bytes), 16000, rate), rate, format="WAV")
    audio = Audio(buf.getvalue())
    [source] = audio_sources([audio], 80, CPU)
    np.testing.assert_allclose(source.window(0), extractor_features(audio.decode())[0], atol=1e-3)
    assert "ask not what your country can do for you" in transcribe(tiny_en, buf.getvalue()).text


def valid() -> np.ndarray:
    return np.zeros((80, 3000), np.float32)


@pytest.mark.parametrize(
    "array, words",
    [
        (np.zeros((128, 3000), np.float32), "shape [128, 3000]"),
        (np.zeros((80, 2999), np.float32), "2999 frames"),
        (np.zeros((2, 80, 3000), np.float32), "shape [2, 80, 3000]"),
        (np.zeros(3000, np.float32), "shape [3000]"),
        (np.zeros((80, 3000), np.int16), "int16"),
        ([[0.0] * 3000] * 80, "list"),
    ],
)
def test_malformed_spectrograms_are_refused_naming_the_accepted_forms(array, words):
    with pytest.raises(SpectrogramError, match=re.escape(words)) as e:
        spectrogram_source(array, 80, CPU)
    assert "[80, 3000] or [1, 80, 3000]" in str(e.value)


def test_non_finite_values_are_refused():
    for bad in (np.nan, np.inf):
        array = valid()
        array[3, 7] = bad
        with pytest.raises(SpectrogramError, match="NaN or infinite"):
            spectrogram_source(array, 80, CPU)


def test_unreadable_npy_is_refused(tiny_en):
    with pytest.raises(SpectrogramError, match="not a readable .npy"):
        tiny_en.prepare(b"\x93NUMPY\x01\x00garbage")


def test_audio_and_spectrograms_share_one_batch(tiny_en, clips):
    """Windows from audio and from spectrograms go through the same encoder batch."""
    names = ["en_jfk", "en_librispeech_1272-128104-0000", "en_ljspeech_LJ050-0131"]
    mel = extractor_features(decode_audio(clips[names[1]].bytes))[0]
    items = [clips[names[0]].bytes, mel, clips[names[2]].bytes]
    together = tiny_en.transcribe(items)
    assert [tokens(r) for r in together] == [tokens(transcribe(tiny_en, i)) for i in items]
    assert tokens(together[1]) == tokens(transcribe(tiny_en, clips[names[1]].bytes))


# The length limit (issue 12): one, in seconds, for audio and spectrograms (100 frames a second).


@pytest.fixture(scope="module")
def ten_seconds():
    """tiny.en refusing inputs longer than 10 s."""
    return open_stream("tiny.en", max_audio_s=10)


def test_audio_longer_than_the_limit_is_refused_naming_both(ten_seconds, clips):
    jfk = clips["en_jfk"]  # an 11 s FLAC: it says how long it is, so nothing is decoded
    with pytest.raises(AudioError, match=r"declares 11\.0 s; expected at most 10 s") as e:
        ten_seconds.prepare(jfk.bytes)
    assert isinstance(e.value, InputTooLong)
    with pytest.raises(InputTooLong, match=r"got 11\.0 s of samples; expected at most 10 s"):
        ten_seconds.prepare(decode_audio(jfk.bytes))
    assert len(ten_seconds.prepare(clips["en_ljspeech_LJ050-0131"].bytes)) == 122530  # 7.7 s


def test_decoding_stops_as_soon_as_the_limit_is_passed(clips, monkeypatch):
    """A file that does not declare its length is decoded only up to the limit."""
    buf = io.BytesIO()
    sf.write(buf, np.concatenate([decode_audio(clips["en_jfk"].bytes)] * 20), 16000, format="FLAC")
    audio = Audio(buf.getvalue())  # 220 s
    monkeypatch.setattr(audio, "info", dataclasses.replace(audio.info, frames=None))
    decoded, blocks = [], audio.blocks
    monkeypatch.setattr(audio, "blocks", lambda: (decoded.append(len(b)) or b for b in blocks()))
    with pytest.raises(InputTooLong, match=r"runs past 60\.0 s; expected at most 45 s"):
        open_audio(audio, 80, CPU, max_s=45)
    assert sum(decoded) == 60 * 16000  # two 30 s blocks of 220 s


def test_a_wav_at_1_hz_declaring_hours_is_refused_before_any_work():
    buf = io.BytesIO()
    sf.write(buf, np.zeros(7200, np.float32), 1, format="WAV", subtype="PCM_16")  # 2 h, 14 KB
    with pytest.raises(AudioError, match="sample rate is 1 Hz; expected 8000 to 384000 Hz"):
        Audio(buf.getvalue())


def test_spectrograms_longer_than_the_limit_are_refused_from_their_shape(ten_seconds, clips):
    with pytest.raises(SpectrogramError, match=r"got 5001 frames \(50\.01 s") as e:
        spectrogram_source(np.zeros((80, 5001), np.float32), 80, CPU, max_s=50)
    assert isinstance(e.value, InputTooLong) and "expected at most 5000 frames (50 s)" in str(
        e.value
    )
    endless = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), (80, 10**9), (0, 0))
    with pytest.raises(InputTooLong, match="got 1000000000 frames"):  # never read
        ten_seconds.prepare(endless)
    # one window whose content (11 s of speech, then the extractor's padding) passes 10 s
    with pytest.raises(InputTooLong, match=r"got 110\d frames \(11\.0\d s"):
        ten_seconds.prepare(extractor_features(decode_audio(clips["en_jfk"].bytes)))


def test_an_engine_config_refuses_a_limit_that_is_not_positive():
    from engine import EngineConfig

    for value in (0, -1.0, float("nan")):
        with pytest.raises(ValueError, match=f"max_audio_s {value!r}: expected seconds above 0"):
            EngineConfig(max_audio_s=value)


@pytest.mark.parametrize(
    ("options", "finds"),
    [
        (TranscriptionOptions(), True),  # sequential's cover_speech
        (TranscriptionOptions(vad=False), True),
        (TranscriptionOptions(vad=False, cover_speech=False), False),
        (TranscriptionOptions(cover_speech=False), False),  # vad omitted: off in sequential
        (TranscriptionOptions(cover_speech=False, vad=True), True),
        (TranscriptionOptions(mode="chunked"), True),  # vad omitted: on in chunked
        (TranscriptionOptions(mode="chunked", vad=False), False),
        (TranscriptionOptions(mode="chunked", vad=False, word_timestamps=True), False),
        (TranscriptionOptions(mode="chunked", vad=False, diarize=SpeakerCount()), True),
        (TranscriptionOptions(mode="chunked", vad=False, cover_speech=True), False),
    ],
)
def test_options_find_speech_where_something_uses_it(options, finds):
    assert options.finds_speech is finds


def test_long_audio_read_for_options_that_use_no_speech_runs_no_silero(tiny_en, monkeypatch):
    from engine import inputs

    data = long_speech(33)
    chunked = TranscriptionOptions(mode="chunked", vad=False)
    heard = tiny_en.prepare(data, TranscriptionOptions(mode="chunked"))
    detectors = []
    monkeypatch.setattr(inputs, "Detector", lambda device: detectors.append(device))
    unheard = tiny_en.prepare(data, chunked)
    assert not detectors and unheard.unheard and unheard.speech is None
    assert heard.speech and not heard.unheard
    assert unheard.duration == heard.duration and unheard.floor == heard.floor

    tiny_en.submit("unheard", unheard, chunked)
    tiny_en.submit("heard", heard, chunked)
    done = {}
    while tiny_en.busy:
        done.update((f.owner, f.transcription) for f in tiny_en.step())
    assert tokens(done["unheard"]) == tokens(done["heard"])
    assert "ask not what your country can do for you" in done["unheard"].text.lower()


def test_options_that_use_speech_refuse_audio_read_without_finding_it(tiny_en):
    data = long_speech(33)
    unheard = tiny_en.prepare(data, TranscriptionOptions(mode="chunked", vad=False))
    for options in (TranscriptionOptions(), TranscriptionOptions(mode="chunked")):
        with pytest.raises(ValueError, match="prepare it with them"):
            tiny_en.submit("late", unheard, options)
    assert not tiny_en.busy
    tiny_en.submit("right", unheard, TranscriptionOptions(mode="chunked", vad=False))
    assert tiny_en.owners == ["right"] and tiny_en.abort("right") and not tiny_en.busy
