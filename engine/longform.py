"""Audio of any length as a sequence of 30 s windows: one small state machine per request.

- `SequentialRequest` is openai-whisper's `transcribe()` loop: decode the window at `seek`,
  cut the output into segments at timestamp pairs, move `seek` to the last complete
  timestamp (or past the window), and feed the text so far as the next window's prompt.
  One window at a time, since each depends on the one before.
- `ChunkedRequest` cuts the audio up front into windows of at most 30 s, each ending at the
  quietest moment of its last 6 s, and decodes them independently and all at once: faster,
  slightly less accurate (no context across cuts; see docs/accuracy.md).

A request hands out the windows it can decode now (`ready`) and takes their results back
(`accept`); the batching driver in `engine.transcribe` mixes windows of many requests.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from engine.decoding import WindowResult, WindowTask
from engine.inputs import MelSource
from engine.mel import CHUNK_LENGTH, FRAMES_PER_SECOND, HOP_LENGTH, N_FRAMES, SAMPLE_RATE
from engine.result import Segment
from engine.tokenizer import TASKS, Tokenizer

MODES = ("sequential", "chunked")


class OptionsError(ValueError):
    """Options that cannot apply to this model or to each other."""


@dataclass(frozen=True)
class TranscriptionOptions:
    # what to do
    task: str = "transcribe"  # or "translate" (to English; multilingual models)
    language: str | None = None  # ISO 639-1; None: detect from the first window
    mode: str = "sequential"  # or "chunked"
    timestamps: bool = True  # segment timestamps; without them each window is one segment

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
    prompt_reset_on_temperature: float = 0.5  # drop the context after a window this hot

    # rules
    max_initial_timestamp: float | None = 1.0  # seconds: the first timestamp of a window
    suppress_blank: bool = True
    suppress_tokens: tuple[int, ...] = ()  # in addition to the model's non-speech symbols
    sample_len: int | None = None  # tokens per window; None: half the text context (224)
    seed: int = 0  # for sampling at temperatures above 0

    def verified(self, tokenizer: Tokenizer) -> TranscriptionOptions:
        """Check the options against the model before any work; return them."""
        if self.task not in TASKS:
            raise OptionsError(f"task {self.task!r} is not one of {', '.join(TASKS)}")
        if self.mode not in MODES:
            raise OptionsError(f"mode {self.mode!r} is not one of {', '.join(MODES)}")
        if not self.temperature or any(t < 0 for t in self.temperature):
            raise OptionsError(f"temperature {self.temperature}: expected values >= 0")
        if not tokenizer.is_multilingual:
            if self.task == "translate":
                raise OptionsError("translate needs a multilingual model; this one is English-only")
            if self.language not in (None, "en"):
                raise OptionsError(
                    f"language {self.language!r} needs a multilingual model; "
                    "this one is English-only"
                )
        elif self.language is not None and self.language not in tokenizer.language_ids:
            known = ", ".join(sorted(tokenizer.language_ids))
            raise OptionsError(f"unknown language {self.language!r}; expected one of: {known}")
        return self

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


@dataclass
class Window:
    seek: int  # first frame
    size: int  # frames of content in it (the rest is padding)
    mel: torch.Tensor  # (n_mels, N_FRAMES)

    @property
    def offset(self) -> float:
        return self.seek * HOP_LENGTH / SAMPLE_RATE


TIME_PRECISION = CHUNK_LENGTH / 1500  # seconds per timestamp token (0.02)


def split_segments(
    tokens: list[int], tokenizer: Tokenizer, window: Window
) -> tuple[list[tuple[float, float, list[int]]], int]:
    """Cut a window's tokens into (start, end, tokens) at timestamp pairs; return them and
    how many frames of the window they cover: up to the last complete timestamp (the text
    after it is unfinished and decoded again from there), or the whole window when the output
    ends with a lone timestamp (no speech after it) or has no pairs."""
    begin = tokenizer.timestamp_begin
    is_ts = [t >= begin for t in tokens]
    single_ending = is_ts[-2:] == [False, True]
    pairs = [i + 1 for i in range(len(tokens) - 1) if is_ts[i] and is_ts[i + 1]]
    if pairs:
        cuts = pairs + ([len(tokens)] if single_ending else [])
        segments, last = [], 0
        for cut in cuts:
            piece = tokens[last:cut]
            start = window.offset + (piece[0] - begin) * TIME_PRECISION
            end = window.offset + (piece[-1] - begin) * TIME_PRECISION
            segments.append((start, end, piece))
            last = cut
        if single_ending:
            return segments, window.size
        return segments, (tokens[last - 1] - begin) * round(TIME_PRECISION * FRAMES_PER_SECOND)
    duration = window.size / FRAMES_PER_SECOND
    stamps = [t for t in tokens if t >= begin]
    if stamps and stamps[-1] != begin:  # no pairs, but a timestamp: it says where speech ends
        duration = (stamps[-1] - begin) * TIME_PRECISION
    return [(window.offset, window.offset + duration, tokens)], window.size


@dataclass
class Request:
    """One input being transcribed: its windows, its language, its segments so far."""

    source: MelSource
    options: TranscriptionOptions
    tokenizer: Tokenizer
    language: str | None = None
    language_probability: float | None = None
    segments: list[Segment] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.language = self.options.language or (None if self.tokenizer.is_multilingual else "en")

    def task(self, window: Window, temperature: float) -> WindowTask:
        return WindowTask(
            language=self.language or "en",
            task=self.options.task,
            temperature=temperature,
            prompt=tuple(self.prompt(window)),
            timestamps=self.options.timestamps,
        )

    def prompt(self, window: Window) -> list[int]:
        raise NotImplementedError

    def ready(self) -> Iterator[Window]:
        """Windows that can be decoded now."""
        raise NotImplementedError

    def accept(self, window: Window, result: WindowResult) -> None:
        raise NotImplementedError

    @property
    def done(self) -> bool:
        raise NotImplementedError

    @property
    def done_seconds(self) -> float:
        raise NotImplementedError

    def _segments(self, window: Window, result: WindowResult) -> tuple[list[Segment], int]:
        # (without timestamps the tokens hold none: one piece, the whole window)
        pieces, advance = split_segments(result.tokens, self.tokenizer, window)
        out = []
        window_end = window.offset + window.size / FRAMES_PER_SECOND
        for start, end, tokens in pieces:
            # The model may place an end past the audio it heard: keep segments inside it.
            end = min(end, window_end)
            start = min(start, end)
            text = self.tokenizer.decode(tokens)
            if start == end or not text.strip():  # instantaneous or empty: no segment
                continue
            out.append(
                Segment(
                    id=0,
                    start=round(start, 3),
                    end=round(end, 3),
                    text=text,
                    tokens=tokens,
                    avg_logprob=result.avg_logprob,
                    compression_ratio=result.compression_ratio,
                    no_speech_prob=result.no_speech_prob,
                    temperature=result.temperature,
                )
            )
        return out, advance


class SequentialRequest(Request):
    def __post_init__(self) -> None:
        super().__post_init__()
        self.seek = 0
        self.outstanding = False
        self.initial = (
            self.tokenizer.encode(" " + self.options.initial_prompt.strip())
            if self.options.initial_prompt
            else []
        )
        self.all_tokens: list[int] = list(self.initial)
        self.prompt_reset_since = 0

    @property
    def done(self) -> bool:
        return self.seek >= self.source.n_frames

    @property
    def done_seconds(self) -> float:
        return min(self.seek, self.source.n_frames) / FRAMES_PER_SECOND

    def prompt(self, window: Window) -> list[int]:
        return self.all_tokens[self.prompt_reset_since :]

    def ready(self) -> Iterator[Window]:
        if self.outstanding or self.done:
            return
        size = min(N_FRAMES, self.source.n_frames - self.seek)
        self.outstanding = True
        yield Window(self.seek, size, self.source.window(self.seek))

    def accept(self, window: Window, result: WindowResult) -> None:
        self.outstanding = False
        if self.options.is_silence(result):
            self.seek += window.size
            return
        segments, advance = self._segments(window, result)
        for s in segments:
            self.segments.append(Segment(**{**s.__dict__, "id": len(self.segments)}))
            self.all_tokens.extend(s.tokens)
        self.seek += max(advance, 1)
        if (
            not self.options.condition_on_previous_text
            or result.temperature > self.options.prompt_reset_on_temperature
        ):
            self.prompt_reset_since = len(self.all_tokens)


class ChunkedRequest(Request):
    """Windows cut up front, decoded independently. When a window's output stops at a
    timestamp before its end (the rest unfinished), the rest of that window is queued as a
    window of its own, as sequential mode would seek there."""

    QUIET_SEARCH = 6 * FRAMES_PER_SECOND  # look for the quietest frame in a window's last 6 s

    def __post_init__(self) -> None:
        super().__post_init__()
        self.next_seek = 0
        self.pending = 0
        self.rests: list[Window] = []
        self.by_seek: dict[int, list[Segment]] = {}
        self.decoded_frames = 0

    @property
    def done(self) -> bool:
        return self.next_seek >= self.source.n_frames and self.pending == 0 and not self.rests

    @property
    def done_seconds(self) -> float:
        return self.decoded_frames / FRAMES_PER_SECOND

    def prompt(self, window: Window) -> list[int]:
        return []

    def ready(self) -> Iterator[Window]:
        while self.rests:
            self.pending += 1
            yield self.rests.pop()
        while self.next_seek < self.source.n_frames:
            seek = self.next_seek
            left = self.source.n_frames - seek
            mel = self.source.window(seek)
            size = left
            if left > N_FRAMES:
                loudness = mel[:, N_FRAMES - self.QUIET_SEARCH :].mean(dim=0)
                size = N_FRAMES - self.QUIET_SEARCH + int(loudness.argmin())
                mel = self.source.pad(mel, size)
            self.next_seek = seek + size
            self.pending += 1
            yield Window(seek, size, mel)

    def accept(self, window: Window, result: WindowResult) -> None:
        self.pending -= 1
        if self.options.is_silence(result):
            segments, advance = [], window.size
        else:
            segments, advance = self._segments(window, result)
            advance = max(advance, 1)
        self.decoded_frames += min(advance, window.size)
        self.by_seek[window.seek] = segments
        if advance < window.size:
            rest = torch.nn.functional.pad(
                window.mel[:, advance:], (0, advance), value=self.source.floor
            )
            self.rests.append(Window(window.seek + advance, window.size - advance, rest))
        if self.done:
            ordered = [s for seek in sorted(self.by_seek) for s in self.by_seek[seek]]
            self.segments = [Segment(**{**s.__dict__, "id": i}) for i, s in enumerate(ordered)]
