"""Long-form transcription checked against the references, window by window.

`recordings` builds long real recordings from a manifest's clips (its long clips as they are,
and concatenations of its English clips, minutes to an hour); each system transcribes the same
16 kHz samples of each: the engine sequential and chunked (in this process), transformers'
sequential long-form `generate` (here too), and openai-whisper's and faster-whisper's
`transcribe`, each in an environment of its own (scripts/longform_reference.py). For each
recording and system: the WER, the longest stretch of speech (Silero VAD, `engine.vad`) that no
segment covers, and, for the systems that report their windows, where each window started,
what it decoded and at which temperature, compared with openai-whisper's, the reference of
Whisper's seek, timestamp and fallback rules.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from engine.audio import decode_audio
from engine.loader import PACKAGED, package_file
from engine.longform import SequentialRequest, Window
from engine.mel import SAMPLE_RATE
from engine.options import TranscriptionOptions
from engine.stream import Stream
from engine.vad import regions_of, voiced_seconds
from tools.evaluate import Clip, TransformersReference
from tools.wer import word_error_rate

REFERENCE_RUNNER = Path(__file__).resolve().parents[1] / "scripts" / "longform_reference.py"


@dataclass
class Recording:
    name: str
    samples: np.ndarray  # 16 kHz mono float32
    reference: str
    regions: list[tuple[float, float]] = field(default_factory=list)  # speech (VAD), seconds

    @property
    def seconds(self) -> float:
        return len(self.samples) / SAMPLE_RATE


def concatenation(
    name: str,
    clips: list[tuple[np.ndarray, str]],
    pauses: list[np.ndarray],
) -> Recording:
    """Clips (samples, reference) one after another, `pauses[i]` after clip i."""
    parts = [x for (samples, _), pause in zip(clips, pauses, strict=True) for x in (samples, pause)]
    return Recording(name, np.concatenate(parts), " ".join(ref for _, ref in clips))


def room_tone(seconds: float, rng: np.random.Generator, level: float = 3e-3) -> np.ndarray:
    """A pause that is not digital silence: quiet noise, as a microphone records a room."""
    return (rng.standard_normal(round(seconds * SAMPLE_RATE)) * level).astype(np.float32)


def leveled(samples: np.ndarray, rms: float = 0.05) -> np.ndarray:
    """The clip at one loudness (root mean square, about -26 dBFS): the dev set's clips come
    from sources 45 dB apart (FLEURS peaks at -45 dBFS, JFK at -2), which one recording does
    not hold, and next to a loud clip a quiet one is below what Whisper's log-mel keeps."""
    return (samples * (rms / max(float(np.sqrt(np.mean(samples**2))), 1e-9))).astype(np.float32)


def third_silence(clips: list[Clip]) -> Recording:
    """A manifest's English clips (each `leveled`), each followed by room tone half as long as
    itself: a third of the recording is without speech, as in an archive of calls."""
    english = [c for c in clips if c.language == "en"]
    rng = np.random.default_rng(0)
    decoded = [(leveled(decode_audio(c.path.read_bytes())), c.reference) for c in english]
    pauses = [room_tone(len(x) / SAMPLE_RATE / 2, rng) for x, _ in decoded]
    return concatenation("third-silence", decoded, pauses)


