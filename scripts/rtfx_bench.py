"""Real speech through the engine against a transformers pipeline: RTFx (audio seconds per
second) on the same clips, the same weights and device, in one process.

    python scripts/rtfx_bench.py [--model tiny.en] [--audio-dir ../shared/audio/dev]
        [--copies 8] [--runs 3] [--batch-sizes 1,16] [--device cuda] [--json out.json]

- engine: `Engine.open(EngineConfig(...))`, as a worker opens it, then `Stream.transcribe`
  over every clip at once, given the files' bytes (decoding them is part of its time); warmed
  by one run first, then the median of --runs with their spread. Twice: with a job's default
  options (segment timestamps, temperature fallback), and with the pipeline's task (greedy,
  no timestamps, no fallback);
- transformers: `pipeline("automatic-speech-recognition")` on the engine's converted weights,
  greedy, given the decoded samples (its decoding is not timed), at each --batch-sizes; one
  warm-up batch first, then one timed run over every clip (the peer is the fastest size);
- each side's WER on the manifest's references (English clips), so speed is not bought with
  accuracy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import Engine, EngineConfig, TranscriptionOptions  # noqa: E402
from engine.audio import decode_audio  # noqa: E402
from scripts import measure  # noqa: E402
from tools.evaluate import read_manifest  # noqa: E402
from tools.wer import word_error_rate  # noqa: E402


def read_clips(audio_dir: Path) -> list[tuple[bytes, float, str]]:
    """The manifest's English clips of up to 30 s: (bytes, seconds, reference)."""
    found = read_manifest(audio_dir / "manifest.jsonl")
    return [
        (c.path.read_bytes(), c.seconds, c.reference)
        for c in found
        if c.seconds <= 30 and c.language == "en"
    ]


def pipeline_rtfx(loaded, audio: list[np.ndarray], batch_size: int) -> tuple[float, list[str]]:
    """Audio seconds per second of a transformers ASR pipeline over `audio` (16 kHz samples),
    greedy, on the engine's converted weights (`LoadedModel`); and its texts."""
    from transformers import WhisperForConditionalGeneration, WhisperProcessor, pipeline

    processor = WhisperProcessor.from_pretrained(loaded.path)
    model = WhisperForConditionalGeneration.from_pretrained(loaded.path, dtype=loaded.dtype)
    asr = pipeline(
        "automatic-speech-recognition",
        model=model.to(loaded.device).eval(),
        tokenizer=processor.tokenizer,
        feature_extractor=processor.feature_extractor,
        device=loaded.device,
        dtype=loaded.dtype,
    )

    def inputs(part: list[np.ndarray]) -> list[dict]:  # new each time: the pipeline pops keys
        return [{"raw": a, "sampling_rate": 16000} for a in part]

    greedy = {"num_beams": 1}  # as the engine (the model's generation config may say 5)
    asr(inputs(audio[:batch_size]), batch_size=batch_size, generate_kwargs=greedy)  # warm-up
    if loaded.device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = asr(inputs(audio), batch_size=batch_size, generate_kwargs=greedy)
    if loaded.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return sum(len(a) for a in audio) / 16000 / seconds, [o["text"] for o in out]


# the engine's rows: what a job gets by default, and the pipeline's own task
ENGINE_TASKS = {
    "defaults": TranscriptionOptions(),  # segment timestamps, temperature fallback
    "the pipeline's task": TranscriptionOptions(timestamps=False, temperature=(0.0,)),
}


def engine_rtfx(
    stream, items: list[bytes], options, references: list[str], audio_s: float, runs: int
) -> dict:
    """The engine's RTFx over every item at once (median of `runs` after a warm-up, with the
    fastest and slowest) and its WER."""
    stream.transcribe(items, options)  # warm-up: graphs, kernels, allocator
    results, times = measure.timed(partial(stream.transcribe, items, options), runs, "engine")
    return {
        "rtfx": audio_s / statistics.median(times),
        "spread": [audio_s / max(times), audio_s / min(times)],
        "wer": 100 * word_error_rate(references, [t.text for t in results]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny.en")
    parser.add_argument("--audio-dir", type=Path, default=Path("../shared/audio/dev"))
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--batch-sizes", default="1,16")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    clips = read_clips(args.audio_dir) * args.copies
    items = [data for data, _, _ in clips]
    references = [ref for _, _, ref in clips]
    audio_s = sum(s for _, s, _ in clips)
    stream = Engine.open(EngineConfig(model=args.model, device=args.device))
    engine = {
        name: engine_rtfx(stream, items, options, references, audio_s, args.runs)
        for name, options in ENGINE_TASKS.items()
    }
    audio = [decode_audio(data) for data in items]
    peers = {}
    for size in map(int, args.batch_sizes.split(",")):
        rtfx, peer_texts = pipeline_rtfx(stream.engine.loaded, audio, size)
        peers[size] = {"rtfx": rtfx, "wer": 100 * word_error_rate(references, peer_texts)}
    best = max(peers.values(), key=lambda p: p["rtfx"])
    device = stream.engine.loaded.device
    print(f"{len(clips)} clips, {audio_s:.0f} s of speech, {args.model}, {device}")
    print("| system | batch | RTFx | WER % |")
    print("|---|---|---|---|")
    for name, e in engine.items():
        low, high = e["spread"]
        print(f"| engine, {name} | all | {e['rtfx']:.0f} ({low:.0f}–{high:.0f}) | {e['wer']:.2f} |")
    for size, p in peers.items():
        print(f"| transformers pipeline | {size} | {p['rtfx']:.1f} | {p['wer']:.2f} |")
    for name, e in engine.items():
        print(f"engine ({name}) / best pipeline: {e['rtfx'] / best['rtfx']:.1f}x")
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    "model": args.model,
                    "clips": len(clips),
                    "audio_s": audio_s,
                    "engine": engine,
                    "pipeline": peers,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
