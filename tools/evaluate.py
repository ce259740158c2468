"""`whisperfleet eval`: accuracy and speed on a manifest, side by side with plain transformers.

The manifest is JSON lines with `file`, `reference`, `language` (the format of
../shared/audio/dev/manifest.jsonl). For each clip the engine runs its default pipeline
(sequential, timestamps, temperature fallback) and transformers its equivalent
(`generate(return_timestamps=True, condition_on_prev_tokens=True, temperature=(0.0, ...,
1.0), ...)`, long-form for clips over 30 s), on the same converted weights and device. Also:
greedy tokens without timestamps against transformers' greedy `generate` on clips up to 30 s,
chunked mode on clips over 30 s, and language detection on non-English clips (multilingual
models). WER: English clips, Whisper's English normalizer, jiwer.

With `seeds` above 1 the default pipeline also runs at seeds 1 .. seeds - 1 (the first run is
seed 0): windows that fall back sample, so the WER is reported as a mean and spread over them.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from engine.audio import Audio
from engine.options import TranscriptionOptions
from engine.stream import Stream
from tools.wer import word_error_rate

GREEDY = TranscriptionOptions(timestamps=False, temperature=(0.0,))


@dataclass
class Clip:
    """One manifest line."""

    file: str  # as the manifest names it, relative to the manifest
    path: Path
    reference: str
    language: str
    seconds: float


class ManifestError(ValueError):
    """A manifest that cannot be read, or names a clip that is not there; the message says
    which line."""


def read_manifest(path: Path) -> list[Clip]:
    """The manifest's clips, each checked to be there, before any is transcribed."""
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise ManifestError(f"{path}: {e.strerror}") from None
    clips = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            e = json.loads(line)
            clip = Clip(
                e["file"], path.parent / e["file"], e["reference"], e["language"], e["duration_s"]
            )
        except (ValueError, KeyError, TypeError) as error:
            raise ManifestError(
                f"{path}, line {n}: expected JSON with file, reference, language and "
                f"duration_s ({error!r})"
            ) from None
        if not clip.path.is_file():
            raise ManifestError(f"{path}, line {n}: no such file {clip.path}")
        clips.append(clip)
    return clips


TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


@dataclass
class ClipResult:
    file: str
    duration: float
    language: str
    reference: str
    engine_text: str = ""
    reference_text: str = ""  # transformers'
    chunked_text: str | None = None
    engine_seconds: float = 0.0
    reference_seconds: float = 0.0
    greedy_identical: bool | None = None  # clips up to 30 s
    engine_language: str | None = None
    reference_language: str | None = None
    timestamps_ok: bool = True  # segments in order, each inside the audio
    seed_texts: list[str] = field(default_factory=list)  # the default pipeline's, seeds 0, 1, ...


