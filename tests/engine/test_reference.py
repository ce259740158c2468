"""The engine against its references, fp32 on CPU, same converted weights: plain transformers
greedy `generate`, and CTranslate2 on the original packaged directory given the same features.
Both without timestamps, greedy only (no temperature fallback), as the references run."""

import numpy as np
import pytest
import torch
from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

from engine import TranscriptionOptions
from engine.audio import decode_audio
from engine.loader import PACKAGED, package_file
from tests.conftest import transcribe
from tools.evaluate import GREEDY
from tools.wer import word_error_rate

ENGLISH = ["en_jfk", "en_librispeech_1272-128104-0000", "en_ljspeech_LJ050-0131"]


def features(clip, n_mels=80) -> np.ndarray:
    audio = decode_audio(clip.bytes)
    extractor = WhisperFeatureExtractor(feature_size=n_mels)
    return extractor(audio, sampling_rate=16000, return_tensors="np").input_features


def tokens(result) -> list[int]:
    return [t for s in result.segments for t in s.tokens]


@pytest.fixture(scope="module")
def hf_tiny_en(tiny_en):
    path = tiny_en.engine.loaded.path
    return WhisperForConditionalGeneration.from_pretrained(path, dtype=torch.float32)


def test_tiny_en_tokens_equal_transformers_greedy(tiny_en, hf_tiny_en, clips):
    for name in ENGLISH:
        expected = hf_tiny_en.generate(torch.from_numpy(features(clips[name])))[0].tolist()
        expected = [t for t in expected if t < tiny_en.engine.loaded.tokenizer.eot]
        assert tokens(transcribe(tiny_en, clips[name].bytes, GREEDY)) == expected, name


def test_base_tokens_and_language_equal_transformers(base, clips):
    path = base.engine.loaded.path
    hf = WhisperForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    for name in ("en_jfk", "fr_fleurs_000"):
        expected = hf.generate(torch.from_numpy(features(clips[name])))[0].tolist()
        ours = transcribe(base, clips[name].bytes, GREEDY)
        assert ours.language == clips[name].language
        assert tokens(ours) == [t for t in expected if t < base.engine.loaded.tokenizer.eot]


def _ctranslate2_tokens(model_dir, mel, prompt) -> list[int]:
    ctranslate2 = pytest.importorskip("ctranslate2")
    model = ctranslate2.models.Whisper(str(model_dir), device="cpu", compute_type="float32")
    result = model.generate(
        ctranslate2.StorageView.from_array(mel), [prompt], beam_size=1, max_length=448
    )
    return result[0].sequences_ids[0]


def test_converted_tiny_en_equals_ctranslate2_on_the_original(tiny_en, clips):
    original = package_file(*PACKAGED["tiny.en"][0]).parent
    tok = tiny_en.engine.loaded.tokenizer
    for name in ENGLISH:
        mel = features(clips[name])
        expected = _ctranslate2_tokens(original, mel, [tok.sot, tok.no_timestamps])
        assert tokens(transcribe(tiny_en, mel, GREEDY)) == expected, name


def test_converted_base_equals_ctranslate2_on_the_joined_original(base, clips, tmp_path):
    parts = [package_file(*part) for part in PACKAGED["base"]]
    with open(tmp_path / "model.bin", "wb") as out:
        for part in parts:
            out.write(part.read_bytes())
    for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
        (tmp_path / name).write_bytes((parts[0].parent / name).read_bytes())
    tok = base.engine.loaded.tokenizer
    mel = features(clips["fr_fleurs_000"])
    expected = _ctranslate2_tokens(tmp_path, mel, tok.sot_sequence("fr", "transcribe"))
    options = TranscriptionOptions(language="fr", timestamps=False, temperature=(0.0,))
    ours = transcribe(base, mel, options)
    assert tokens(ours) == expected


def test_tiny_en_word_error_rate_on_clean_speech(tiny_en, english_clips):
    hypotheses = [r.text for r in tiny_en.transcribe([c.bytes for c in english_clips])]
    assert word_error_rate([c.reference for c in english_clips], hypotheses) <= 0.10
