"""Word timestamps checked against transformers' own (`return_timestamps="word"`) on the same
converted weights and alignment heads: whether both give the same words, and how far apart
their start and end times are. And both against a forced aligner's word alignments (Praat
TextGrids, such as the Montreal Forced Aligner's reference clips), where a clip has them.

Both decode each clip of up to 30 s greedily without timestamp tokens (the engine with
`timestamps=False`), so they read the same tokens and their words can be compared one to
one. The engine's times come from its batched pass (`engine.timing`) through the stream, as a
job's do.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.audio import decode_audio
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
    audio = [decode_audio(c.path.read_bytes()) for c in clips]
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


def table(rows: dict[str, list[ClipWords]]) -> list[str]:
    """Markdown rows: the distribution of each kind of gap (`ClipWords.gaps`), per label."""
    lines = [
        "| seconds apart | words | mean | median | p90 | p95 | max | ≤ 0.1 s | ≤ 0.3 s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, results in rows.items():
        for name, gap in pooled(results).items():
            if not len(gap):
                continue
            q = np.quantile(gap, [0.5, 0.9, 0.95])
            lines.append(
                f"| {label}{name} | {len(gap)} | {gap.mean():.3f} | {q[0]:.3f} | {q[1]:.3f} | "
                f"{q[2]:.3f} | {gap.max():.3f} | {(gap <= 0.1).mean():.1%} | "
                f"{(gap <= 0.3).mean():.1%} |"
            )
    return lines


def summary(results: list[ClipWords]) -> str:
    """A table of the distribution of start and end differences over every word compared."""
    same = [r for r in results if r.same_words]
    words = sum(len(r.ours) for r in same)
    lines = [
        f"{len(same)} of {len(results)} clips give the same words ({words} words compared)",
        "",
        *table({"": results}),
    ]
    for r in results:
        if not r.same_words:
            lines.append(f"different words in {r.file}: {len(r.ours)} against {len(r.theirs)}")
    return "\n".join(lines)


def textgrid_words(path: Path) -> list[TimedWord] | None:
    """The labelled intervals of a TextGrid's "words" tier (Praat's short text format); None
    without such a tier."""
    data = path.read_bytes()
    text = data.decode("utf-16" if data[:2] in (b"\xfe\xff", b"\xff\xfe") else "utf-8")
    lines = [line.strip() for line in text.splitlines()]
    if '"words"' not in lines:
        return None
    at = lines.index('"words"') + 4  # then: xmin, xmax, the interval count, the intervals
    count = int(lines[at - 1])
    intervals = (lines[at + 3 * k : at + 3 * k + 3] for k in range(count))
    return [(label.strip('"'), float(a), float(b)) for a, b, label in intervals if label != '""']


def _spelling(word: str) -> str:
    return re.sub(r"[^a-z0-9']", "", word.lower())


def against_alignment(file: str, words: list[TimedWord], reference: list[TimedWord]) -> ClipWords:
    """The words two transcripts spell alike (in order, ignoring case and punctuation), as a
    comparison of `words` against `reference`."""
    ours, theirs = [_spelling(w) for w, *_ in words], [_spelling(w) for w, *_ in reference]
    blocks = difflib.SequenceMatcher(a=ours, b=theirs, autojunk=False).get_matching_blocks()
    pairs = [(words[i + k], reference[j + k]) for i, j, n in blocks for k in range(n)]
    # the reference's words spelt as ours, so that they compare as the same words
    return ClipWords(file, [a for a, _ in pairs], [(a[0], *b[1:]) for a, b in pairs])


def aligned_clips(stream: Stream, textgrids: Path) -> dict[str, list[ClipWords]]:
    """The engine's words and transformers' against a forced aligner's, on each clip of
    `textgrids` (wav/<name>.wav beside textgrid/<name>.TextGrid, as in the Montreal Forced
    Aligner's test data): who -> a comparison per clip."""
    grids = sorted((textgrids / "textgrid").glob("*.TextGrid"))
    clips = [(g.stem, textgrid_words(g), textgrids / "wav" / f"{g.stem}.wav") for g in grids]
    clips = [(name, truth, wav) for name, truth, wav in clips if truth and wav.exists()]
    audio = [decode_audio(wav.read_bytes()) for *_, wav in clips]
    ours = stream.transcribe(audio, OPTIONS)
    loaded = stream.engine.loaded
    reference = transformers_words(loaded.path, loaded.device, loaded.dtype)
    out: dict[str, list[ClipWords]] = {"engine": [], "transformers": []}
    for (name, truth, _), samples, result in zip(clips, audio, ours, strict=True):
        engine = [(w.word, w.start, w.end) for w in result.words]
        for who, words in (("engine", engine), ("transformers", reference(samples))):
            out[who].append(against_alignment(name, words, truth))
    return out
