import io
from dataclasses import replace

import numpy as np
import pytest
import soundfile as sf

from engine import OptionsError, TranscriptionOptions
from engine.audio import decode_audio
from engine.decoding import compression_ratio
from tests.conftest import open_stream, transcribe
from tools.evaluate import timestamps_ok
from tools.wer import normalize


def test_result_shape_and_invariants(tiny_en, clips):
    clip = clips["en_jfk"]
    result = transcribe(tiny_en, clip.bytes)
    assert result.language == "en" and result.model == "tiny.en"
    assert result.duration == pytest.approx(clip.duration, abs=0.01)
    assert "ask not what your country can do for you" in result.text
    assert result.text == "".join(s.text for s in result.segments).strip()
    tok = tiny_en.engine.loaded.tokenizer
    for i, s in enumerate(result.segments):
        assert s.id == i and tok.decode(s.tokens) == s.text
        assert s.tokens[0] >= tok.timestamp_begin and s.tokens[-1] >= tok.timestamp_begin
        assert 0 <= s.start < s.end <= result.duration + 0.02
        assert s.avg_logprob < 0 and 0 <= s.no_speech_prob < 0.5 and s.temperature == 0.0
        # one window: every segment carries that window's ratio, as openai-whisper's do
        assert s.compression_ratio == pytest.approx(compression_ratio(result.text))
    assert result.options["task"] == "transcribe" and result.options["mode"] == "sequential"


def test_a_batch_equals_one_at_a_time(tiny_en, english_clips):
    batch = tiny_en.transcribe([c.bytes for c in english_clips])
    for clip, together in zip(english_clips, batch, strict=True):
        alone = transcribe(tiny_en, clip.bytes)
        assert [s.tokens for s in together.segments] == [s.tokens for s in alone.segments]


def test_a_stream_takes_inputs_while_it_decodes_each_with_its_own_options(tiny_en, clips):
    names = ["en_jfk", "en_librispeech_1272-128104-0000", "en_ljspeech_LJ050-0131"]
    options = [
        TranscriptionOptions(),
        TranscriptionOptions(mode="chunked"),
        TranscriptionOptions(initial_prompt="Kennedy, Lee Harvey Oswald."),
    ]
    prepared = [tiny_en.prepare(clips[n].bytes) for n in names]
    before = tiny_en.stats
    tiny_en.submit("first", prepared[0], options[0])
    results = {f.owner: f.transcription for f in tiny_en.step()}  # the first is decoding...
    assert tiny_en.busy and not results and (tiny_en.stats - before).windows == 1
    tiny_en.submit("second", prepared[1], options[1])  # ...when two more arrive
    tiny_en.submit("third", prepared[2], options[2], urgent=True)
    with pytest.raises(ValueError, match="already in the stream"):
        tiny_en.submit("third", prepared[2])
    while tiny_en.busy:
        results.update((f.owner, f.transcription) for f in tiny_en.step())
    done = tiny_en.stats - before
    assert done.windows == 3 and done.decode_s > 0 and done.encode_s > 0
    for owner, name, o in zip(["first", "second", "third"], names, options, strict=True):
        alone = transcribe(tiny_en, clips[name].bytes, o)
        assert [s.tokens for s in results[owner].segments] == [s.tokens for s in alone.segments]
        assert results[owner].options["mode"] == o.mode


def test_an_aborted_input_leaves_its_slots_and_never_comes_back(tiny_en, clips, long_clip):
    data, _, _ = long_clip
    tiny_en.submit("long", tiny_en.prepare(data))
    tiny_en.submit("short", tiny_en.prepare(clips["en_jfk"].bytes))
    tiny_en.step()  # both decoding
    assert tiny_en.abort("long") and not tiny_en.abort("long") and not tiny_en.abort("other")
    assert tiny_en.owners == ["short"]
    finished = []
    while tiny_en.busy:
        finished += tiny_en.step()
    assert [f.owner for f in finished] == ["short"]
    alone = transcribe(tiny_en, clips["en_jfk"].bytes)
    assert finished[0].transcription.text == alone.text
    # the pool is whole again: a full batch runs as before
    again = tiny_en.transcribe([data, clips["en_jfk"].bytes])
    assert again[1].text == alone.text and again[0].duration > 30


def test_an_input_aborted_before_its_first_step_is_dropped(tiny_en, clips):
    tiny_en.submit("gone", tiny_en.prepare(clips["en_jfk"].bytes))
    assert tiny_en.abort("gone") and not tiny_en.busy
    assert tiny_en.step() == []