@dataclass
class Report:
    model: str
    device: str
    clips: list[ClipResult] = field(default_factory=list)
    reference: bool = True  # transformers ran; else its column stays empty
    left_out: int = 0  # the manifest's non-English clips, which an English-only model skips

    def wer(self, clips: list[ClipResult], attr: str) -> float:
        refs = [c.reference for c in clips]
        return 100 * word_error_rate(refs, [getattr(c, attr) for c in clips])

    def reference_wer(self, clips: list[ClipResult]) -> str:
        return f"{self.wer(clips, 'reference_text'):.2f}" if self.reference else ""

    def seed_wers(self, clips: list[ClipResult]) -> list[float]:
        """The WER % of these clips at each seed."""
        refs = [c.reference for c in clips]
        seeds = range(len(clips[0].seed_texts))
        return [100 * word_error_rate(refs, [c.seed_texts[i] for c in clips]) for i in seeds]

    def rows(self) -> list[tuple[str, str, str]]:
        """(metric, engine, transformers) rows of the summary table."""
        english = [c for c in self.clips if c.language == "en"]
        short = [c for c in english if c.duration <= 30]
        long = [c for c in english if c.duration > 30]
        groups = [
            (label, group)
            for label, group in (
                ("English clips <= 30 s", short),
                ("English clips > 30 s", long),
                ("all English clips", english),
            )
            if group
        ]
        rows = []
        for label, group in groups:
            n = f"WER %, {label} ({len(group)})"
            rows.append((n, f"{self.wer(group, 'engine_text'):.2f}", self.reference_wer(group)))
        seeds = len(english[0].seed_texts) if english else 0
        if seeds > 1:
            for label, group in groups:
                wers = self.seed_wers(group)
                rows.append(
                    (
                        f"WER %, {label}, seeds 0-{seeds - 1}: mean ± sd (min-max)",
                        f"{statistics.mean(wers):.2f} ± {statistics.stdev(wers):.2f} "
                        f"({min(wers):.2f}-{max(wers):.2f})",
                        "",
                    )
                )
            varied = sum(len(set(c.seed_texts)) > 1 for c in english)
            rows.append(
                ("English clips whose text changes with the seed", f"{varied}/{len(english)}", "")
            )
        for c in long:
            rows.append(
                (
                    f"WER %, {c.file}, sequential",
                    f"{self.wer([c], 'engine_text'):.2f}",
                    self.reference_wer([c]),
                )
            )
            rows.append((f"WER %, {c.file}, chunked", f"{self.wer([c], 'chunked_text'):.2f}", ""))
        if long:
            rows.append(
                (
                    "WER %, English clips > 30 s, chunked",
                    f"{self.wer(long, 'chunked_text'):.2f}",
                    "",
                )
            )
        ok = sum(c.timestamps_ok for c in self.clips)
        rows.append(
            ("segment timestamps monotonic and inside the audio", f"{ok}/{len(self.clips)}", "")
        )
        greedy = [c.greedy_identical for c in self.clips if c.greedy_identical is not None]
        if greedy:
            rows.append(
                ("greedy tokens identical, clips <= 30 s", f"{sum(greedy)}/{len(greedy)}", "")
            )
        other = [c for c in self.clips if c.language != "en" and c.engine_language]
        if other:
            right = sum(c.reference_language == c.language for c in other)
            rows.append(
                (
                    f"language detected correctly ({len(other)} non-English)",
                    f"{sum(c.engine_language == c.language for c in other)}/{len(other)}",
                    f"{right}/{len(other)}" if self.reference else "",
                )
            )
        audio = sum(c.duration for c in self.clips)
        engine_s = sum(c.engine_seconds for c in self.clips)
        reference_s = sum(c.reference_seconds for c in self.clips)
        rows.append(
            (
                "audio seconds per second",
                f"{audio / engine_s:.1f}",
                f"{audio / reference_s:.1f}" if reference_s else "",
            )
        )
        return rows

    def table(self) -> str:
        n, english = len(self.clips), sum(c.language == "en" for c in self.clips)
        clips = f"{n} clips"
        if self.left_out:  # said, not silent: the WER's clips are not the manifest's
            clips = (
                f"{n} of the manifest's {n + self.left_out} clips: {self.left_out} not English "
                "left out (an English-only model can neither transcribe nor identify them)"
            )
        elif english < n:
            clips += (
                f": WER on {english} English, language identification on {n - english} not English"
            )
        lines = [
            f"model {self.model}, {self.device}, {clips}",
            "",
            "| metric | engine | transformers |",
            "|---|---|---|",
        ]
        lines += [f"| {m} | {e} | {r} |" for m, e, r in self.rows()]
        return "\n".join(lines)


