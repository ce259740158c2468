"""Plot `whisperfleet bench --json` results: windows/s by batch, engine vs transformers.

python scripts/plot_bench.py docs/bench/*.json --out docs/bench/throughput.png [--machine H100]
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {
    "engine": "tab:blue",
    "engine fp8": "tab:green",
    "engine bf16": "tab:purple",
    "transformers static": "tab:orange",
    "transformers dynamic": "tab:red",
    "transformers plain": "tab:brown",
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--machine", default="H200", help="the GPU the rows were measured on")
    args = parser.parse_args()
    rows = [r for f in args.files for r in json.loads(f.read_text()) if r["tokens"] == "100"]
    sizes = ["tiny", "base", "small", "medium", "large-v3"]
    order = {size: i for i, size in enumerate(sizes)}  # Whisper's by size, then the others
    models = sorted({r["model"] for r in rows}, key=lambda m: (order.get(m.split(":")[-1], 99), m))
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models, strict=True):
        mine = [r for r in rows if r["model"] == model]
        systems = sorted({r["system"] for r in mine})
        batches = sorted({r["batch"] for r in mine})
        width = 0.8 / len(systems)
        for i, system in enumerate(systems):
            values = [
                next(
                    (r["windows_per_s"] for r in mine if r["system"] == system and r["batch"] == b),
                    0.0,
                )
                for b in batches
            ]
            color = COLORS.get(system)
            xs = [x + i * width for x in range(len(batches))]
            bars = ax.bar(xs, values, width, label=system, color=color)
            ax.bar_label(bars, fmt="%.0f", fontsize=8)
        ax.set_xticks(
            [x + width * (len(systems) - 1) / 2 for x in range(len(batches))],
            [f"batch {b}" for b in batches],
        )
        ax.set_yscale("log")
        ax.set_title(f"{model}, fp16, {args.machine}, 100 tokens per 30 s window", fontsize=9)
        ax.set_ylabel("windows / s")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