def recordings(clips: list[Clip], kinds: set[str] | None = None) -> list[Recording]:
    """The long recordings made of a manifest's English clips, by kind (the concatenations'
    clips each `leveled`):

    - "long": each clip over 30 s, as it is;
    - "short-concat": the clips of up to 30 s one after another, 1 s of silence between;
    - "as-recorded": the same at each clip's own level, 45 dB apart (where the references drop
      passages);
    - "concat": every clip, 1 s apart;
    - "pauses": every clip, apart by pauses of room tone from 0.3 to 12 s, and three long ones
      (20, 30 and 45 s, one of them digital silence): what no-speech skips and fallbacks see;
    - "hour": about an hour, the clips in seven shuffled passes, 0.3 to 3 s apart.
    """
    english = [c for c in clips if c.language == "en"]
    decoded = [(decode_audio(c.path.read_bytes()), c.reference) for c in english]
    raw = [(x, r) for (x, r), c in zip(decoded, english, strict=True) if c.seconds <= 30]
    long = [
        Recording(c.file, x, c.reference)
        for (x, _), c in zip(decoded, english, strict=True)
        if c.seconds > 30
    ]
    decoded = [(leveled(x), reference) for x, reference in decoded]
    short = [d for d, c in zip(decoded, english, strict=True) if c.seconds <= 30]
    second = np.zeros(SAMPLE_RATE, np.float32)
    rng = np.random.default_rng(0)
    out = []
    want = kinds or {"long", "short-concat", "as-recorded", "concat", "pauses", "hour"}
    if "long" in want:
        out += long
    if "short-concat" in want and short:
        out.append(concatenation("short-concat", short, [second] * len(short)))
    if "as-recorded" in want and raw:
        out.append(concatenation("as-recorded", raw, [second] * len(raw)))
    if "concat" in want:
        out.append(concatenation("concat", decoded, [second] * len(decoded)))
    # made whether asked or not: the hour draws from the same generator after them, and is
    # the same recording whichever kinds are asked
    pauses = [room_tone(rng.uniform(0.3, 12.0), rng) for _ in decoded]
    for i, seconds in zip((3, 9, 15), (20.0, 30.0, 45.0), strict=True):
        if i < len(pauses):
            pauses[i] = (
                room_tone(seconds, rng)
                if seconds != 30.0
                else np.zeros(round(seconds * SAMPLE_RATE), np.float32)
            )
    if "pauses" in want:
        out.append(concatenation("pauses", decoded, pauses))
    if "hour" in want:
        order = [i for _ in range(7) for i in rng.permutation(len(decoded))]
        pauses = [room_tone(rng.uniform(0.3, 3.0), rng) for _ in order]
        out.append(concatenation("hour", [decoded[i] for i in order], pauses))
    return out


def rule_recordings(data: Path) -> list[Recording]:
    """Recordings of the test clips (tests/data, and tests/data/longform) on which each of
    Whisper's long-form rules acts, for the suite to check the engine's windows against
    openai-whisper's (tests/engine/test_longform.py):

    - "seek": four clips 1 s apart, about 40 s: a window whose last segment is unfinished
      (the seek goes to its last timestamp), then a last window padded past the end;
    - "silence": a clip, 60 s of room tone, a clip: a window skipped as silence;
    - "fallback": three clips reversed: greedy text fails the checks, the window falls back;
    - "skips": four FLEURS clips at their own (quiet) levels, 1 s apart: the windows pass over
      a whole clip, then the last one, speech no segment covers;
    - "digits": "one two three", 2.7 s, alone.
    """

    def clip(name: str) -> tuple[np.ndarray, str]:
        path = data / f"{name}.flac"
        path = path if path.exists() else data / "longform" / f"{name}.flac"
        lines = (path.parent / "manifest.jsonl").read_text().splitlines()
        reference = next(
            json.loads(x)["reference"] for x in lines if json.loads(x)["file"] == path.name
        )
        return decode_audio(path.read_bytes()), reference

    second = np.zeros(SAMPLE_RATE, np.float32)
    jfk, quilter, lj = (
        clip(n) for n in ("en_jfk", "en_librispeech_1272-128104-0000", "en_ljspeech_LJ050-0131")
    )
    fleurs = [clip(f"en_fleurs_00{i}") for i in range(6, 10)]
    backwards = [(x[::-1].copy(), "") for x, _ in (jfk, quilter, lj)]
    rng = np.random.default_rng(0)
    return [
        concatenation("seek", [jfk, quilter, lj, jfk], [second] * 4),
        concatenation("silence", [jfk, quilter], [room_tone(60.0, rng), second]),
        concatenation("fallback", backwards, [second] * 3),
        concatenation("skips", fleurs, [second] * 4),
        Recording("digits", *clip("en_sr_one_two_three")),
    ]


