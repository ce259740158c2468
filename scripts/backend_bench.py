"""One model through both backends: the native engine and the transformers one (`hf:`), and
Qwen3-ASR-shaped random weights through both too, on the same clips.

    python scripts/backend_bench.py [--device cuda] [--copies 4] [--qwen 0.6B] [--runs 3]
        [--qwen-slots N] [--model tiny.en|none] [--dtype auto|fp32|fp16|bf16]

Each stream is opened as a worker opens it (`Engine.open`, warmed) and given every clip at
once (`transcribe`, as the worker's batcher feeds it); the time is the median of --runs, with
their spread. Rows: windows (one per clip: the manifest's clips of up to 30 s, --copies times
each), windows/s, audio seconds per second, and how many texts equal the native engine's
(greedy, no timestamps: the same weights must write the same words). Qwen3-ASR's weights are
random (its real ones cannot be fetched here): its speed is that of its shapes, its text
meaningless, and each window generates up to 448 tokens unless it ends sooner (the rows give
the mean); its native row counts the windows whose tokens equal transformers'.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import Engine, EngineConfig, TranscriptionOptions  # noqa: E402
from engine.loader import model_dir  # noqa: E402
from scripts import measure  # noqa: E402
from tools import qwen3_asr  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GREEDY = TranscriptionOptions(timestamps=False, temperature=(0.0,))


def timed(source: str, args, items: list[bytes], options, slots=None):
    """The results of one run, and every run's seconds."""
    config = EngineConfig(model=source, device=args.device, dtype=args.dtype, slots=slots)
    stream = Engine.open(config)
    stream.warm()
    results, seconds = measure.timed(partial(stream.transcribe, items, options), args.runs)
    del stream
    return results, seconds


def tokens(results) -> list[list[int]]:
    return [[t for s in r.segments for t in s.tokens] for r in results]


def row(name: str, backend: str, n: int, audio_s: float, seconds: list[float], same: str) -> str:
    median = statistics.median(seconds)
    return (
        f"| {name} | {backend} | {n} | {measure.spread(seconds)} | {n / median:.1f} "
        f"| {audio_s / median:.0f} | {same} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--audio-dir", default=str(ROOT.parent / "shared" / "audio" / "dev"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="tiny.en", help="a packaged Whisper model, or none")
    parser.add_argument("--dtype", default="auto", choices=("auto", "fp32", "fp16", "bf16"))
    parser.add_argument("--copies", type=int, default=1)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--qwen", choices=qwen3_asr.SIZES, help="also Qwen3-ASR of this size")
    parser.add_argument("--qwen-slots", type=int, help="the native Qwen3-ASR's slots")
    args = parser.parse_args()

    data = measure.read_clips(Path(args.audio_dir)) * args.copies
    items, audio_s = [d for d, _ in data], sum(s for _, s in data)
    print(
        f"{len(items)} windows ({audio_s:.0f} s of speech), {args.device}, median of "
        f"{args.runs} runs (their spread)\n"
    )
    print("| model | backend | windows | seconds | windows/s | audio s/s | agreement |")
    print("|---|---|---|---|---|---|---|")
    if args.model != "none":
        native, seconds = timed(args.model, args, items, GREEDY)
        print(row(args.model, "native", len(items), audio_s, seconds, "—"), flush=True)
        hf = f"hf:{model_dir(args.model)}"  # the packaged weights, as transformers loads them
        through, seconds = timed(hf, args, items, GREEDY)
        pairs = zip(native, through, strict=True)
        same = sum(a.text.strip() == b.text.strip() for a, b in pairs)
        print(
            row(
                args.model,
                "transformers",
                len(items),
                audio_s,
                seconds,
                f"{same}/{len(items)} texts as native",
            ),
            flush=True,
        )
    if args.qwen:
        with tempfile.TemporaryDirectory() as tmp:
            path = qwen3_asr.make(Path(tmp) / "qwen3-asr", args.qwen)
            options = TranscriptionOptions(language="en")
            runs = []
            for source, slots in ((f"hf:{path}", None), (str(path), args.qwen_slots)):
                runs.append(timed(source, args, items, options, slots))
        (through, hf_s), (native, native_s) = runs
        name = f"Qwen3-ASR {args.qwen} (random)"
        expected = tokens(through)
        mean = sum(map(len, expected)) / len(items)
        print(
            row(name, "transformers", len(items), audio_s, hf_s, f"— ({mean:.0f} tokens a window)")
        )
        same = sum(a == b for a, b in zip(tokens(native), expected, strict=True))
        agree = f"{same}/{len(items)} token ids as transformers"
        print(row(name, "native", len(items), audio_s, native_s, agree))
        ratio = statistics.median(hf_s) / statistics.median(native_s)
        print(f"\nQwen3-ASR {args.qwen}: native {ratio:.1f}x transformers", flush=True)


if __name__ == "__main__":
    main()