class TransformersReference:
    """Plain `WhisperForConditionalGeneration` on the engine's converted weights."""

    def __init__(self, stream: Stream):
        from transformers import WhisperForConditionalGeneration, WhisperProcessor

        from engine.hf import quiet_transformers

        quiet_transformers()
        loaded = stream.engine.loaded
        self.processor = WhisperProcessor.from_pretrained(loaded.path)
        self.model = WhisperForConditionalGeneration.from_pretrained(
            loaded.path, dtype=loaded.dtype
        ).to(loaded.device)
        self.model.eval()
        self.eot = loaded.tokenizer.eot
        self.multilingual = loaded.tokenizer.is_multilingual

    def _inputs(self, audio, long: bool) -> dict:
        kwargs = {"truncation": False, "padding": "longest"} if long else {}
        inputs = self.processor(
            audio, sampling_rate=16000, return_tensors="pt", return_attention_mask=True, **kwargs
        )
        return {k: v.to(self.model.device) for k, v in inputs.items()}

    def _generate(self, audio, long: bool, **kwargs):
        inputs = self._inputs(audio, long)
        inputs["input_features"] = inputs["input_features"].to(self.model.dtype)
        return self.model.generate(
            **inputs,
            return_timestamps=True,
            condition_on_prev_tokens=True,
            temperature=TEMPERATURES,
            compression_ratio_threshold=1.35,  # on token bytes
            logprob_threshold=-1.0,
            no_speech_threshold=0.6,
            **kwargs,
        )

    @torch.inference_mode()
    def transcribe(self, audio, long: bool) -> str:
        out = self._generate(audio, long)
        return self.processor.batch_decode(out, skip_special_tokens=True)[0].strip()

    @torch.inference_mode()
    def segments(self, audio) -> list[tuple[float, float, str]]:
        """Long-form: (start s, end s, text) of each segment."""
        out = self._generate(audio, long=True, return_segments=True)
        decode = self.processor.tokenizer.decode
        return [
            (float(s["start"]), float(s["end"]), decode(s["tokens"], skip_special_tokens=True))
            for s in out["segments"][0]
        ]

    @torch.inference_mode()
    def greedy_tokens(self, audio) -> list[int]:
        features = self._inputs(audio, long=False)["input_features"].to(self.model.dtype)
        return [t for t in self.model.generate(features)[0].tolist() if t < self.eot]

    @torch.inference_mode()
    def language(self, audio) -> str:
        features = self._inputs(audio, long=False)["input_features"].to(self.model.dtype)
        token = self.model.detect_language(features)[0].item()
        return self.processor.tokenizer.convert_ids_to_tokens(token)[2:-2]


def timestamps_ok(segments, duration: float) -> bool:
    """Each segment starts where the previous ended or later, and lies inside the audio."""
    end = 0.0
    for s in segments:
        if not (end <= s.start < s.end <= duration + 0.02):
            return False
        end = s.end
    return True


def evaluate(
    manifest: Path, stream: Stream, reference: bool = True, progress=None, seeds: int = 1
) -> Report:
    """seeds: run the default pipeline at seeds 0 .. seeds - 1 (see the module's docstring)."""
    if seeds < 1:
        raise ValueError(f"seeds {seeds}: expected 1 or more")
    entries = read_manifest(manifest)
    loaded = stream.engine.loaded
    multilingual = loaded.tokenizer.is_multilingual
    kept = entries if multilingual else [e for e in entries if e.language == "en"]
    ref = TransformersReference(stream) if reference else None
    device = f"{loaded.device} {str(loaded.dtype).removeprefix('torch.')}"
    report = Report(loaded.name, device, reference=reference, left_out=len(entries) - len(kept))
    for entry in progress(kept) if progress else kept:
        data = entry.path.read_bytes()
        audio = Audio(data).decode()
        clip = ClipResult(entry.file, len(audio) / 16000, entry.language, entry.reference)
        start = time.perf_counter()
        [result] = stream.transcribe([data])
        clip.engine_seconds = time.perf_counter() - start
        clip.engine_text, clip.engine_language = result.text, result.language
        clip.timestamps_ok = timestamps_ok(result.segments, clip.duration)
        clip.seed_texts = [result.text] + [
            stream.transcribe([data], TranscriptionOptions(seed=seed))[0].text
            for seed in range(1, seeds)
        ]
        long = clip.duration > 30
        if long:
            chunked = TranscriptionOptions(mode="chunked")
            clip.chunked_text = stream.transcribe([data], chunked)[0].text
        if ref is not None:
            start = time.perf_counter()
            clip.reference_text = ref.transcribe(audio, long)
            clip.reference_seconds = time.perf_counter() - start
            if not long:
                [greedy] = stream.transcribe([data], GREEDY)
                ours = [t for s in greedy.segments for t in s.tokens]
                clip.greedy_identical = ours == ref.greedy_tokens(audio)
            if multilingual and clip.language != "en":
                clip.reference_language = ref.language(audio)
        report.clips.append(clip)
    return report
