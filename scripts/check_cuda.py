"""Correctness of the engine on CUDA: log-mel against WhisperFeatureExtractor, real-speech
transcription in fp32, fp16 and bf16 against each other and against the references' WER, and
the scheduler's CUDA graphs against the same steps run eagerly (fp16, greedy tokens).

    python scripts/check_cuda.py MANIFEST --model tiny.en [--json OUT.json]

Prints a table; exits non-zero if the log-mel differs by more than 1e-3 anywhere.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
from transformers import WhisperFeatureExtractor

from engine.audio import Audio
from engine.inputs import audio_source
from engine.longform import TranscriptionOptions
from engine.mel import log_mel_spectrogram
from engine.transcribe import Transcriber
from engine.wer import word_error_rate

GREEDY = TranscriptionOptions(timestamps=False, temperature=(0.0,))


def check_mel(entries: list[dict], root: Path, device: torch.device) -> float:
    worst = 0.0
    for n_mels in (80, 128):
        extractor = WhisperFeatureExtractor(feature_size=n_mels)
        for e in entries:
            audio = Audio((root / e["file"]).read_bytes()).decode()
            if len(audio) <= 480000:
                expected = extractor(
                    audio, sampling_rate=16000, return_tensors="np"
                ).input_features[0]
                ours = log_mel_spectrogram(torch.from_numpy(audio).to(device), n_mels).cpu().numpy()
            else:
                expected = extractor(
                    audio,
                    sampling_rate=16000,
                    truncation=False,
                    padding="longest",
                    return_tensors="np",
                ).input_features[0]
                source = audio_source(audio, n_mels, device)
                ours = torch.cat([source.window(s) for s in range(0, source.n_frames, 3000)], 1)
                ours = ours[:, : source.n_frames].cpu().numpy()
            worst = max(worst, float(np.abs(ours - expected).max()))
    return worst


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("manifest", type=Path)
    parser.add_argument("--model", default="tiny.en")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    entries = [json.loads(x) for x in args.manifest.read_text().splitlines() if x.strip()]
    root = args.manifest.parent
    english = [e for e in entries if e["language"] == "en"]
    report: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}

    report["mel_max_abs_diff"] = check_mel(entries, root, device)
    print(
        f"log-mel on CUDA vs WhisperFeatureExtractor: max |diff| {report['mel_max_abs_diff']:.2e}"
    )

    greedy_tokens = {}
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        t = Transcriber.load(args.model, device=device, dtype=dtype)
        start = time.perf_counter()
        texts = [t.transcribe((root / e["file"]).read_bytes()).text for e in english]
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        short = [e for e in english if e["duration_s"] <= 30]
        greedy_tokens[name] = [
            [
                tok
                for s in t.transcribe((root / e["file"]).read_bytes(), GREEDY).segments
                for tok in s.tokens
            ]
            for e in short
        ]
        wer = 100 * word_error_rate([e["reference"] for e in english], texts)
        audio = sum(e["duration_s"] for e in english)
        report[name] = {"wer": wer, "audio_seconds_per_second": audio / seconds}
        speed = audio / seconds
        print(f"{name}: WER {wer:.2f} % on {len(english)} English clips, {speed:.1f} audio s/s")
    eager = Transcriber.load(args.model, device=device, dtype=torch.float16)
    eager.graphs = False
    short = [e for e in english if e["duration_s"] <= 30]
    eager_tokens = [
        [
            tok
            for s in eager.transcribe((root / e["file"]).read_bytes(), GREEDY).segments
            for tok in s.tokens
        ]
        for e in short
    ]
    pairs = zip(eager_tokens, greedy_tokens["float16"], strict=True)
    same = f"{sum(a == b for a, b in pairs)}/{len(short)}"
    report["float16"]["graphs_identical_to_eager"] = same
    print(f"float16: CUDA-graph tokens identical to eager on {same} clips")
    for name in ("float16", "bfloat16"):
        pairs = zip(greedy_tokens[name], greedy_tokens["float32"], strict=True)
        same = f"{sum(a == b for a, b in pairs)}/{len(greedy_tokens['float32'])}"
        report[name]["greedy_identical_to_fp32"] = same
        print(f"{name}: greedy tokens identical to fp32 on {same} clips")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if report["mel_max_abs_diff"] < 1e-3 else 1


if __name__ == "__main__":
    sys.exit(main())
