"""The full chaos run of issue 12 (the suite runs a short one, tests/faults/test_chaos.py).

Its own redis-server (AOF, `appendfsync always`), its own S3 server (moto, a versioned
bucket), the API and `--workers` worker processes (tiny.en on the CPU); `--jobs` submissions
of real speech, long-form, spectrograms, duplicates and malformed files from `--clients`
clients, while a random worker is `kill -9`ed every 10-20 s, Redis is `kill -9`ed and restarted
at 20 s and storage is frozen (SIGSTOP) for 20 s at 40 s. Prints what must be zero, the
answers and the chaos, as Markdown for docs/reliability.md; exits 1 on any problem.

    python scripts/chaos.py --jobs 300 --workers 3
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.conftest import open_stream, read_clips  # noqa: E402
from tests.faults import chaos  # noqa: E402
from tests.faults.fleet import Fleet, RedisServer, StorageServer  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0, help="of the plan and the monkey")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds for the jobs")
    args = parser.parse_args()

    plan = chaos.cases(read_clips(), args.jobs, args.seed)
    started = time.monotonic()
    calm = chaos.calm_texts(open_stream("tiny.en"), plan)
    print(f"calm run: {len(calm)} distinct good inputs in {time.monotonic() - started:.0f} s")
    with tempfile.TemporaryDirectory() as folder:
        storage = StorageServer()
        redis_server = RedisServer(Path(folder), fsync="always")
        redis_server.start()
        fleet = Fleet(Path(folder), redis_server, storage)
        try:
            report = chaos.run(
                fleet, storage, plan, calm, args.workers, args.clients, timeout_s=args.timeout
            )
        finally:
            fleet.close()
            redis_server.close()
            storage.close()
    print(markdown(report, args))
    return 1 if report.problems() else 0


def markdown(report: chaos.Report, args: argparse.Namespace) -> str:
    lines = [
        f"{args.jobs} submissions, {args.workers} workers, {args.clients} clients, "
        f"seed {args.seed}: {report.accepted} accepted, refused at the door "
        f"{dict(report.refused) or 'none'}, all terminal after {report.seconds:.0f} s.",
        "",
        "| check | count |",
        "|---|---|",
    ]
    for name in chaos.PROBLEMS:
        found = getattr(report, name)
        lines.append(f"| {name.replace('_', ' ')} | {len(found)} |")
    answers = ", ".join(f"{status}: {n}" for status, n in sorted(report.answers.items()))
    lines += ["", f"Answers by status: {answers}.", "", f"Chaos: {'; '.join(report.events)}."]
    for name, found in report.problems().items():
        lines += ["", f"{name}:", *(f"- {item}" for item in found[:20])]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
