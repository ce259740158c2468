"""A finished job's transcript: what the worker stores, the formatters read and the API declares.

Light on purpose (no torch): the API reads it back from storage to render it. Its fields are in
the order they are stored, so rendering it as `json` gives back the stored object.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from worker.contract.options import JobOptions


class TranscriptWord(BaseModel):
    word: str = Field(description="as in the text: its leading space, punctuation merged in")
    start: float = Field(description="seconds from the start of the audio")
    end: float = Field(description="seconds from the start of the audio")
    probability: float = Field(description="mean probability of its tokens")
    speaker: str | None = Field(
        None,
        description="who spoke it (with the option diarize; else absent)",
        exclude_if=lambda speaker: speaker is None,
    )


class TranscriptSegment(BaseModel):
    id: int
    start: float = Field(description="seconds from the start of the audio")
    end: float = Field(description="seconds from the start of the audio")
    text: str
    tokens: list[int] = Field(description="the segment's token ids, as decoded")
    avg_logprob: float | None = Field(
        description="mean log-probability of the window's tokens (null: the model cannot tell)"
    )
    compression_ratio: float | None = Field(
        description="of the window's text (gzip): high for loops (null: not computed)"
    )
    no_speech_prob: float | None = Field(
        description="probability that the window holds no speech (null: the model cannot tell)"
    )
    temperature: float = Field(description="the temperature that decoded it (0: greedy)")
    words: list[TranscriptWord] | None = Field(
        None,
        description="its words, timed (with the option word_timestamps; else absent)",
        exclude_if=lambda words: words is None,  # results without them are stored as before
    )
    speaker: str | None = Field(
        None,
        description="who spoke it: SPEAKER_00, SPEAKER_01, ... (with the option diarize; else "
        "absent)",
        exclude_if=lambda speaker: speaker is None,
    )


class TranscriptSpeaker(BaseModel):
    speaker: str = Field(description="SPEAKER_00, SPEAKER_01, ... in order of first appearance")
    talk_time: float = Field(description="seconds of speech in its turns")


class TranscriptResult(BaseModel):
    text: str
    language: str | None = Field(
        description="ISO 639-1 code: the job's, or the one detected (null: a model that "
        "cannot tell)"
    )
    language_probability: float | None = Field(
        description="the detected language's probability; null when the job gave the language"
    )
    duration: float = Field(description="seconds of audio")
    segments: list[TranscriptSegment]
    model: str
    words: list[TranscriptWord] | None = Field(
        None,
        description="every segment's words in order (with word_timestamps; else absent)",
        exclude_if=lambda words: words is None,
    )
    options: JobOptions = Field(description="the job options that produced it")
    speakers: list[TranscriptSpeaker] | None = Field(
        None,
        description="who spoke, with their talk time (with the option diarize; else absent)",
        exclude_if=lambda speakers: speakers is None,
    )
    seed: int | None = Field(
        None,
        description="the seed it was sampled with: the job's, or the one derived from its audio "
        "and options; sent as the option `seed`, it gives the same text again (null in results "
        "stored before seeds were recorded)",
    )