def test_transcribe_needs_an_idle_stream(tiny_en, clips):
    tiny_en.submit("busy", tiny_en.prepare(clips["en_jfk"].bytes))
    try:
        with pytest.raises(RuntimeError, match="idle stream"):
            tiny_en.transcribe([clips["en_jfk"].bytes])
    finally:
        tiny_en.reset()
    assert not tiny_en.busy


def test_silence_has_a_high_no_speech_probability_and_can_be_skipped(tiny_en):
    silence = np.zeros(16000 * 5, np.float32)
    # As openai-whisper does, a confident hallucination (log-prob above -1) is kept...
    kept = transcribe(tiny_en, silence)
    assert all(s.no_speech_prob > 0.6 for s in kept.segments)
    # ...unless the no-speech probability alone decides.
    skipped = transcribe(tiny_en, silence, TranscriptionOptions(logprob_threshold=None))
    assert skipped.segments == [] and skipped.text == ""


def test_english_only_model_refuses_translate_and_other_languages(tiny_en, clips):
    with pytest.raises(OptionsError, match="multilingual"):
        transcribe(tiny_en, clips["en_jfk"].bytes, TranscriptionOptions(task="translate"))
    with pytest.raises(OptionsError, match="multilingual"):
        transcribe(tiny_en, clips["en_jfk"].bytes, TranscriptionOptions(language="fr"))


def test_bad_options_are_refused_before_work(tiny_en, clips):
    for options, words in [
        (TranscriptionOptions(mode="fast"), "mode 'fast'"),
        (TranscriptionOptions(task="summarize"), "task 'summarize'"),
        (TranscriptionOptions(temperature=()), "temperature"),
    ]:
        with pytest.raises(OptionsError, match=words):
            transcribe(tiny_en, clips["en_jfk"].bytes, options)


def test_multilingual_detects_and_honours_a_given_language(base, clips):
    detected = transcribe(base, clips["fr_fleurs_000"].bytes)
    assert detected.language == "fr" and detected.language_probability > 0.5
    given = transcribe(base, clips["fr_fleurs_000"].bytes, TranscriptionOptions(language="fr"))
    assert given.language == "fr" and given.language_probability is None
    with pytest.raises(OptionsError, match="unknown language 'xx'"):
        transcribe(base, clips["fr_fleurs_000"].bytes, TranscriptionOptions(language="xx"))


def test_translate_gives_english(base, clips):
    result = transcribe(base, clips["fr_fleurs_000"].bytes, TranscriptionOptions(task="translate"))
    assert "accident" in result.text.lower()


