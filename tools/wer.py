"""Word error rate as Whisper's papers measure it: both sides through the English normalizer.

The normalizer is the one transformers ships (`EnglishTextNormalizer`), with openai-whisper's
spelling map (`data/english.json`), so "colour"/"color" or "Mr."/"mister" are not errors.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import jiwer
from transformers.models.whisper.english_normalizer import EnglishTextNormalizer


@cache
def _normalizer() -> EnglishTextNormalizer:
    spelling = json.loads((Path(__file__).parent / "data" / "english.json").read_text())
    return EnglishTextNormalizer(spelling)


def normalize(text: str) -> str:
    return _normalizer()(text)


def word_error_rate(references: list[str], hypotheses: list[str]) -> float:
    """Corpus WER (errors over reference words, all clips pooled), as a fraction."""
    refs = [normalize(r) for r in references]
    hyps = [normalize(h) for h in hypotheses]
    pairs = [(r, h) for r, h in zip(refs, hyps, strict=True) if r]
    return jiwer.wer([r for r, _ in pairs], [h for _, h in pairs])