@dataclass
class WindowLog:
    """One decoded window, as a system reports it: where it started (frames), how many frames
    of audio it held, the temperature of the try that was kept and that try's tokens."""

    seek: int
    size: int
    temperature: float
    tokens: list[int]
    no_speech_prob: float
    avg_logprob: float
    tries: list[tuple[float, list[int]]] | None = None  # every try, where a system says


@dataclass
class Run:
    """What one system made of one recording."""

    text: str
    segments: list[tuple[float, float, str]]  # (start s, end s, text)
    windows: list[WindowLog] | None  # None: the system does not say
    seconds: float  # wall time

    @classmethod
    def from_json(cls, d: dict) -> Run:
        windows = d.get("windows")
        return cls(
            d["text"],
            [tuple(s) for s in d["segments"]],
            None if windows is None else [WindowLog(**w) for w in windows],
            d["seconds"],
        )


@contextmanager
def window_log() -> Iterator[list[WindowLog]]:
    """Every window the engine's sequential requests take back while inside, in order."""
    log: list[WindowLog] = []
    accept = SequentialRequest.accept

    def logged(self, window: Window, result, times=None) -> None:
        log.append(
            WindowLog(
                window.seek,
                window.size,
                result.temperature,
                list(result.tokens),
                result.no_speech_prob,
                result.avg_logprob,
            )
        )
        accept(self, window, result, times)

    SequentialRequest.accept = logged
    try:
        yield log
    finally:
        SequentialRequest.accept = accept


def engine_runs(
    stream: Stream, recordings: list[Recording], options: TranscriptionOptions
) -> list[Run]:
    runs = []
    for r in recordings:
        with window_log() as log:
            start = time.perf_counter()
            [t] = stream.transcribe([r.samples], options)
            seconds = time.perf_counter() - start
        segments = [(s.start, s.end, s.text) for s in t.segments]
        windows = list(log) if options.mode == "sequential" else None
        runs.append(Run(t.text, segments, windows, seconds))
    return runs


def transformers_runs(stream: Stream, recordings: list[Recording]) -> list[Run]:
    """transformers' sequential long-form on the engine's converted weights: `generate` with
    timestamps, the previous text as a prompt and the fallback schedule, as `whisperfleet eval`
    runs it."""
    reference = TransformersReference(stream)
    runs = []
    for r in recordings:
        start = time.perf_counter()
        segments = reference.segments(r.samples)
        seconds = time.perf_counter() - start
        runs.append(Run("".join(t for *_, t in segments), segments, None, seconds))
    return runs


def reference_runs(system: str, python: str, model: Path, recordings: list[Recording]) -> list[Run]:
    """openai-whisper's or faster-whisper's `transcribe` of each recording, run by `python`
    (an environment with that package, not this project): scripts/longform_reference.py.
    model: an openai-whisper checkpoint, or a CTranslate2 directory."""
    with tempfile.TemporaryDirectory(prefix="longform-") as tmp:
        work = Path(tmp)
        np.savez(work / "audio.npz", *[r.samples for r in recordings])
        subprocess.run(
            [python, str(REFERENCE_RUNNER), system, str(model), str(work / "audio.npz"),
             str(work / "runs.json")],
            check=True, stdout=sys.stderr,
        )  # fmt: skip
        return [Run.from_json(d) for d in json.loads((work / "runs.json").read_text())]


def ctranslate2_dir(name: str, scratch: Path) -> Path:
    """The CTranslate2 directory a packaged model came in (what faster-whisper loads): the
    package's own, or, for a model shipped in parts, the parts joined in `scratch`."""
    files = PACKAGED[name]
    first = package_file(*files[0]).parent
    if len(files) == 1:
        return first
    for f in first.iterdir():
        if not f.name.startswith("model.bin"):
            shutil.copy(f, scratch / f.name)
    with open(scratch / "model.bin", "wb") as out:
        for package, relative in files:
            with open(package_file(package, relative), "rb") as part:
                shutil.copyfileobj(part, out)
    return scratch


