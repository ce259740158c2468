import io

import numpy as np
import pytest
import soundfile as sf

from engine.audio import decode_audio
from engine.decoding import compression_ratio
from engine.evaluate import timestamps_ok
from engine.longform import OptionsError, TranscriptionOptions
from engine.wer import normalize


def test_result_shape_and_invariants(tiny_en, clips):
    clip = clips["en_jfk"]
    result = tiny_en.transcribe(clip.bytes)
    assert result.language == "en" and result.model == "tiny.en"
    assert result.duration == pytest.approx(clip.duration, abs=0.01)
    assert "ask not what your country can do for you" in result.text
    assert result.text == "".join(s.text for s in result.segments).strip()
    tok = tiny_en.loaded.tokenizer
    for i, s in enumerate(result.segments):
        assert s.id == i and tok.decode(s.tokens) == s.text
        assert s.tokens[0] >= tok.timestamp_begin and s.tokens[-1] >= tok.timestamp_begin
        assert 0 <= s.start < s.end <= result.duration + 0.02
        assert s.avg_logprob < 0 and 0 <= s.no_speech_prob < 0.5 and s.temperature == 0.0
        # one window: every segment carries that window's ratio, as openai-whisper's do
        assert s.compression_ratio == pytest.approx(compression_ratio(result.text))
    assert result.options["task"] == "transcribe" and result.options["mode"] == "sequential"


def test_a_batch_equals_one_at_a_time(tiny_en, english_clips):
    batch = tiny_en.transcribe_batch([c.bytes for c in english_clips])
    for clip, together in zip(english_clips, batch, strict=True):
        alone = tiny_en.transcribe(clip.bytes)
        assert [s.tokens for s in together.segments] == [s.tokens for s in alone.segments]


def test_a_stream_takes_inputs_while_it_decodes_each_with_its_own_options(tiny_en, clips):
    from engine.transcribe import Submission

    names = ["en_jfk", "en_librispeech_1272-128104-0000", "en_ljspeech_LJ050-0131"]
    options = [
        TranscriptionOptions(),
        TranscriptionOptions(mode="chunked"),
        TranscriptionOptions(initial_prompt="Kennedy, Lee Harvey Oswald."),
    ]
    prepared = [tiny_en.prepare(clips[n].bytes) for n in names]
    stream = tiny_en.stream()
    stream.add([Submission(0, prepared[0], options[0])])
    results = dict(stream.step())  # the first input is decoding...
    assert stream.busy and not results
    late = [Submission(1, prepared[1], options[1]), Submission(2, prepared[2], options[2], True)]
    stream.add(late)  # ...when two more arrive, the urgent one queued ahead
    assert [s.owner for s in stream.live] == [2, 0, 1]
    while stream.busy:
        results.update(stream.step())
    for i, name in enumerate(names):
        alone = tiny_en.transcribe(clips[name].bytes, options[i])
        assert [s.tokens for s in results[i].segments] == [s.tokens for s in alone.segments]
        assert results[i].options["mode"] == options[i].mode


def test_silence_has_a_high_no_speech_probability_and_can_be_skipped(tiny_en):
    silence = np.zeros(16000 * 5, np.float32)
    # As openai-whisper does, a confident hallucination (log-prob above -1) is kept...
    kept = tiny_en.transcribe(silence)
    assert all(s.no_speech_prob > 0.6 for s in kept.segments)
    # ...unless the no-speech probability alone decides.
    skipped = tiny_en.transcribe(silence, TranscriptionOptions(logprob_threshold=None))
    assert skipped.segments == [] and skipped.text == ""


def test_english_only_model_refuses_translate_and_other_languages(tiny_en, clips):
    with pytest.raises(OptionsError, match="multilingual"):
        tiny_en.transcribe(clips["en_jfk"].bytes, TranscriptionOptions(task="translate"))
    with pytest.raises(OptionsError, match="multilingual"):
        tiny_en.transcribe(clips["en_jfk"].bytes, TranscriptionOptions(language="fr"))


