"""The engine's CUDA graphs change nothing: same tokens as the same steps run eagerly.

python scripts/check_graphs.py [--model tiny] [--batch 16]
"""

import argparse
import dataclasses
import sys

from engine import EngineConfig
from tools.bench import engine_run


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    config = EngineConfig(
        model=f"random:{args.model}", device="cuda", dtype="fp16", slots=args.batch
    )
    lengths = [10, 37, 100, 64, 5, 200, 120, 80]
    n = 3 * args.batch
    graphed = engine_run(config, n, lengths)()
    eager = engine_run(dataclasses.replace(config, graphs=False), n, lengths)()
    same = sum(a == b for a, b in zip(graphed, eager, strict=True))
    right_length = all(len(t) == lengths[i % len(lengths)] for i, t in enumerate(graphed))
    print(
        f"random:{args.model}: graph == eager tokens on {same}/{n} windows; "
        f"every window exactly its length: {right_length}"
    )
    return 0 if same == n and right_length else 1


if __name__ == "__main__":
    sys.exit(main())
