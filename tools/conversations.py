"""Conversations built from real speech of distinct speakers, with their ground truth: who spoke
when (RTTM), each speaker's words, and the stretches without speech (silence, room noise, a
tone, music) where a transcript must stay empty.

Each speaker's clips are cut at their pauses into pieces of a few seconds (Silero VAD,
`engine.vad`), and the pieces of 2 to 4 speakers are interleaved as turns, a short pause
apart, without overlap. A speaker's pieces keep their order and all are used, so a speaker's
reference is their clips' references, in order. Every conversation comes from a seed: the set
a threshold is chosen on and the set it is checked on are two seeds (scripts/diarization_check.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

import numpy as np

from engine.audio import decode_audio
from engine.mel import SAMPLE_RATE
from engine.vad import regions_of
from tools.evaluate import Clip
from tools.longform import leveled, room_tone

# The dev set's distinct English voices (manifest file names), each with every clip of theirs
# that is used. Not the FLEURS clips: their speakers are not named, and may repeat.
SPEAKERS = {
    "earnings_a": ["en_earnings22_1_4482311_3_62.flac"],
    "earnings_b": ["en_earnings22_3_4483589_261_321.flac"],
    "lj": [
        "en_ljspeech_LJ050-0131.flac",
        "en_ljspeech_LJ002-0020.flac",
        "en_ljspeech_LJ002-0035.flac",
    ],
    "jfk": ["en_jfk.flac"],
    "libri_2412": ["en_librispeech_2412-153948-0000.flac"],
    "libri_1272": ["en_librispeech_1272-128104-0000.flac"],
    "digits": ["en_vosk_digits_10001-90210-01803.flac"],
}
# the speakers whose words a WER scores: Whisper's English normalizer joins a string of spoken
# digits into one number, so the digits' WER says nothing of what was heard
SCORED = set(SPEAKERS) - {"digits"}
BRIDGE_S = 0.5  # pauses shorter than this inside a turn are part of it in the ground truth
NO_SPEECH = ("silence", "noise", "tone", "music")


@dataclass
class Piece:
    speaker: str
    samples: np.ndarray
    speech: list[tuple[float, float]]  # within the piece, seconds


@dataclass
class Conversation:
    name: str
    samples: np.ndarray
    turns: list[tuple[float, float, str]] = field(default_factory=list)  # start, end, speaker
    no_speech: list[tuple[float, float, str]] = field(default_factory=list)  # start, end, kind
    references: dict[str, str] = field(default_factory=dict)  # speaker: their words in order

    @property
    def speakers(self) -> list[str]:
        return sorted(self.references)

    @property
    def duration(self) -> float:
        return len(self.samples) / SAMPLE_RATE

    def rttm(self) -> str:
        return "".join(
            f"SPEAKER {self.name} 1 {s:.3f} {e - s:.3f} <NA> <NA> {who} <NA> <NA>\n"
            for s, e, who in self.turns
        )


def pieces(samples: np.ndarray, speaker: str, rng: np.random.Generator) -> list[Piece]:
    """One clip cut at pauses into pieces of 2 to 8 s of speech (a piece of speech longer
    than that without a pause stays whole); the cuts fall mid-pause."""
    regions = regions_of(samples)
    if not regions:
        return []
    out, first, target = [], 0, rng.uniform(2.0, 8.0)
    bounds = [0.0] + [(a[1] + b[0]) / 2 for a, b in pairwise(regions)]
    bounds.append(len(samples) / SAMPLE_RATE)
    for i in range(len(regions)):
        last = i == len(regions) - 1
        if last or regions[i][1] - regions[first][0] >= target:
            start, end = bounds[first], bounds[i + 1]
            cut = samples[round(start * SAMPLE_RATE) : round(end * SAMPLE_RATE)]
            speech = [(s - start, e - start) for s, e in regions[first : i + 1]]
            out.append(Piece(speaker, cut, speech))
            first, target = i + 1, rng.uniform(2.0, 8.0)
    return out


def no_speech(kind: str, seconds: float, rng: np.random.Generator) -> np.ndarray:
    """A stretch without speech: digital silence, room noise, a steady tone, or music (chords
    of harmonic notes, one every half second)."""
    n = round(seconds * SAMPLE_RATE)
    t = np.arange(n) / SAMPLE_RATE
    if kind == "silence":
        return np.zeros(n, np.float32)
    if kind == "noise":  # brown-ish noise: a fan, traffic
        white = rng.standard_normal(n)
        return leveled(
            np.cumsum(white) - np.convolve(np.cumsum(white), np.ones(400) / 400, "same"), 0.02
        )
    if kind == "tone":
        return (0.1 * np.sin(2 * np.pi * rng.choice([440.0, 1000.0]) * t)).astype(np.float32)
    out = np.zeros(n)
    note = SAMPLE_RATE // 2
    for start in range(0, n, note):
        root = 220.0 * 2 ** (rng.integers(0, 12) / 12)
        span = t[start : start + note] - t[start]
        for ratio in (1.0, 1.26, 1.5):  # a major chord, three harmonics a note
            for h in (1, 2, 3):
                out[start : start + note] += np.sin(2 * np.pi * root * ratio * h * span) / h
        out[start : start + note] *= np.exp(-3 * span)
    return leveled(out, 0.05)


def conversation(
    name: str,
    voices: dict[str, list[Piece]],
    references: dict[str, str],
    rng: np.random.Generator,
    stretches: int = 2,
) -> Conversation:
    """The speakers' pieces as turns of one or two pieces, each turn by another speaker than
    the last while another has pieces left, 0.2 to 1.0 s apart, each speaker at a level of
    their own; a stretch without speech before each of `stretches` turns drawn at random (two
    draws of one turn make one stretch)."""
    queues = {who: list(p) for who, p in voices.items()}
    levels = {who: 0.05 * 10 ** (rng.uniform(-6, 6) / 20) for who in voices}
    n_turns = sum(-(-len(q) // 2) for q in queues.values())
    at = set(rng.choice(np.arange(1, max(n_turns, 2)), size=stretches, replace=True).tolist())
    parts, turns, quiet, now, last, turn = [], [], [], 0.0, None, 0

    def add(samples: np.ndarray) -> None:
        nonlocal now
        parts.append(samples.astype(np.float32))
        now += len(samples) / SAMPLE_RATE

    while any(queues.values()):
        others = [w for w, q in queues.items() if q and w != last] or [last]
        who = others[rng.integers(len(others))]
        if turn in at:
            kind = NO_SPEECH[rng.integers(len(NO_SPEECH))]
            add(room_tone(0.5, rng))
            start = now
            add(no_speech(kind, rng.uniform(4.0, 8.0), rng))
            quiet.append((start, now, kind))
        add(room_tone(rng.uniform(0.2, 1.0), rng))
        for piece in [
            queues[who].pop(0) for _ in range(min(int(rng.integers(1, 3)), len(queues[who])))
        ]:
            for s, e in piece.speech:
                s, e = now + s, now + e
                if turns and turns[-1][2] == who and s - turns[-1][1] < BRIDGE_S:
                    turns[-1] = (turns[-1][0], e, who)
                else:
                    turns.append((s, e, who))
            add(leveled(piece.samples, levels[who]))
        last, turn = who, turn + 1
    add(room_tone(0.5, rng))
    return Conversation(name, np.concatenate(parts), turns, quiet, dict(references))


def conversations(
    clips: list[Clip], seed: int, count: int, speakers: dict[str, list[str]] = SPEAKERS
) -> list[Conversation]:
    """`count` conversations of 2, 3 and 4 in turn of `speakers` (name: their clips' files),
    from `seed`."""
    by_file = {c.file: c for c in clips}
    decoded = {
        f: decode_audio(by_file[f].path.read_bytes()) for fs in speakers.values() for f in fs
    }
    out = []
    for i in range(count):
        rng = np.random.default_rng([seed, i])
        size = min(2 + i % 3, len(speakers))  # 2, 3, 4, 2, ... speakers
        chosen = sorted(map(str, rng.choice(list(speakers), size=size, replace=False)))
        voices = {
            who: [p for f in speakers[who] for p in pieces(decoded[f], who, rng)] for who in chosen
        }
        refs = {who: " ".join(by_file[f].reference for f in speakers[who]) for who in chosen}
        out.append(conversation(f"conv{seed}_{i:02d}", voices, refs, rng))
    return out


def annotations(conv: Conversation, turns: list) -> tuple:
    """The conversation's ground truth and `turns` (`engine.diarize.Turn`s) as pyannote
    annotations: (reference, hypothesis)."""
    from pyannote.core import Annotation, Segment

    reference, hypothesis = Annotation(), Annotation()
    for s, e, who in conv.turns:
        reference[Segment(s, e)] = who
    for t in turns:
        hypothesis[Segment(t.start, t.end)] = t.speaker
    return reference, hypothesis


def der(conv: Conversation, turns: list) -> float:
    """The diarization error rate of `turns` against the conversation's ground truth:
    pyannote.metrics, 0.25 s collar."""
    from pyannote.metrics.diarization import DiarizationErrorRate

    return DiarizationErrorRate(collar=0.25)(*annotations(conv, turns))


def write(conv: Conversation, folder: Path) -> None:
    """The conversation's audio (FLAC), ground truth (RTTM) and the rest (JSON), in `folder`."""
    import json

    import soundfile as sf

    folder.mkdir(parents=True, exist_ok=True)
    sf.write(folder / f"{conv.name}.flac", conv.samples, SAMPLE_RATE)
    (folder / f"{conv.name}.rttm").write_text(conv.rttm())
    meta = {"no_speech": conv.no_speech, "references": conv.references, "duration_s": conv.duration}
    (folder / f"{conv.name}.json").write_text(json.dumps(meta, indent=1))