@dataclass(frozen=True)
class Gap:
    """The stretch between two segments (or before the first, or after the last) holding the
    most speech."""

    start: float
    end: float
    voiced: float  # seconds of speech in it


def widest_gap(
    segments: list[tuple[float, float, str]], regions: list[tuple[float, float]], seconds: float
) -> Gap:
    """Of the stretches no segment covers, the one with the most speech in it (VAD regions)."""
    covered = sorted((s, e) for s, e, text in segments if text.strip())
    gaps, at = [], 0.0
    for s, e in covered:
        if s > at:
            gaps.append((at, s))
        at = max(at, e)
    if at < seconds:
        gaps.append((at, seconds))
    best = Gap(0.0, 0.0, 0.0)
    for s, e in gaps:
        voiced = voiced_seconds(regions, s, e)
        if voiced > best.voiced:
            best = Gap(s, e, voiced)
    return best


def with_regions(recordings: list[Recording], device: str = "cpu") -> list[Recording]:
    for r in recordings:
        r.regions = regions_of(r.samples, device)
    return recordings


@dataclass(frozen=True)
class WindowDiff:
    """How a system's windows compare with openai-whisper's, in order."""

    compared: int  # windows both decoded, up to where the two part
    same: int  # of those, with the same start, length, temperature and tokens
    first_difference: str | None  # what differs in the first window that does


def compare_windows(ours: list[WindowLog], theirs: list[WindowLog]) -> WindowDiff:
    """Window by window until the first that differs: its start, then what it decoded. After
    that the two see different audio, so the rest cannot be paired."""
    same = 0
    for i, (a, b) in enumerate(zip(ours, theirs, strict=False)):
        where = f"window {i} (frame {a.seek})"
        if a.seek != b.seek or a.size != b.size:
            why = f"window {i}: starts at frame {a.seek} ({a.size}) against {b.seek} ({b.size})"
            return WindowDiff(i + 1, same, why)
        if a.temperature != b.temperature:
            why = f"{where}: kept temperature {a.temperature} against {b.temperature}"
            return WindowDiff(i + 1, same, why)
        if a.tokens != b.tokens:
            pairs = zip(a.tokens, b.tokens, strict=False)
            at = next((k for k, (x, y) in enumerate(pairs) if x != y), None)
            at = min(len(a.tokens), len(b.tokens)) if at is None else at
            why = f"{where}: tokens part at token {at} of {len(a.tokens)}/{len(b.tokens)}"
            if a.temperature > 0:
                why += " (sampled)"
            return WindowDiff(i + 1, same, why)
        same += 1
    if len(ours) != len(theirs):
        why = f"{len(ours)} windows against {len(theirs)}"
        return WindowDiff(min(len(ours), len(theirs)), same, why)
    return WindowDiff(len(ours), same, None)


def wer(recording: Recording, run: Run) -> float:
    return 100 * word_error_rate([recording.reference], [run.text])


