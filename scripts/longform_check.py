"""Long-form against the references: WER per recording and system, speech left without a
segment, and each window beside openai-whisper's (tools.longform).

python scripts/longform_check.py [--model tiny.en] [--kinds KINDS]
    [--openai-python PYTHON] [--faster-whisper-python PYTHON] [--no-transformers] [--json OUT]

The recordings are made of the manifest's English clips (default: ../shared/audio/dev). The
engine (sequential and chunked) and transformers run here; openai-whisper and faster-whisper
each in an environment of its own, whose interpreter is given:

    python3 -m venv /tmp/owvenv && /tmp/owvenv/bin/pip install torch==2.13.0 \\
        && /tmp/owvenv/bin/pip install openai-whisper
    python3 -m venv /tmp/fwvenv && /tmp/fwvenv/bin/pip install faster-whisper==1.2.1
    python scripts/longform_check.py --openai-python /tmp/owvenv/bin/python \\
        --faster-whisper-python /tmp/fwvenv/bin/python

Everything runs fp32 on the CPU (the engine: --device). The hour takes each system 5 to 15
minutes on a 2-core machine.

--rules OUT: instead, openai-whisper's windows on the recordings the suite checks the rules
on (`rule_recordings`, made of tests/data's clips), written to OUT, the fixture of
tests/engine/test_longform.py:

    python scripts/longform_check.py --openai-python /tmp/owvenv/bin/python \
        --rules tests/data/longform/openai-whisper.json
"""

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from engine import Engine, EngineConfig
from tools.evaluate import read_manifest
from tools.longform import (
    recordings,
    reference_runs,
    rule_recordings,
    run_all,
    tables,
    with_regions,
)
from tools.word_timing import openai_checkpoint

ROOT = Path(__file__).resolve().parents[1]
DEV = ROOT.parent / "shared" / "audio" / "dev" / "manifest.jsonl"
KINDS = "long,short-concat,as-recorded,concat,pauses,hour"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny.en")
    parser.add_argument("--manifest", type=Path, default=DEV)
    parser.add_argument("--kinds", default=KINDS, help=f"which recordings (default {KINDS})")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--openai-python", help="the interpreter of openai-whisper's environment")
    parser.add_argument("--faster-whisper-python", help="the interpreter of faster-whisper's")
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--json", type=Path, help="also write every run here")
    parser.add_argument("--rules", type=Path, help="write openai-whisper's rule windows here")
    args = parser.parse_args()
    if args.rules:
        return write_rules(args)
    started = time.perf_counter()

    def say(what: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f} s] {what}", file=sys.stderr, flush=True)

    stream = Engine.open(EngineConfig(model=args.model, device=args.device))
    made = recordings(read_manifest(args.manifest), set(args.kinds.split(",")))
    say(f"{len(made)} recordings, {sum(r.seconds for r in made) / 60:.1f} min; voice activity")
    with_regions(made, args.device)
    runs = run_all(
        stream,
        made,
        args.openai_python,
        args.faster_whisper_python,
        transformers=not args.no_transformers,
        progress=say,
    )
    print(f"{args.model}, fp32 on {args.device}, {args.manifest}")
    print("\n".join(tables(made, runs)))
    if args.json:
        rows = {
            "recordings": [
                {
                    "name": r.name,
                    "seconds": r.seconds,
                    "reference": r.reference,
                    "speech": r.regions,
                }
                for r in made
            ],
            "runs": {s: [dataclasses.asdict(x) for x in xs] for s, xs in runs.items()},
        }
        args.json.write_text(json.dumps(rows))
    return 0


def write_rules(args: argparse.Namespace) -> int:
    if not args.openai_python:
        sys.exit("--rules needs --openai-python")
    stream = Engine.open(EngineConfig(model=args.model, device="cpu"))
    made = rule_recordings(ROOT / "tests" / "data")
    checkpoint = openai_checkpoint(stream.engine.loaded, args.rules.with_suffix(".pt"))
    try:
        runs = reference_runs("openai-whisper", args.openai_python, checkpoint, made)
    finally:
        checkpoint.unlink()
    out = {r.name: dataclasses.asdict(run) for r, run in zip(made, runs, strict=True)}
    args.rules.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
