"""The transformers backend (engine.hf): tiny.en's real weights give the native engine's tokens
through it; random-weight CTC models of other architectures and a Qwen3-ASR-shaped audio
language model serve with the same contract."""

import numpy as np
import pytest

from engine import Engine, EngineConfig, OptionsError, SpectrogramError, TranscriptionOptions
from engine.loader import model_dir
from tests.conftest import long_speech, random_ctc
from tests.faults.fleet import npy

GREEDY = TranscriptionOptions(timestamps=False, temperature=(0.0,))


@pytest.fixture(scope="module")
def tiny_en_hf():
    return Engine.open(
        EngineConfig(model=f"hf:{model_dir('tiny.en')}", name="tiny.en-hf", device="cpu")
    )


def test_tiny_en_through_transformers_gives_the_native_engines_tokens(
    tiny_en, tiny_en_hf, english_clips
):
    """Greedy, no timestamps: the same text tokens whichever backend runs the weights."""
    data = [c.bytes for c in english_clips]
    native = tiny_en.transcribe(data, GREEDY)
    through = tiny_en_hf.transcribe(data, GREEDY)
    for a, b in zip(native, through, strict=True):
        ours = [t for s in a.segments for t in s.tokens if t < tiny_en.engine.loaded.tokenizer.eot]
        assert [t for s in b.segments for t in s.tokens] == ours
        assert b.text == a.text and b.language == "en" and b.model == "tiny.en-hf"


def test_long_audio_is_cut_into_windows_each_a_segment(tiny_en_hf):
    result = tiny_en_hf.transcribe([long_speech(44)], GREEDY)[0]
    assert [(s.start, s.end) for s in result.segments] == [(0.0, 30.0), (30.0, 44.0)]
    text = result.text.lower()
    assert result.duration == 44.0 and "ask not" in text and "middle classes" in text
    assert all(s.avg_logprob is None and s.no_speech_prob is None for s in result.segments)


def test_what_transformers_cannot_do_is_refused_before_any_work(tiny_en_hf, clips):
    for options, words in [
        (TranscriptionOptions(word_timestamps=True), "word timestamps"),
        (TranscriptionOptions(initial_prompt="Kennedy"), "a prompt"),
        (TranscriptionOptions(temperature=(0.4,)), "sampling"),
        (TranscriptionOptions(language="fr"), "English-only"),
        (TranscriptionOptions(task="translate"), "translates"),
    ]:
        with pytest.raises(OptionsError, match=words):
            tiny_en_hf.check(options)
    with pytest.raises(SpectrogramError, match="send audio"):
        tiny_en_hf.prepare(npy(np.zeros((80, 3000), np.float32)))
    assert not tiny_en_hf.busy


@pytest.mark.parametrize("architecture", ["wav2vec2", "hubert"])
def test_a_random_ctc_model_serves_with_the_same_contract(tmp_path, clips, architecture):
    path = random_ctc(tmp_path, architecture)
    stream = Engine.open(EngineConfig(model=f"hf:{path}", name=architecture, device="cpu", slots=2))
    assert stream.warm() == 0 and not stream.busy
    data = [
        clips["en_jfk"].bytes,
        long_speech(33),
        clips["fr_fleurs_000"].bytes,
    ]
    results = stream.transcribe(data)  # the default options: segments, fallback schedule
    for result, seconds in zip(results, (11.0, 33.0, 10.2), strict=True):
        assert result.model == architecture and result.language is None
        assert result.duration == pytest.approx(seconds, abs=0.01)
        assert set(result.text) <= set("ETAONISHRDLU' ")  # random weights: its letters
        for s in result.segments:
            assert s.avg_logprob is None and s.compression_ratio is None and s.temperature == 0.0
    assert stream.transcribe([data[1]])[0] == results[1]  # alone as in a batch
    with pytest.raises(OptionsError, match="takes none"):
        stream.check(TranscriptionOptions(language="en"))


def test_a_directory_that_is_not_a_model_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="transformers model directory"):
        Engine.open(EngineConfig(model=f"hf:{tmp_path}", device="cpu"))


def test_the_batch_halves_after_running_out_of_memory(tmp_path, clips):
    stream = Engine.open(
        EngineConfig(model=f"hf:{random_ctc(tmp_path, 'wav2vec2')}", device="cpu", slots=4)
    )
    assert stream.shrink() and stream.engine.n_slots == 2
    assert stream.shrink() and not stream.shrink() and stream.engine.n_slots == 1
    assert stream.transcribe([clips["en_jfk"].bytes])[0].duration == 11.0


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """A Qwen3-ASR-shaped model (audio encoder, Qwen3 decoder) with random weights."""
    from tools.qwen3_asr import make

    path = make(tmp_path_factory.mktemp("qwen3") / "qwen3-asr")
    return Engine.open(EngineConfig(model=f"hf:{path}", name="qwen3-asr", device="cpu", slots=4))


def test_an_audio_language_model_serves_with_the_same_contract(qwen3, clips):
    """Qwen3-ASR through its processor's transcription request: a segment per 30 s window,
    the tokens its own `generate` gives for that request (the stream adds nothing), and the
    fields it cannot give null."""
    import torch

    from engine.audio import decode_audio

    data = [clips["en_jfk"].bytes, long_speech(33)]
    results = qwen3.transcribe(data)
    for result, seconds, windows in zip(results, (11.0, 33.0), (1, 2), strict=True):
        assert result.model == "qwen3-asr" and result.duration == pytest.approx(seconds, abs=0.01)
        assert [s.start for s in result.segments] == [30.0 * i for i in range(windows)]
        assert all(s.avg_logprob is None and s.no_speech_prob is None for s in result.segments)
    engine = qwen3.engine
    request = engine.processor.apply_transcription_request(audio=[decode_audio(data[0])])
    with torch.inference_mode():
        ids = engine.model.generate(**request, do_sample=False, max_new_tokens=448)
    special = set(engine.processor.tokenizer.all_special_ids)
    own = [t for t in ids[0, request["input_ids"].shape[1] :].tolist() if t not in special]
    assert results[0].segments[0].tokens == own


def test_an_audio_language_model_takes_a_language_and_a_prompt_and_refuses_the_rest(qwen3, clips):
    """A language is forced in the request (the answer is the text alone, the language the
    one asked), a prompt is its context; what it cannot do is refused before any work."""
    samples = clips["fr_fleurs_000"].bytes
    forced = qwen3.transcribe([samples], TranscriptionOptions(language="fr"))[0]
    assert forced.language == "fr"
    prompted = qwen3.transcribe([samples], TranscriptionOptions(initial_prompt="Paris"))[0]
    assert prompted.duration == forced.duration
    request = qwen3.engine.processor.apply_transcription_request(
        audio=[np.zeros(16000, np.float32)], language=["fr"], prompt=["Paris"], tokenize=False
    )[0]
    assert "Paris<|im_end|>" in request and request.endswith("language French<asr_text>")
    for options, words in [
        (TranscriptionOptions(task="translate"), "task 'translate'"),
        (TranscriptionOptions(temperature=(0.4,)), "sampling"),
        (TranscriptionOptions(word_timestamps=True), "word timestamps"),
        (TranscriptionOptions(language="tlh"), "language 'tlh'"),
        (TranscriptionOptions(sample_len=50), "number of tokens"),
        (TranscriptionOptions(min_tokens=5), "number of tokens"),
        (TranscriptionOptions(hallucination_silence_threshold=2.0), "hallucination_silence"),
    ]:
        with pytest.raises(OptionsError, match=words):
            qwen3.check(options)
