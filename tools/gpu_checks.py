"""The second part of `whisperfleet bench`: real weights over real speech on the GPU.

What makes the engine fast must not change what it writes. For each model, over a manifest of
clips with reference transcripts (`../shared/audio/dev/manifest.jsonl`), each check with its
rule:

- fp32 on the CPU is the reference WER; fp16 on the GPU (CUDA graphs, Triton kernels: what a
  worker runs) must stay within 0.3 of it;
- fp32 on the GPU (TF32 off; full-width keys, Triton kernels, CUDA graphs) must give the CPU's
  greedy tokens on every clip: a change of fp16 tokens between commits is then rounding, not a
  bug;
- the CUDA graphs must change no token: the same steps run eagerly give the same tokens, greedy
  and sampled (each window draws from noise of its own, so sampling repeats);
- the Triton kernels must change no token against the torch code they replace
  (`kernels="torch"`), both eager;
- fp8 cross-attention K/V must stay within 0.3 of fp16's WER to be worth offering, and bf16
  within 0.3 of the reference;
- the log-mel computed on the GPU must match `WhisperFeatureExtractor` (max |diff| < 1e-3).

Without CUDA only the reference runs: the GPU's checks say they were not run, never that they
passed (on the CPU the paths they compare are one).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine.audio import Audio
from engine.engine import Engine, EngineConfig
from engine.inputs import audio_sources
from engine.mel import N_SAMPLES
from engine.options import TranscriptionOptions
from engine.stream import Stream
from tools.evaluate import GREEDY, Clip, read_manifest
from tools.wer import word_error_rate

SAMPLED = TranscriptionOptions(timestamps=True, temperature=(0.6,))
WER_TOLERANCE = 0.3  # percentage points
MEL_TOLERANCE = 1e-3
FP32_TOKENS = "greedy tokens, fp32 GPU == fp32 CPU"
FP16_WER = "WER fp16 GPU, graphs + Triton"
GRAPH_TOKENS = "greedy tokens, graphs == eager"
SAMPLED_TOKENS = "sampled tokens (T=0.6, timestamps), graphs == eager"
TRITON_TOKENS = "greedy tokens, Triton == torch"
FP8_WER = "WER fp16 GPU, fp8 cross K/V"
BF16_WER = "WER bf16 GPU"
GPU_CHECKS = (FP32_TOKENS, FP16_WER, GRAPH_TOKENS, SAMPLED_TOKENS, TRITON_TOKENS, FP8_WER, BF16_WER)


@dataclass
class Report:
    model: str
    lines: list[tuple[str, str, bool | None]] = field(default_factory=list)  # what, value, ok

    def add(self, what: str, value: str, ok: bool | None = None) -> None:
        """ok: whether the check's rule holds; None for a line without a rule (the reference)
        or a check not run."""
        self.lines.append((what, value, ok))
        mark = "" if ok is None else (" ok" if ok else " FAILED")
        print(f"{self.model}: {what}: {value}{mark}", flush=True)

    def same(self, what: str, tokens: list[list[int]], reference: list[list[int]]) -> None:
        """The rule for tokens: equal on every clip."""
        equal = sum(a == b for a, b in zip(tokens, reference, strict=True))
        self.add(what, f"{equal}/{len(reference)}", equal == len(reference))

    def within(self, what: str, wer: float, reference: float) -> None:
        """The rule for a WER: within WER_TOLERANCE of the reference's."""
        self.add(what, f"{wer:.2f} %", abs(wer - reference) <= WER_TOLERANCE)

    @property
    def passed(self) -> bool:
        return all(ok is not False for _, _, ok in self.lines)


def _texts(stream: Stream, clips: list[Clip]) -> list[str]:
    """Texts of the clips, transcribed together (speed is the bench's first part)."""
    return [r.text for r in stream.transcribe([c.path.read_bytes() for c in clips])]


def _greedy_tokens(
    stream: Stream, clips: list[Clip], options: TranscriptionOptions = GREEDY
) -> list[list[int]]:
    results = stream.transcribe([c.path.read_bytes() for c in clips], options)
    return [[tok for s in r.segments for tok in s.tokens] for r in results]


