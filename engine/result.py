"""What a transcription returns: typed, JSON-ready, carrying the options that produced it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Segment:
    id: int
    start: float  # seconds from the start of the audio
    end: float
    text: str
    tokens: list[int]
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float
    temperature: float


@dataclass(frozen=True)
class Transcription:
    text: str
    language: str  # ISO 639-1
    language_probability: float | None  # None when the caller gave the language
    duration: float  # seconds of audio
    segments: list[Segment]
    model: str
    options: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)
