"""Word timestamps checked against transformers' own (`return_timestamps="word"`) on the same
converted weights and alignment heads: whether both give the same words, and how far apart
their start and end times are. And both against a forced aligner's word alignments (Praat
TextGrids, such as the Montreal Forced Aligner's reference clips), where a clip has them, and
against openai-whisper's own (`openai_words`), whose method the engine follows.

Each side decodes each clip of up to 30 s greedily, with segment timestamps, so the engine and
transformers read the same tokens and their words can be compared one to one. The engine's
times come from its batched pass (`engine.timing`) through the stream, as a job's do.
"""

from __future__ import annotations

import difflib
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from engine.audio import decode_audio
from engine.loader import LoadedModel
from engine.options import TranscriptionOptions
from engine.stream import Stream
from engine.timing import alignment_heads
from tools.evaluate import Clip

OPTIONS = TranscriptionOptions(temperature=(0.0,), word_timestamps=True)
# A word that ends a phrase is followed by a pause in the speech, which the path gives to the
# punctuation token after it. openai-whisper (whisper/timing.py, `merge_punctuations`) and the
# engine merge that token into the word's text and keep the word's own end; transformers
# (tokenization_whisper.py, `_merge_punctuations`) merges its time too, so the word ends where
# the punctuation does, after the pause. At a clip's end its path, on the attention of the
# generated sequence with its timestamp tokens, ends the word later still. Such ends are
# compared apart.
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


# transformers' parameter names -> openai-whisper's: transformers' convert_openai_to_hf.py
# (its WHISPER_MAPPING; the script is not in transformers' wheel) read backwards, in an order
# where no rule rewrites another's result
OPENAI_NAMES = (
    ("embed_positions.weight", "positional_embedding"),
    ("encoder.layer_norm.", "encoder.ln_post."),
    ("decoder.layer_norm.", "decoder.ln."),
    ("layers.", "blocks."),
    ("fc1", "mlp.0"),
    ("fc2", "mlp.2"),
    ("final_layer_norm", "mlp_ln"),
    ("self_attn_layer_norm", "attn_ln"),
    ("encoder_attn_layer_norm", "cross_attn_ln"),
    ("self_attn.", "attn."),
    ("encoder_attn.", "cross_attn."),
    ("q_proj", "query"),
    ("k_proj", "key"),
    ("v_proj", "value"),
    ("out_proj", "out"),
    ("embed_tokens", "token_embedding"),
)


def openai_checkpoint(loaded: LoadedModel, out: Path) -> Path:
    """The transformers weights in `loaded.path` as an openai-whisper checkpoint, what
    `whisper.load_model(out)` reads: "dims" and "model_state_dict" (fp32). openai-whisper
    has no output projection of its own: it is the token embedding."""
    from transformers import WhisperForConditionalGeneration

    model = WhisperForConditionalGeneration.from_pretrained(loaded.path, dtype=torch.float32)
    state = model.state_dict()
    if not torch.equal(state.pop("proj_out.weight"), state["model.decoder.embed_tokens.weight"]):
        raise ValueError(f"{loaded.path}: the output projection is not the token embedding")
    renamed = {}
    for name, tensor in state.items():
        name = name.removeprefix("model.")
        for theirs, ours in OPENAI_NAMES:
            name = name.replace(theirs, ours)
        renamed[name] = tensor
    # openai-whisper's dimensions have no MLP widths: they are four times the width there
    dims = {k: v for k, v in asdict(loaded.dims).items() if not k.endswith("_ff")}
    torch.save({"dims": dims, "model_state_dict": renamed}, out)
    return out


def openai_words(
    python: str, loaded: LoadedModel, audio: list[np.ndarray]
) -> dict[str, list[list[TimedWord]]]:
    """openai-whisper's own timed words for each clip's samples (16 kHz), on the weights in
    `loaded.path` and the engine's alignment heads, two ways: "transcribe" (as a user calls
    it) and "same input" (its timing on the engine's input): tools/openai_words.py, run
    by `python`, the interpreter of an environment with openai-whisper (not this project).
    Whatever it prints goes to stderr, away from the tables."""
    heads = [[layer, head] for layer, hs in alignment_heads(loaded).items() for head in hs]
    with tempfile.TemporaryDirectory(prefix="openai-words-") as tmp:
        work = Path(tmp)
        checkpoint = openai_checkpoint(loaded, work / "model.pt")
        np.savez(work / "clips.npz", *audio)
        subprocess.run(
            [python, str(Path(__file__).with_name("openai_words.py")), str(checkpoint),
             json.dumps(heads), str(work / "clips.npz"), str(work / "words.json")],
            check=True, stdout=sys.stderr,
        )  # fmt: skip
        answers = json.loads((work / "words.json").read_text())
    return {
        way: [[(w, start, end) for w, start, end in words] for words in clips]
        for way, clips in answers.items()
    }


def short_clips(clips: list[Clip]) -> list[tuple[Clip, np.ndarray]]:
    """The clips of up to 30 s (a window each), with the samples that every side is given."""
    return [(c, decode_audio(c.path.read_bytes())) for c in clips if c.seconds <= 30]


def compare(stream: Stream, clips: list[Clip]) -> list[ClipWords]:
    """The clips of up to 30 s: the engine's words (one batch) beside transformers'."""
    short = short_clips(clips)
    ours = stream.transcribe([a for _, a in short], OPTIONS)
    loaded = stream.engine.loaded
    reference = transformers_words(loaded.path, loaded.device, loaded.dtype)
    return [
        ClipWords(c.file, [(w.word, w.start, w.end) for w in t.words], reference(a))
        for (c, a), t in zip(short, ours, strict=True)
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
            lines += [
                f"    {''.join(w for w, *_ in words).strip()}" for words in (r.ours, r.theirs)
            ]
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


def textgrid_clips(textgrids: Path) -> list[tuple[str, list[TimedWord], np.ndarray]]:
    """Each clip of `textgrids` (wav/<name>.wav beside textgrid/<name>.TextGrid, as in the
    Montreal Forced Aligner's test data) that has aligned words: its name, those words and
    its samples."""
    grids = sorted((textgrids / "textgrid").glob("*.TextGrid"))
    clips = [(g.stem, textgrid_words(g), textgrids / "wav" / f"{g.stem}.wav") for g in grids]
    return [
        (name, truth, decode_audio(wav.read_bytes()))
        for name, truth, wav in clips
        if truth and wav.exists()
    ]


def aligned_clips(
    stream: Stream, clips: list[tuple[str, list[TimedWord], np.ndarray]]
) -> dict[str, list[ClipWords]]:
    """The engine's words and transformers' against a forced aligner's, on each clip of
    `textgrid_clips`: who -> a comparison per clip."""
    audio = [samples for *_, samples in clips]
    ours = stream.transcribe(audio, OPTIONS)
    loaded = stream.engine.loaded
    reference = transformers_words(loaded.path, loaded.device, loaded.dtype)
    out: dict[str, list[ClipWords]] = {"engine": [], "transformers": []}
    for (name, truth, _), samples, result in zip(clips, audio, ours, strict=True):
        engine = [(w.word, w.start, w.end) for w in result.words]
        for who, words in (("engine", engine), ("transformers", reference(samples))):
            out[who].append(against_alignment(name, words, truth))
    return out