def test_bad_options_are_refused_before_work(tiny_en, clips):
    for options, words in [
        (TranscriptionOptions(mode="fast"), "mode 'fast'"),
        (TranscriptionOptions(task="summarize"), "task 'summarize'"),
        (TranscriptionOptions(temperature=()), "temperature"),
    ]:
        with pytest.raises(OptionsError, match=words):
            tiny_en.transcribe(clips["en_jfk"].bytes, options)


def test_multilingual_detects_and_honours_a_given_language(base, clips):
    detected = base.transcribe(clips["fr_fleurs_000"].bytes)
    assert detected.language == "fr" and detected.language_probability > 0.5
    given = base.transcribe(clips["fr_fleurs_000"].bytes, TranscriptionOptions(language="fr"))
    assert given.language == "fr" and given.language_probability is None
    with pytest.raises(OptionsError, match="unknown language 'xx'"):
        base.transcribe(clips["fr_fleurs_000"].bytes, TranscriptionOptions(language="xx"))


def test_translate_gives_english(base, clips):
    result = base.transcribe(clips["fr_fleurs_000"].bytes, TranscriptionOptions(task="translate"))
    assert "accident" in result.text.lower()


def test_initial_prompt_steers_spelling(tiny_en, clips):
    plain = tiny_en.transcribe(clips["en_librispeech_1272-128104-0000"].bytes)
    prompted = tiny_en.transcribe(
        clips["en_librispeech_1272-128104-0000"].bytes,
        TranscriptionOptions(initial_prompt="Mister Kwilter, the apostle."),
    )
    assert "Quilter" in plain.text and "Kwilter" in prompted.text


@pytest.fixture(scope="module")
def long_clip(clips):
    """Four real clips joined with a second of silence: about 45 s, two windows or more."""
    names = ["en_jfk", "en_librispeech_1272-128104-0000", "en_ljspeech_LJ050-0131", "en_jfk"]
    gap = np.zeros(16000, np.float32)
    audio = np.concatenate([x for n in names for x in (decode_audio(clips[n].bytes), gap)])
    buf = io.BytesIO()
    sf.write(buf, audio, 16000, format="FLAC")
    return buf.getvalue(), len(audio) / 16000, [clips[n].reference for n in names]


@pytest.mark.parametrize("mode", ["sequential", "chunked"])
def test_long_audio_in_both_modes(tiny_en, long_clip, mode):
    data, duration, references = long_clip
    result = tiny_en.transcribe(data, TranscriptionOptions(mode=mode))
    assert result.duration == pytest.approx(duration, abs=0.01)
    text = normalize(result.text)
    for reference in references:
        words = normalize(reference).split()
        assert " ".join(words[:3]) in text and " ".join(words[-3:]) in text
    assert timestamps_ok(result.segments, result.duration)  # in order, inside the audio
    assert result.segments[-1].end > 30  # past the first window


def test_progress_is_reported_up_to_the_duration(tiny_en, long_clip):
    data, duration, _ = long_clip
    seen = []
    tiny_en.transcribe(data, progress=lambda i, done, total: seen.append((i, done, total)))
    assert len(seen) >= 2 and seen[-1][1] == pytest.approx(seen[-1][2], abs=0.01)
    assert [d for _, d, _ in seen] == sorted(d for _, d, _ in seen)


def test_a_transcription_that_fails_midway_leaves_the_pool_free(tiny_en, clips, monkeypatch):
    """An input that breaks while others decode (a stream that turns out truncated, say)
    fails its transcription; the next one runs on a free pool."""
    from engine.transcribe import Stream

    admit, calls = Stream._admit, []

    def admit_then_break(self):
        calls.append(self.sched.n_live)
        if len(calls) == 2:  # decode steps are launched and a window is live
            raise RuntimeError("the input broke")
        return admit(self)

    monkeypatch.setattr(Stream, "_admit", admit_then_break)
    with pytest.raises(RuntimeError, match="the input broke"):
        tiny_en.transcribe(clips["en_jfk"].bytes)
    assert calls == [0, 1]
    monkeypatch.undo()
    sched = next(iter(tiny_en._schedulers.values()))
    assert sched.n_live == 0
    assert "ask not what your country" in tiny_en.transcribe(clips["en_jfk"].bytes).text