def test_initial_prompt_steers_spelling(tiny_en, clips):
    plain = transcribe(tiny_en, clips["en_librispeech_1272-128104-0000"].bytes)
    prompted = transcribe(
        tiny_en,
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
    result = transcribe(tiny_en, data, TranscriptionOptions(mode=mode))
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
    transcribe(tiny_en, data, progress=lambda i, done, total: seen.append((i, done, total)))
    assert len(seen) >= 2 and seen[-1][1] == pytest.approx(seen[-1][2], abs=0.01)
    assert [d for _, d, _ in seen] == sorted(d for _, d, _ in seen)


def test_a_transcription_that_fails_midway_leaves_the_pool_free(tiny_en, clips, monkeypatch):
    """An input that breaks while others decode (a stream that turns out truncated, say)
    fails its transcription; the next one runs on a free pool."""
    from engine.runner import Runner

    collect, calls = Runner.collect, []

    def collect_then_break(self):
        calls.append(self.n_live)
        if len(calls) == 2:  # decode steps are launched and windows are live
            raise RuntimeError("the input broke")
        return collect(self)

    monkeypatch.setattr(Runner, "collect", collect_then_break)
    items = [clips["en_jfk"].bytes, clips["en_librispeech_1272-128104-0000"].bytes]
    with pytest.raises(RuntimeError, match="the input broke"):
        tiny_en.transcribe(items)
    assert calls == [2, 2] and not tiny_en.busy
    monkeypatch.undo()
    assert "ask not what your country" in transcribe(tiny_en, clips["en_jfk"].bytes).text


def test_inputs_decoded_on_several_threads_keep_their_order_and_a_bad_one_stops_the_call(
    tiny_en, clips
):
    """`transcribe` decodes its inputs on a pool of threads: an undecodable one raises its own
    error before any work starts, and the results keep the inputs' order."""
    from engine import AudioError

    jfk, libri = clips["en_jfk"].bytes, clips["en_librispeech_1272-128104-0000"].bytes
    with pytest.raises(AudioError):
        tiny_en.transcribe([jfk, b"not audio at all", libri])
    assert not tiny_en.busy
    texts = [t.text for t in tiny_en.transcribe([libri, jfk, libri])]
    assert "ask not what your country" in texts[1]
    assert texts[0] == texts[2] and "ask not" not in texts[0]


def test_options_the_stream_has_no_room_for_are_refused_before_work(clips):
    from engine import DecodingRules

    narrow = open_stream("tiny.en", rules=DecodingRules(max_prompt=4, sample_len=50))
    without_context = TranscriptionOptions(condition_on_previous_text=False)
    assert transcribe(narrow, clips["en_jfk"].bytes, without_context).text
    for options, words in [
        (TranscriptionOptions(), "room for 4 prompt tokens"),
        (TranscriptionOptions(mode="chunked", initial_prompt="Kennedy"), "room for 4 prompt"),
        (TranscriptionOptions(mode="chunked", sample_len=51), "sample_len 51: expected 1 to 50"),
        (TranscriptionOptions(mode="chunked", min_tokens=-1), "min_tokens -1"),
    ]:
        with pytest.raises(OptionsError, match=words):
            narrow.transcribe([clips["en_jfk"].bytes], options)


def test_an_engine_config_refuses_values_it_does_not_know():
    from engine import EngineConfig

    for field, value in (
        ("dtype", "fp64"),
        ("cross_kv", "int4"),
        ("encoder", "int8"),
        ("kernels", "cuda"),
    ):
        with pytest.raises(ValueError, match=f"{field} '{value}': expected one of"):
            EngineConfig(**{field: value})


@pytest.fixture
def decoded_tokens(monkeypatch):
    """Tokens decoded in all, every try of every window (the work, not its wall time)."""
    from engine.runner import Runner

    collect, count = Runner.collect, {"tokens": 0}

    def counting(self):
        decoded = collect(self)
        count["tokens"] += sum(len(d.result.tokens) for d in decoded)
        return decoded

    monkeypatch.setattr(Runner, "collect", counting)
    return count


def test_a_repetitive_prompt_costs_a_few_times_the_plain_clip(tiny_en, clips, decoded_tokens):
    """Issue 12: with "ha " * 333 as the prompt every try of a 1.5 s clip decoded 223 tokens
    of "ha" and the result was "ha ha ...". A try now ends once its text fails the compression
    check (12 tokens), and the tries above 0.5 go without the prompt."""
    clip = decode_audio(clips["en_jfk"].bytes)[:24000]
    plain = transcribe(tiny_en, clip)
    plain_tokens = decoded_tokens["tokens"]
    decoded_tokens["tokens"] = 0
    prompted = transcribe(tiny_en, clip, TranscriptionOptions(initial_prompt="ha " * 333))
    assert decoded_tokens["tokens"] <= 8 * plain_tokens, (decoded_tokens, plain_tokens)
    assert prompted.text.split()[:3] == plain.text.split()[:3] == ["And", "so", "my"]
    assert "ha" not in prompted.text
    assert [s.temperature for s in prompted.segments] == [0.6]  # 0, 0.2, 0.4 repeated "ha"


def test_only_a_try_with_a_hotter_one_after_it_ends_for_repeating_itself(
    tiny_en, clips, decoded_tokens
):
    """A try whose text so far fails the compression check ends there when another try comes
    after it (its text is decoded again anyway); the last try, kept whatever it is, is decoded
    to its end, as openai-whisper decodes it (#36: the engine had kept a cut one). Nothing is
    cut without a threshold, nor before `min_tokens` (the fixed work of benchmarks)."""
    clip = decode_audio(clips["en_jfk"].bytes)[:24000]
    looping = TranscriptionOptions(initial_prompt="ha " * 333, temperature=(0.0,), sample_len=40)
    [segment] = transcribe(tiny_en, clip, looping).segments
    assert len(segment.tokens) == 40 and segment.compression_ratio > 2.4
    for options, decoded in (
        (replace(looping, temperature=(0.0, 0.0)), 12 + 40),  # the first try cut
        (replace(looping, temperature=(0.0, 0.0), compression_ratio_threshold=None), 40),
        (replace(looping, temperature=(0.0, 0.0), min_tokens=30), None),
    ):
        decoded_tokens["tokens"] = 0
        kept = transcribe(tiny_en, clip, options)
        assert kept.text == " ".join(["ha"] * len(kept.segments[0].tokens[1:]))
        if decoded is not None:
            assert decoded_tokens["tokens"] == decoded
    assert 30 + 40 <= decoded_tokens["tokens"] < 40 + 40
