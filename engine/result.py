"""What a transcription returns: typed, JSON-ready, carrying the options that produced it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class Word:
    word: str  # as in the text: its leading space, the punctuation around it merged in
    start: float  # seconds from the start of the audio
    end: float
    probability: float  # mean probability of its tokens
    speaker: str | None = None  # with the option diarize: SPEAKER_00, SPEAKER_01, ...


@dataclass(frozen=True)
class Segment:
    id: int
    start: float  # seconds from the start of the audio
    end: float
    text: str
    tokens: list[int]
    # None where the model cannot tell (a CTC model through transformers: engine.hf)
    avg_logprob: float | None
    compression_ratio: float | None
    no_speech_prob: float | None
    temperature: float
    words: list[Word] | None = None  # with the option word_timestamps
    speaker: str | None = None  # with the option diarize


@dataclass(frozen=True)
class Speaker:
    speaker: str  # SPEAKER_00, SPEAKER_01, ... in order of first appearance
    talk_time: float  # seconds of its turns


@dataclass(frozen=True)
class Transcription:
    text: str
    language: str | None  # ISO 639-1; None where the model cannot tell (engine.hf)
    language_probability: float | None  # None when the caller gave the language
    duration: float  # seconds of audio
    segments: list[Segment]
    model: str
    options: dict = field(default_factory=dict)
    speakers: list[Speaker] | None = None  # with the option diarize

    @property
    def words(self) -> list[Word] | None:
        """Every segment's words, in order; None without word timestamps."""
        if not self.options.get("word_timestamps"):
            return None
        return [w for s in self.segments for w in s.words or ()]

    def to_dict(self) -> dict:
        return asdict(self)
