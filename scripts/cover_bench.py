"""What keeping every stretch of speech costs in sequential long-form (`cover_speech`): Silero
VAD's time per hour of audio on the device (engine.vad, fed 30 s blocks as a long input's
first pass feeds it), and the engine over the long recordings of tools.longform all at
once, as a worker batches its jobs, with and without it: wall time (median of --runs, with
their spread), windows decoded, windows timed for words, and WER.

    python scripts/cover_bench.py [--model tiny.en] [--device cuda] [--dtype auto] [--runs 3]
        [--kinds long,concat,pauses,hour] [--manifest ../shared/audio/dev/manifest.jsonl]
        [--json out.json]

Both rows find the speech (a long input's first pass always does); only the first acts on it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from functools import partial
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import Engine, EngineConfig, TranscriptionOptions  # noqa: E402
from engine.mel import N_SAMPLES, SAMPLE_RATE  # noqa: E402
from engine.vad import Detector  # noqa: E402
from scripts import measure  # noqa: E402
from tools.evaluate import read_manifest  # noqa: E402
from tools.longform import Run, recordings, wer, window_log  # noqa: E402

DEV = Path(__file__).resolve().parents[2] / "shared" / "audio" / "dev" / "manifest.jsonl"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def vad_seconds_per_hour(samples: np.ndarray, device: str, runs: int) -> list[float]:
    """Seconds the detector takes over `samples`, per hour of audio, each of `runs` times."""

    def detect() -> None:
        sync(device)
        detector = Detector(device)
        for i in range(0, len(samples), N_SAMPLES):
            detector.feed(samples[i : i + N_SAMPLES])
        detector.finish()
        sync(device)

    _, seconds = measure.timed(detect, runs + 1)  # the first loads and warms
    return [s * 3600 * SAMPLE_RATE / len(samples) for s in seconds[1:]]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny.en")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--kinds", default="long,concat,pauses,hour")
    parser.add_argument("--manifest", type=Path, default=DEV)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    made = recordings(read_manifest(args.manifest), set(args.kinds.split(",")))
    audio_s = sum(r.seconds for r in made)
    print(f"{len(made)} recordings, {audio_s / 60:.1f} min, {args.model} on {args.device}")

    vad = vad_seconds_per_hour(np.concatenate([r.samples for r in made]), args.device, args.runs)
    print(
        f"VAD: {statistics.median(vad):.2f} s per hour of audio "
        f"({min(vad):.2f}-{max(vad):.2f}, {args.runs} runs)"
    )

    stream = Engine.open(EngineConfig(model=args.model, device=args.device, dtype=args.dtype))
    stream.warm()

    def transcribe(options: TranscriptionOptions) -> tuple[list[str], int, int]:
        """One run: its texts, the windows it decoded and those it timed for words."""
        before = stream.stats
        with window_log() as log:
            sync(args.device)
            results = stream.transcribe([r.samples for r in made], options)
            sync(args.device)
        timed = (stream.stats - before).timed  # none asked for words: skipped speech
        return [t.text for t in results], len(log), timed

    rows = []
    for cover in (False, True):
        run = partial(transcribe, TranscriptionOptions(cover_speech=cover))
        # the first run warms what the graphs do not
        (texts, windows, timed), walls = measure.timed(run, args.runs + 1)
        walls = walls[1:]
        wers = [wer(r, Run(text, [], None, 0)) for r, text in zip(made, texts, strict=True)]
        rows.append(
            {
                "cover_speech": cover,
                "wall_s": walls,
                "windows": windows,
                "timed": timed,
                "wer": {r.name: w for r, w in zip(made, wers, strict=True)},
            }
        )
    print("\n| cover_speech | wall s (median, spread) | audio s per s | windows | timed | WER % |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        median = statistics.median(row["wall_s"])
        spread = measure.spread(row["wall_s"], form="{median} ({low}-{high})")
        wers = ", ".join(f"{w:.2f}" for w in row["wer"].values())
        print(
            f"| {'on' if row['cover_speech'] else 'off'} | {spread} | "
            f"{audio_s / median:.0f} | {row['windows']} | {row['timed']} | {wers} |"
        )
    print("WER per recording: " + ", ".join(r.name for r in made))
    if args.json:
        args.json.write_text(json.dumps({"vad_s_per_hour": vad, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
