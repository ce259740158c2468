import numpy as np
import pytest

from engine.audio import AudioError
from engine.decoding import DecodingOptions, OptionsError, compression_ratio


def test_result_shape_and_invariants(tiny_en, clips):
    clip = clips["en_jfk"]
    result = tiny_en.transcribe(clip.bytes)
    assert result.language == "en" and result.model == "tiny.en"
    assert result.duration == pytest.approx(clip.duration, abs=0.01)
    assert "ask not what your country can do for you" in result.text
    (segment,) = result.segments
    assert result.text == segment.text.strip()
    assert tiny_en.loaded.tokenizer.decode(segment.tokens) == segment.text
    assert 0 <= segment.start < segment.end <= result.duration
    assert segment.avg_logprob < 0 and 0 <= segment.no_speech_prob < 0.5
    assert segment.compression_ratio == pytest.approx(compression_ratio(segment.text))
    assert result.options["task"] == "transcribe"


def test_a_batch_equals_one_at_a_time(tiny_en, english_clips):
    batch = tiny_en.transcribe_batch([c.bytes for c in english_clips])
    for clip, together in zip(english_clips, batch, strict=True):
        alone = tiny_en.transcribe(clip.bytes)
        assert together.segments[0].tokens == alone.segments[0].tokens


def test_silence_has_high_no_speech_probability(tiny_en):
    result = tiny_en.transcribe(np.zeros(16000 * 5, np.float32))
    assert result.segments[0].no_speech_prob > 0.5


def test_english_only_model_refuses_translate_and_other_languages(tiny_en, clips):
    with pytest.raises(OptionsError, match="multilingual"):
        tiny_en.transcribe(clips["en_jfk"].bytes, DecodingOptions(task="translate"))
    with pytest.raises(OptionsError, match="multilingual"):
        tiny_en.transcribe(clips["en_jfk"].bytes, DecodingOptions(language="fr"))


def test_multilingual_detects_and_honours_a_given_language(base, clips):
    detected = base.transcribe(clips["fr_fleurs_000"].bytes)
    assert detected.language == "fr" and detected.language_probability > 0.5
    given = base.transcribe(clips["fr_fleurs_000"].bytes, DecodingOptions(language="fr"))
    assert given.language == "fr" and given.language_probability is None
    with pytest.raises(OptionsError, match="unknown language 'xx'"):
        base.transcribe(clips["fr_fleurs_000"].bytes, DecodingOptions(language="xx"))


def test_translate_gives_english(base, clips):
    result = base.transcribe(clips["fr_fleurs_000"].bytes, DecodingOptions(task="translate"))
    assert "accident" in result.text.lower()


def test_over_30_seconds_is_refused_clearly(tiny_en):
    with pytest.raises(AudioError, match="31.0 s long"):
        tiny_en.transcribe(np.zeros(16000 * 31, np.float32))
