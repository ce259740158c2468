"""How a job's options become the engine's, and its transcription the job's result. Job
processes call these on each side of their call to the engine core, so they import no torch
(`engine.options` and `engine.result` are plain data)."""

from __future__ import annotations

import hashlib
from dataclasses import asdict

from engine.options import SpeakerCount, TranscriptionOptions
from engine.result import Transcription
from worker.contract.options import SEED_LIMIT, JobOptions
from worker.contract.results import TranscriptResult

TEXTLESS = {"word_timestamps", "diarize", "speakers", "min_speakers", "max_speakers"}


def job_seed(data: bytes, options: JobOptions) -> int:
    """The seed a job samples with: its own, else one derived from its input's bytes and its
    options, so that the same audio with the same options gives the same text whichever job
    carries it (a retry, a resubmission, a backfill) and whichever worker runs it."""
    if options.seed is not None:
        return options.seed
    # options left at their defaults are not hashed: a new option changes no derived seed;
    # nor are those that change no text (words, speakers)
    dumped = options.model_dump_json(exclude_defaults=True, exclude=TEXTLESS)
    digest = hashlib.blake2b(dumped.encode(), digest_size=8)
    digest.update(b"\0")  # JSON never holds a raw NUL: options and bytes cannot run together
    digest.update(data)
    return int.from_bytes(digest.digest(), "big") % SEED_LIMIT


def temperatures(first: float | None) -> tuple[float, ...]:
    """Whisper's fallback schedule from `first` on: 0.3 -> (0.3, 0.4, ... 1.0)."""
    schedule = TranscriptionOptions.temperature
    if first is None:
        return schedule
    return (first, *(t for t in schedule if t > first))


def engine_options(options: JobOptions, data: bytes) -> TranscriptionOptions:
    """A job's options as the engine takes them, for this input (its seed may come from it)."""
    return TranscriptionOptions(
        task=options.task,
        temperature=temperatures(options.temperature),
        language=options.language,
        mode=options.mode,
        timestamps=options.timestamps,
        word_timestamps=options.word_timestamps or options.diarize,
        vad=options.vad,
        hallucination_silence_threshold=options.hallucination_silence_threshold,
        diarize=SpeakerCount(options.speakers, options.min_speakers or 1, options.max_speakers)
        if options.diarize
        else None,
        initial_prompt=options.prompt,
        seed=job_seed(data, options),
    )


def transcript(transcription: Transcription, options: JobOptions) -> TranscriptResult:
    """The engine's transcription as the job's result, carrying the job's options and the seed
    it was sampled with (the engine's record of its options holds it)."""
    words = transcription.words
    return TranscriptResult.model_validate(
        {
            **transcription.to_dict(),
            "words": None if words is None else [asdict(w) for w in words],
            "options": options,
            "seed": transcription.options["seed"],
        }
    )
