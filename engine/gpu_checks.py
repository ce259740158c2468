"""The second part of `whisperfleet bench`: real weights over real speech on the GPU.

What makes the engine fast must not change what it writes. For each model, over a manifest of
clips with reference transcripts (`../shared/audio/dev/manifest.jsonl`):

- fp32 on the CPU is the reference WER; fp16 on the GPU (CUDA graphs, Triton kernels, what a
  worker runs) must stay within 0.3 of it;
- fp32 on the GPU (its own code paths: full-width keys, Triton kernels, CUDA graphs): tokens
  compared with fp32 on the CPU and reported;
- the CUDA graphs must change no token: the same steps run eagerly give the same greedy tokens;
- the Triton kernels against the torch code they replace (`WHISPERFLEET_TRITON=0`): tokens
  compared and reported (split-K attention sums in another order, so an fp16 near-tie may go
  the other way);
- fp8 cross-attention K/V must stay within 0.3 of fp16's WER to be worth offering;
- the log-mel computed on the GPU must match `WhisperFeatureExtractor` (max |diff| < 1e-3).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine.audio import Audio
from engine.evaluate import GREEDY, Clip, read_manifest
from engine.inputs import audio_sources
from engine.loader import load_model
from engine.mel import N_SAMPLES
from engine.transcribe import Transcriber
from engine.wer import word_error_rate

WER_TOLERANCE = 0.3  # percentage points
MEL_TOLERANCE = 1e-3


@dataclass
class Report:
    model: str
    lines: list[tuple[str, str, bool | None]] = field(default_factory=list)  # what, value, ok

    def add(self, what: str, value: str, ok: bool | None = None) -> None:
        self.lines.append((what, value, ok))
        mark = "" if ok is None else (" ok" if ok else " FAILED")
        print(f"{self.model}: {what}: {value}{mark}", flush=True)

    @property
    def passed(self) -> bool:
        return all(ok is not False for _, _, ok in self.lines)


def _transcripts(t: Transcriber, clips: list[Clip]) -> list[str]:
    """Texts of the clips, transcribed together (speed is the bench's first part)."""
    return [r.text for r in t.transcribe_batch([c.path.read_bytes() for c in clips])]


def _greedy_tokens(t: Transcriber, clips: list[Clip]) -> list[list[int]]:
    results = t.transcribe_batch([c.path.read_bytes() for c in clips], GREEDY)
    return [[tok for s in r.segments for tok in s.tokens] for r in results]


def _same(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b, strict=True))


def check_model(model: str, clips: list[Clip], device: torch.device) -> Report:
    report = Report(model)
    english = [c for c in clips if c.language == "en"]
    short = [c for c in english if c.seconds <= 30]
    references = [c.reference for c in english]

    def wer(texts: list[str]) -> float:
        return 100 * word_error_rate(references, texts)

    cpu = Transcriber(load_model(model, device="cpu", dtype=torch.float32))
    reference_wer = wer(_transcripts(cpu, english))
    report.add(f"WER fp32 CPU ({len(english)} English clips)", f"{reference_wer:.2f} %")
    cpu_tokens = _greedy_tokens(cpu, short)
    del cpu

    # the GPU's own code paths (full-width keys, Triton kernels, CUDA graphs) in fp32, TF32
    # off: equal tokens say a change of fp16 tokens between commits is rounding, not a bug
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        fp32 = Transcriber(load_model(model, device=device, dtype=torch.float32))
        same = _same(_greedy_tokens(fp32, short), cpu_tokens)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    report.add("greedy tokens, fp32 GPU == fp32 CPU", f"{same}/{len(short)}")
    del fp32

    loaded = load_model(model, device=device, dtype=torch.float16)
    served = Transcriber(loaded)
    fp16_wer = wer(_transcripts(served, english))
    report.add(
        "WER fp16 GPU, graphs + Triton",
        f"{fp16_wer:.2f} %",
        abs(fp16_wer - reference_wer) <= WER_TOLERANCE,
    )
    graphed = _greedy_tokens(served, short)
    del served
    eager = _greedy_tokens(Transcriber(loaded, graphs=False), short)
    same = _same(graphed, eager)
    report.add("greedy tokens, graphs == eager", f"{same}/{len(short)}", same == len(short))
    previous = os.environ.get("WHISPERFLEET_TRITON")
    os.environ["WHISPERFLEET_TRITON"] = "0"
    try:
        plain = _greedy_tokens(Transcriber(loaded, graphs=False), short)
    finally:
        if previous is None:
            del os.environ["WHISPERFLEET_TRITON"]
        else:
            os.environ["WHISPERFLEET_TRITON"] = previous
    report.add("greedy tokens, Triton == torch", f"{_same(graphed, plain)}/{len(short)}")

    fp8 = Transcriber(loaded, cross_dtype=torch.float8_e4m3fn)
    fp8_wer = wer(_transcripts(fp8, english))
    report.add(
        "WER fp16 GPU, fp8 cross K/V",
        f"{fp8_wer:.2f} %",
        abs(fp8_wer - fp16_wer) <= WER_TOLERANCE,
    )
    del fp8, loaded

    bf16 = Transcriber(load_model(model, device=device, dtype=torch.bfloat16))
    report.add("WER bf16 GPU", f"{wer(_transcripts(bf16, english)):.2f} %")
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
