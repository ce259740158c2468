"""Word timestamps checked against transformers' own (`return_timestamps="word"`) on the same
converted weights and alignment heads: whether both give the same words, and how far apart
their start and end times are.

Both decode each clip of up to 30 s greedily without timestamp tokens (the engine with
`timestamps=False`), so they read the same tokens and their words can be compared one to
one. The engine's times come from its batched pass (`engine.timing`) through the stream, as a
job's do.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile as sf
import torch

from engine.options import TranscriptionOptions
from engine.stream import Stream
from engine.tools.evaluate import Clip

OPTIONS = TranscriptionOptions(temperature=(0.0,), word_timestamps=True)
# A word that ends a phrase is followed by a pause in the speech: the engine ends it where
# the speech does (openai-whisper's path runs through the text tokens to end-of-text);
# transformers' path runs on through the timestamp token that follows it, so its end there
# takes in part of the pause. Such ends are compared apart.
PHRASE_END = tuple(".,!?;:。，！？")
TimedWord = tuple[str, float, float]  # (word, start s, end s)


@dataclass
class ClipWords:
    file: str
    ours: list[TimedWord]
    theirs: list[TimedWord]

    @property
    def same_words(self) -> bool:
        return [w.strip() for w, *_ in self.ours] == [w.strip() for w, *_ in self.theirs]

    def gaps(self) -> dict[str, np.ndarray]:
        """Seconds between the two's starts, ends inside phrases, and ends of phrases (none
        unless they give the same words)."""
        if not self.same_words:
            return {"start": np.zeros(0), "end": np.zeros(0), "end of phrase": np.zeros(0)}
        ours, theirs = np.array([t[1:] for t in self.ours]), np.array([t[1:] for t in self.theirs])
        gap = np.abs(ours - theirs).reshape(-1, 2)
        phrase_end = np.array([w.strip().endswith(PHRASE_END) for w, *_ in self.ours], bool)
        return {
            "start": gap[:, 0],
            "end": gap[~phrase_end, 1],
            "end of phrase": gap[phrase_end, 1],
        }


def transformers_words(
    path: Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> Callable[[np.ndarray], list[TimedWord]]:
    """A function: audio samples (16 kHz) -> transformers' timed words, with the converted
    weights in `path` (`LoadedModel.path`) and their alignment heads."""
    from transformers import WhisperForConditionalGeneration, WhisperProcessor, pipeline

    processor = WhisperProcessor.from_pretrained(path)
    model = WhisperForConditionalGeneration.from_pretrained(path, dtype=dtype)
    asr = pipeline(
        "automatic-speech-recognition",
        model=model.to(device).eval(),
        tokenizer=processor.tokenizer,
        feature_extractor=processor.feature_extractor,
        device=device,
        dtype=dtype,
    )

    def words(audio: np.ndarray) -> list[TimedWord]:
        out = asr(
            {"raw": audio, "sampling_rate": 16000},
            return_timestamps="word",
            generate_kwargs={"num_beams": 1},  # greedy, as the engine (the pipeline's is 5)
        )
        return [(c["text"], *c["timestamp"]) for c in out["chunks"]]

    return words


def compare(stream: Stream, clips: list[Clip]) -> list[ClipWords]:
    """The clips of up to 30 s: the engine's words (one batch) beside transformers'."""
    clips = [c for c in clips if c.seconds <= 30]
    audio = [sf.read(c.path, dtype="float32")[0] for c in clips]
    ours = stream.transcribe(audio, OPTIONS)
    loaded = stream.engine.loaded
    reference = transformers_words(loaded.path, loaded.device, loaded.dtype)
    return [
        ClipWords(c.file, [(w.word, w.start, w.end) for w in t.words], reference(a))
        for c, a, t in zip(clips, audio, ours, strict=True)
    ]


def pooled(results: list[ClipWords]) -> dict[str, np.ndarray]:
    """Every compared word's gaps, by kind (`ClipWords.gaps`)."""
    gaps = [r.gaps() for r in results]
    return {k: np.concatenate([g[k] for g in gaps] or [np.zeros(0)]) for k in gaps[0]}


def summary(results: list[ClipWords]) -> str:
    """A table of the distribution of start and end differences over every word compared."""
    same = [r for r in results if r.same_words]
    words = sum(len(r.ours) for r in same)
    lines = [
        f"{len(same)} of {len(results)} clips give the same words ({words} words compared)",
        "",
        "| seconds apart | words | mean | median | p90 | p95 | max | ≤ 0.1 s | ≤ 0.3 s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, gap in pooled(results).items():
        if not len(gap):
            continue
        q = np.quantile(gap, [0.5, 0.9, 0.95])
        lines.append(
            f"| {name} | {len(gap)} | {gap.mean():.3f} | {q[0]:.3f} | {q[1]:.3f} | {q[2]:.3f} | "
            f"{gap.max():.3f} | {(gap <= 0.1).mean():.1%} | {(gap <= 0.3).mean():.1%} |"
        )
    for r in results:
        if not r.same_words:
            lines.append(f"different words in {r.file}: {len(r.ours)} against {len(r.theirs)}")
    return "\n".join(lines)