def check_model(model: str, clips: list[Clip], device: torch.device) -> Report:
    report = Report(model)
    english = [c for c in clips if c.language == "en"]
    short = [c for c in english if c.seconds <= 30]
    references = [c.reference for c in english]

    def wer(stream: Stream) -> float:
        return 100 * word_error_rate(references, _texts(stream, english))

    cpu = Engine.open(EngineConfig(model=model, device="cpu", dtype="fp32"))
    reference_wer = wer(cpu)
    report.add(f"WER fp32 CPU ({len(english)} English clips)", f"{reference_wer:.2f} %")
    cpu_tokens = _greedy_tokens(cpu, short)
    del cpu
    if device.type != "cuda":
        for what in GPU_CHECKS:
            report.add(what, f"not run: needs CUDA, not {device}")
        return report

    # what a worker runs; kernels="triton" so that a GPU without Triton fails, not passes
    served = EngineConfig(model=model, device=str(device), dtype="fp16", kernels="triton")
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        fp32 = Engine.open(dataclasses.replace(served, dtype="fp32"))
        report.same(FP32_TOKENS, _greedy_tokens(fp32, short), cpu_tokens)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    del fp32

    stream = Engine.open(served)
    fp16_wer = wer(stream)
    report.within(FP16_WER, fp16_wer, reference_wer)
    graphed = _greedy_tokens(stream, short)
    graphed_sampled = _greedy_tokens(stream, short, SAMPLED)
    del stream
    eager_stream = Engine.open(dataclasses.replace(served, graphs=False))
    eager = _greedy_tokens(eager_stream, short)
    report.same(GRAPH_TOKENS, graphed, eager)
    report.same(SAMPLED_TOKENS, graphed_sampled, _greedy_tokens(eager_stream, short, SAMPLED))
    del eager_stream
    plain = Engine.open(dataclasses.replace(served, graphs=False, kernels="torch"))
    report.same(TRITON_TOKENS, _greedy_tokens(plain, short), eager)
    del plain
    fp8 = Engine.open(dataclasses.replace(served, cross_kv="fp8"))
    report.within(FP8_WER, wer(fp8), fp16_wer)
    del fp8
    bf16 = Engine.open(dataclasses.replace(served, dtype="bf16"))
    report.within(BF16_WER, wer(bf16), reference_wer)
    return report


def check_mel(clips: list[Clip], device: torch.device) -> Report:
    """Log-mel on the GPU against transformers' extractor, 80 and 128 bins, short and long."""
    from transformers import WhisperFeatureExtractor

    report = Report("log-mel")
    worst = 0.0
    audios = [Audio(c.path.read_bytes()).decode() for c in clips]
    for n_mels in (80, 128):
        extractor = WhisperFeatureExtractor(feature_size=n_mels)
        for audio, source in zip(audios, audio_sources(audios, n_mels, device), strict=True):
            if len(audio) <= N_SAMPLES:  # these clips' log-mel was computed as one batch
                expected = extractor(audio, sampling_rate=16000, return_tensors="np")
                ours = source.window(0)
            else:
                expected = extractor(
                    audio,
                    sampling_rate=16000,
                    truncation=False,
                    padding="longest",
                    return_tensors="np",
                )
                windows = [source.window(s) for s in range(0, source.n_frames, 3000)]
                ours = torch.cat(windows, 1)[:, : source.n_frames]
            diff = np.abs(ours.cpu().numpy() - expected.input_features[0]).max()
            worst = max(worst, float(diff))
    report.add("max |GPU - WhisperFeatureExtractor|", f"{worst:.1e}", worst < MEL_TOLERANCE)
    return report


def run(models: list[str], manifest: Path) -> list[Report]:
    device = torch.device("cuda")
    torch.set_num_threads(os.cpu_count() or 1)
    clips = read_manifest(manifest)
    return [check_mel(clips, device)] + [check_model(m, clips, device) for m in models]