def tables(recordings: list[Recording], runs: dict[str, list[Run]]) -> list[str]:
    """Markdown: WER per recording and system; the widest gap in each run; the windows against
    openai-whisper's; what each system spent."""
    systems = list(runs)
    lines = ["| recording | minutes | " + " | ".join(systems) + " |"]
    lines.append("|---|---|" + "---|" * len(systems))
    for i, r in enumerate(recordings):
        cells = [f"{wer(r, runs[s][i]):.2f}" for s in systems]
        lines.append(f"| {r.name} | {r.seconds / 60:.1f} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Speech left without a segment: the gap holding the most (s of speech, where)",
        "",
    ]
    lines.append("| recording | speech s | " + " | ".join(systems) + " |")
    lines.append("|---|---|" + "---|" * len(systems))
    for i, r in enumerate(recordings):
        voiced = sum(e - s for s, e in r.regions)
        cells = []
        for s in systems:
            g = widest_gap(runs[s][i].segments, r.regions, r.seconds)
            cells.append(f"{g.voiced:.1f} ({g.start:.0f}-{g.end:.0f} s)" if g.voiced else "0.0")
        lines.append(f"| {r.name} | {voiced:.0f} | " + " | ".join(cells) + " |")
    if "openai-whisper" in runs:
        lines += ["", "Windows against openai-whisper's (start, length, temperature, tokens)", ""]
        lines.append("| recording | system | same / compared | first difference |")
        lines.append("|---|---|---|---|")
        for i, r in enumerate(recordings):
            theirs = runs["openai-whisper"][i].windows or []
            for s in systems:
                ours = runs[s][i].windows
                if s == "openai-whisper" or ours is None:
                    continue
                d = compare_windows(ours, theirs)
                lines.append(
                    f"| {r.name} | {s} | {d.same} / {d.compared} | {d.first_difference or '-'} |"
                )
    lines += ["", "| system | windows decoded | kept hotter than 0 | wall s |", "|---|---|---|---|"]
    for s in systems:
        logs = [w for run in runs[s] for w in run.windows or []]
        hot = sum(w.temperature > 0 for w in logs)
        decoded = f"{len(logs)}" if logs else "-"
        lines.append(
            f"| {s} | {decoded} | {hot if logs else '-'} | {sum(x.seconds for x in runs[s]):.0f} |"
        )
    return lines


def run_all(
    stream: Stream,
    recordings: list[Recording],
    openai_python: str | None,
    faster_whisper_python: str | None,
    transformers: bool = True,
    progress: Callable[[str], None] = lambda _: None,
) -> dict[str, list[Run]]:
    from tools.word_timing import openai_checkpoint

    loaded = stream.engine.loaded
    runs: dict[str, list[Run]] = {}
    progress("engine, sequential")
    runs["engine"] = engine_runs(stream, recordings, TranscriptionOptions())
    progress("engine, sequential without cover_speech")
    uncovered = TranscriptionOptions(cover_speech=False)
    runs["engine, cover_speech off"] = engine_runs(stream, recordings, uncovered)
    progress("engine, sequential with voice activity")
    runs["engine, vad on"] = engine_runs(stream, recordings, TranscriptionOptions(vad=True))
    progress("engine, sequential with hallucination_silence_threshold 2")
    guarded = TranscriptionOptions(hallucination_silence_threshold=2.0)
    runs["engine, hallucination_silence_threshold 2"] = engine_runs(stream, recordings, guarded)
    progress("engine, chunked (voice activity on)")
    runs["engine chunked"] = engine_runs(stream, recordings, TranscriptionOptions(mode="chunked"))
    progress("engine, chunked without voice activity")
    unheard = TranscriptionOptions(mode="chunked", vad=False)
    runs["engine chunked, vad off"] = engine_runs(stream, recordings, unheard)
    if transformers:
        progress("transformers")
        runs["transformers"] = transformers_runs(stream, recordings)
    if openai_python:
        progress("openai-whisper")
        with tempfile.TemporaryDirectory(prefix="openai-ckpt-") as tmp:
            checkpoint = openai_checkpoint(loaded, Path(tmp) / "model.pt")
            runs["openai-whisper"] = reference_runs(
                "openai-whisper", openai_python, checkpoint, recordings
            )
    if faster_whisper_python:
        progress("faster-whisper")
        with tempfile.TemporaryDirectory(prefix="ct2-") as tmp:
            model = ctranslate2_dir(loaded.name, Path(tmp))
            runs["faster-whisper"] = reference_runs(
                "faster-whisper", faster_whisper_python, model, recordings
            )
    return runs
