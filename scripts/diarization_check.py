"""Who spoke when, measured: DER (pyannote.metrics, 0.25 s collar) and the speaker count on
conversations built from the dev set's real speech (tools/conversations.py), and the choice of
the clustering threshold (engine.diarize.THRESHOLD) on one set, checked on another.

    python scripts/diarization_check.py [--audio-dir ../shared/audio/dev] [--count 8]
        [--device cpu] [--write conversations/]   # audio, RTTM and references of each
        [--transcribe tiny.en]   # and each speaker's WER, and the text in stretches without speech

Two sets of `--count` conversations (seeds 0 and 1: other speakers, orders, levels and pauses
of the same voices) are embedded once; each threshold of the grid clusters them all. The
threshold chosen is the one with the lowest mean DER on the first set (ties: the most right
speaker counts, then the middle of the tied range); the second set is scored at it, unseen.

With --transcribe, each conversation is also transcribed with the option diarize, as a job
that asks for it is (its speech found, every word given a speaker): each speaker's WER (the
found speakers mapped to the true ones as DER maps them), and the words whose middle falls in
a stretch without speech.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine import diarize  # noqa: E402
from engine.vad import regions_of  # noqa: E402
from tools.conversations import (  # noqa: E402
    SCORED,
    Conversation,
    annotations,
    conversations,
    der,
    write,
)
from tools.evaluate import read_manifest  # noqa: E402

GRID = [round(x, 2) for x in np.arange(0.40, 0.96, 0.05)]


def prepare(convs: list[Conversation], device: str, label: str) -> list[tuple]:
    """Each conversation's speech, windows and their embeddings (once for every threshold)."""
    out = []
    for conv in tqdm(convs, desc=f"embedding {label}", unit="conversation"):
        regions = regions_of(conv.samples, device)
        spans = diarize.windows(regions, conv.duration)
        out.append((conv, regions, spans, diarize.embed(conv.samples, spans, device)))
    return out


def turns_of(item: tuple, threshold: float) -> list[diarize.Turn]:
    """A prepared conversation's speaker turns, clustered at `threshold`."""
    _, regions, spans, embeddings = item
    labels = diarize.cluster(embeddings, diarize.SpeakerCount(), threshold)
    return diarize.turns(regions, spans, labels)


def score(prepared: list[tuple], threshold: float) -> tuple[list[float], int]:
    ders, right = [], 0
    for item in prepared:
        conv, turns = item[0], turns_of(item, threshold)
        ders.append(der(conv, turns))
        right += len({t.speaker for t in turns}) == len(conv.speakers)
    return ders, right


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--audio-dir", default=str(ROOT.parent / "shared" / "audio" / "dev"))
    parser.add_argument("--count", type=int, default=8, help="conversations a set")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--write", metavar="DIR", help="write each conversation's files here")
    parser.add_argument("--transcribe", metavar="MODEL", help="and per-speaker WER with MODEL")
    args = parser.parse_args()
    clips = read_manifest(Path(args.audio_dir) / "manifest.jsonl")
    sets = {
        name: conversations(clips, seed, args.count) for seed, name in enumerate(("tune", "check"))
    }
    if args.write:
        for convs in sets.values():
            for conv in convs:
                write(conv, Path(args.write))
    prepared = {name: prepare(convs, args.device, name) for name, convs in sets.items()}

    print("| threshold | tune: DER mean | median | max | right counts |")
    print("|---|---|---|---|---|")
    results = {}
    for threshold in GRID:
        ders, right = score(prepared["tune"], threshold)
        results[threshold] = (float(np.mean(ders)), right)
        print(
            f"| {threshold:.2f} | {np.mean(ders):.1%} | {np.median(ders):.1%} "
            f"| {max(ders):.1%} | {right}/{len(ders)} |"
        )
    best = min((round(d, 4), -r) for d, r in results.values())
    tied = [t for t, (d, r) in results.items() if (round(d, 4), -r) == best]
    chosen = tied[len(tied) // 2]
    print(
        f"\nchosen on the tune set: {chosen:.2f} (engine.diarize.THRESHOLD is {diarize.THRESHOLD})"
    )

    print(
        "\n| set | threshold | conversations | audio s | speakers | DER mean | median | max ",
        end="",
    )
    print("| right counts |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, items in prepared.items():
        for threshold in sorted({chosen, diarize.THRESHOLD}):
            ders, right = score(items, threshold)
            audio = sum(c.duration for c, *_ in items)
            speakers = "/".join(str(n) for n in sorted({len(c.speakers) for c, *_ in items}))
            print(
                f"| {name} | {threshold:.2f} | {len(items)} | {audio:.0f} | {speakers} "
                f"| {np.mean(ders):.1%} | {np.median(ders):.1%} | {max(ders):.1%} "
                f"| {right}/{len(items)} |"
            )
    if args.transcribe:
        transcribed(prepared, args.transcribe, args.device)
    return 0


def transcribed(prepared: dict[str, list[tuple]], model: str, device: str) -> None:
    """Each set's conversations transcribed with diarize, as a worker runs a job that asks
    (one stream, every conversation of a set at once): each speaker's WER, the found speakers
    mapped to the true ones as DER maps them, and the words in the stretches without speech."""
    from pyannote.metrics.diarization import DiarizationErrorRate

    from engine import Engine, EngineConfig, TranscriptionOptions
    from engine.options import SpeakerCount
    from tools.wer import word_error_rate

    stream = Engine.open(EngineConfig(model=model, device=device))
    options = TranscriptionOptions(diarize=SpeakerCount())
    print(f"\n| set | conversation | speakers found | WER by speaker ({model}) ", end="")
    print("| words in no speech |")
    print("|---|---|---|---|---|")
    for name, items in prepared.items():
        convs = [item[0] for item in items]
        with tqdm(total=len(convs), desc=f"transcribing {name}", unit="conversation") as bar:
            results = stream.transcribe(
                [c.samples for c in convs],
                options,
                progress=lambda i, done, total: bar.update(done >= total),
            )
        for conv, result in zip(convs, results, strict=True):
            words = result.words or []
            spoken = [diarize.Turn(w.start, w.end, w.speaker) for w in words]
            mapping = DiarizationErrorRate().optimal_mapping(*annotations(conv, spoken))
            said = {who: [] for who in conv.speakers}
            quiet = []
            for w in words:
                mid = (w.start + w.end) / 2
                if any(s <= mid < e for s, e, _ in conv.no_speech):
                    quiet.append(w.word.strip())
                if (who := mapping.get(w.speaker)) in said:
                    said[who].append(w.word)
            wers = ", ".join(
                f"{who} {word_error_rate([conv.references[who]], [''.join(said[who])]):.0%}"
                for who in conv.speakers
                if who in SCORED
            )
            found = f"{len(result.speakers)}/{len(conv.speakers)}"
            quiet_text = " ".join(quiet) or "—"
            print(f"| {name} | {conv.name} | {found} | {wers} | {quiet_text} |")


if __name__ == "__main__":
    sys.exit(main())
