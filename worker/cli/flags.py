"""Command-line flags of job options that more than one command takes (`transcribe` here,
`backfill start` through the API), written once."""

from __future__ import annotations

import argparse
from typing import Any

SPEAKER_FLAGS = (
    ("speakers", "how many speakers there are"),
    ("min_speakers", "at least this many speakers"),
    ("max_speakers", "at most this many speakers"),
)


def add_voice_flags(p: argparse.ArgumentParser) -> None:
    """--vad / --no-vad, --hallucination-silence-threshold, --diarize and the speaker
    counts."""
    p.add_argument(
        "--vad",
        action=argparse.BooleanOptionalAction,
        help="voice activity: skip what is not speech, drop text over none (default: on for "
        "chunked audio over 30 s and with --diarize)",
    )
    p.add_argument(
        "--hallucination-silence-threshold",
        type=float,
        metavar="SECONDS",
        help="sequential: drop a segment that looks made up between silences this long",
    )
    p.add_argument(
        "--diarize",
        action="store_true",
        default=None,
        help="who spoke when: a speaker for each segment and word (implies word timestamps)",
    )
    for name, what in SPEAKER_FLAGS:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, help=f"with --diarize: {what}")


def voice_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The job option fields those flags set (None: not given)."""
    names = ("vad", "hallucination_silence_threshold", "diarize", *dict(SPEAKER_FLAGS))
    return {name: getattr(args, name) for name in names}
