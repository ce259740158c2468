"""Qwen3-ASR in the engine (natively, or through the transformers backend) against the
reference implementation: the same random weights, the same clips, the same token ids?

    python scripts/qwen3_asr_check.py --reference-python /tmp/qwenvenv/bin/python \\
        [--size tiny|0.6B|1.7B] [--backend native|transformers] \\
        [--manifest ../shared/audio/dev/manifest.jsonl] [--seconds 8]

The reference is the `qwen-asr` package's own transformers code, which pins an older
transformers than the project's: install it in a virtual environment of its own,

    python3 -m venv /tmp/qwenvenv && /tmp/qwenvenv/bin/pip install torch==2.13.0 \\
        && /tmp/qwenvenv/bin/pip install qwen-asr==0.0.6

A random-weight model of `--size` is made in the transformers layout and converted to the
reference's (`tools.qwen3_asr`); each clip (its first `--seconds`, decoded once here
and handed to both as the same 16 kHz samples) goes through the reference's prompt, processor
and `generate` in that environment, and through `Engine.open("DIR")`'s stream here (the
engine's own Qwen3-ASR, engine.qwen3_asr; `"hf:DIR"` with `--backend transformers`), as a
worker runs it. Both decode greedily, in fp32 on the CPU, `--batch` clips at a time (1: each
alone). The table gives, for each clip, the tokens each generated and where they first
differ.

Random weights put the top two tokens close (0.004 apart in logits, seen), so in batches the
shorter clips' padding (the prompt padded on the left, the audio on the right) changes enough
rounding to flip a token, on either side: neither implementation is batch-invariant there,
and `--batch 16` compares two different roundings.

On the CPU the reference's audio encoder attends across its 8 s attention windows (they reach
its attention only as FlashAttention-2's `cu_seqlens`), where transformers' port keeps them
apart, as the reference does on a GPU with FlashAttention: clips of up to 8 s (one window)
compare exactly; `--seconds 30` shows the difference, and `--windows` gives the reference's
attention those windows as a mask (its own code otherwise unchanged).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from engine import Engine, EngineConfig, TranscriptionOptions
from engine.audio import decode_audio
from tools import qwen3_asr

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference-python", required=True, help="the reference's interpreter")
    parser.add_argument("--size", choices=qwen3_asr.SIZES, default="tiny")
    parser.add_argument("--backend", choices=("native", "transformers"), default="native")
    parser.add_argument("--manifest", default=str(ROOT.parent / "shared/audio/dev/manifest.jsonl"))
    parser.add_argument("--seconds", type=float, default=8.0, help="of each clip (at most 30)")
    parser.add_argument("--batch", type=int, default=1, help="clips decoded together, both sides")
    parser.add_argument(
        "--windows",
        action="store_true",
        help="give the reference's audio attention its 8 s windows on the CPU too",
    )
    args = parser.parse_args()
    manifest = Path(args.manifest)
    entries = [json.loads(line) for line in manifest.read_text().splitlines() if line.strip()]
    n = int(min(args.seconds, 30.0) * 16000)
    clips = [decode_audio((manifest.parent / e["file"]).read_bytes())[:n] for e in entries]
    work = Path(tempfile.mkdtemp(prefix="qwen3-asr-check-"))
    made = qwen3_asr.make(work / "model", args.size)
    reference = qwen3_asr.reference(made, work / "reference")
    np.savez(work / "clips.npz", **{str(i): c for i, c in enumerate(clips)})
    subprocess.run(
        [args.reference_python, str(Path(qwen3_asr.__file__)), "run-reference",
         str(reference), str(work / "clips.npz"), str(work / "reference.json"),
         "--batch", str(args.batch), *(["--windows"] if args.windows else [])],
        check=True,
    )  # fmt: skip
    theirs = json.loads((work / "reference.json").read_text())
    source = f"hf:{made}" if args.backend == "transformers" else str(made)
    config = EngineConfig(model=source, name="qwen3-asr", device="cpu", slots=args.batch)
    stream = Engine.open(config)
    ours = stream.transcribe(clips, TranscriptionOptions(temperature=(0.0,)))
    tokenizer = stream.engine.chat.processor.tokenizer
    special = set(tokenizer.all_special_ids)
    marker = tokenizer.convert_tokens_to_ids("<asr_text>")
    same = 0
    print(
        f"\nQwen3-ASR {args.size}, random weights, {args.backend}; {len(clips)} clips, "
        f"first {args.seconds:g} s"
    )
    print("| clip | s | tokens (ours) | tokens (reference) | identical | first difference |")
    print("|---|---|---|---|---|---|")
    for entry, clip, result, answer in zip(entries, clips, ours, theirs, strict=True):
        tokens = [t for s in result.segments for t in s.tokens]
        row = answer["ids"]
        row = row[row.index(marker) + 1 :] if marker in row else row
        expected = [t for t in row if t not in special]
        diff = next(
            (i for i, (a, b) in enumerate(zip(tokens, expected, strict=False)) if a != b), None
        )
        if diff is None and len(tokens) != len(expected):
            diff = min(len(tokens), len(expected))
        same += diff is None
        print(
            f"| {entry['file']} | {len(clip) / 16000:.1f} | {len(tokens)} | {len(expected)} "
            f"| {'yes' if diff is None else 'no'} | {'' if diff is None else f'token {diff}'} |"
        )
    print(f"\nidentical token ids on {same} of {len(clips)} clips")
    return 0 if same == len(clips) else 1


if __name__ == "__main__":
    sys.exit(main())
