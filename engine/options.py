"""What a caller asks of one transcription. Each input in a stream has its own options; the
rules every window of a stream shares are `engine.decoding.DecodingRules`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # options travel to processes without torch (a worker's job processes)
    from engine.decoding import WindowResult


class OptionsError(ValueError):
    """Options that cannot apply to this model or stream, or to each other."""


@dataclass(frozen=True)
class SpeakerCount:
    """What the caller knows of the number of speakers (`engine.diarize`): exactly
    `speakers`, or a range."""

    speakers: int | None = None
    min_speakers: int = 1
    max_speakers: int | None = None

    def __post_init__(self) -> None:
        if self.speakers is not None and self.speakers < 1:
            raise OptionsError("speakers: at least 1")
        if self.min_speakers < 1 or (self.max_speakers or self.min_speakers) < self.min_speakers:
            raise OptionsError("min_speakers must be at least 1 and at most max_speakers")


@dataclass(frozen=True)
class TranscriptionOptions:
    # what to do
    task: str = "transcribe"  # or "translate" (to English; multilingual models)
    language: str | None = None  # ISO 639-1; None: detect from the first window
    mode: str = "sequential"  # or "chunked" (engine.longform)
    timestamps: bool = True  # segment timestamps; without them each window is one segment
    word_timestamps: bool = False  # each segment's words, timed (engine.timing)
    # voice activity (engine.vad): stretches without speech are not decoded, chunked windows
    # are cut at silences, and a segment with no speech under it is dropped. None: on for
    # chunked audio over 30 s and for inputs diarized (their speech is found anyway), off
    # otherwise
    vad: bool | None = None
    # who spoke when (engine.diarize): each segment and word gets a speaker; needs audio and
    # word timestamps (which it turns on)
    diarize: SpeakerCount | None = None

    # decoding with fallback: retry a window at the next temperature while its output is too
    # repetitive (compression ratio above) or too improbable (average log-prob below),
    # unless it is silence (no-speech probability above, with a low log-prob)
    temperature: tuple[float, ...] = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)
    compression_ratio_threshold: float | None = 2.4
    logprob_threshold: float | None = -1.0
    no_speech_threshold: float | None = 0.6

    # context
    condition_on_previous_text: bool = True  # sequential: prompt each window with the text so far
    initial_prompt: str | None = None  # text given as if it preceded the audio
    # a window tried hotter than this goes without the context, and so do the windows after it
    prompt_reset_on_temperature: float = 0.5
    # sequential, with word timestamps (which it turns on): a segment that looks made up
    # (improbable, too short or too long words) with silence of this many seconds or more
    # before and after it is dropped, the seek moved past the silence (openai-whisper's
    # option of the same name); None: off
    hallucination_silence_threshold: float | None = None
    # sequential, where the input's speech is known (audio over 30 s: engine.vad): speech a
    # window leaves without a segment is decoded again from where it starts (engine.longform)
    cover_speech: bool = True

    # length
    sample_len: int | None = None  # tokens a window at most; None: the stream's rules' limit
    min_tokens: int = 0  # no end-of-text before this many tokens a window (benchmarks)
    # sampling at temperatures above 0 draws from noise keyed by this seed, the window and the
    # step (engine.sampling): the same input and options give the same text, whatever else the
    # stream runs. 0 <= seed < 2**63
    seed: int = 0

    @property
    def finds_speech(self) -> bool:
        """Whether long audio's first pass runs Silero for these options: voice activity (as
        asked, or chunked's default), speakers, or sequential's `cover_speech`. Without any of
        them the pass is the log-mel's alone, and no GPU time goes on the recurrence."""
        chunked = self.mode == "chunked"
        vad = self.vad or (self.vad is None and chunked)
        return vad or self.diarize is not None or (not chunked and self.cover_speech)

    @property
    def needs_prompt(self) -> bool:
        """Whether windows are prompted with text: previous windows' or the initial prompt."""
        context = self.mode == "sequential" and self.condition_on_previous_text
        return bool(self.initial_prompt) or context

    def needs_fallback(self, r: WindowResult) -> bool:
        """openai-whisper's rule: retry hotter unless the window is silence."""
        too_repetitive = (
            self.compression_ratio_threshold is not None
            and r.compression_ratio > self.compression_ratio_threshold
        )
        improbable = self.logprob_threshold is not None and r.avg_logprob < self.logprob_threshold
        silence = (
            self.no_speech_threshold is not None
            and r.no_speech_prob > self.no_speech_threshold
            and improbable
        )
        return (too_repetitive or improbable) and not silence

    def is_silence(self, r: WindowResult) -> bool:
        """Skip the window: probably no speech, and the text is not convincing either."""
        if self.no_speech_threshold is None or r.no_speech_prob <= self.no_speech_threshold:
            return False
        return self.logprob_threshold is None or r.avg_logprob <= self.logprob_threshold
