"""Audio of any length as a sequence of 30 s windows: one small state machine per request.

- `SequentialRequest` is openai-whisper's `transcribe()` loop: decode the window at `seek`,
  cut the output into segments at timestamp pairs, move `seek` to the last complete
  timestamp (or past the window), and feed the text so far as the next window's prompt.
  One window at a time, since each depends on the one before.
- `ChunkedRequest` cuts the audio up front into windows of at most 30 s, each ending at the
  quietest moment of its last 6 s, and decodes them independently and all at once: faster,
  slightly less accurate (no context across cuts; see docs/accuracy.md).

A request hands out the windows it can decode now (`ready`) and takes their results back
(`accept`); a stream (`engine.stream`) mixes the windows of many requests. A request also
decides its language: the one given, or the one detected in its first window decoded.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from engine.decoding import WindowResult, WindowTask
from engine.inputs import MelSource
from engine.mel import CHUNK_LENGTH, FRAMES_PER_SECOND, HOP_LENGTH, N_FRAMES, SAMPLE_RATE
from engine.options import TranscriptionOptions
from engine.result import Segment
from engine.runner import LanguageGuess
from engine.timing import TokenTimes, place_words, segment_words
from engine.tokenizer import Tokenizer

Piece = tuple[float, float, list[int]]  # a segment to be: (start s, end s, tokens)


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
) -> tuple[list[Piece], int]:
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
    speech_end: float = 0.0  # where speech last ended (word timestamps)

    def __post_init__(self) -> None:
        self.language = self.options.language or (None if self.tokenizer.is_multilingual else "en")

    @property
    def needs_language(self) -> bool:
        return self.language is None

    def detected(self, guess: LanguageGuess) -> None:
        """The language detected in one of this request's windows: the first decides."""
        if self.language is None:
            self.language, self.language_probability = guess.language, guess.probability

    def task(self, window: Window, temperature: float) -> WindowTask:
        """How to decode `window` at `temperature`. Above `prompt_reset_on_temperature` the
        window goes without its prompt (previous text, initial prompt), not only the windows
        after it: the prompt that drove the cooler tries into repeating itself would drive this
        one too (issue 12: "ha " * 333 as the initial prompt)."""
        hot = temperature > self.options.prompt_reset_on_temperature
        return WindowTask(
            language=self.language or "en",
            task=self.options.task,
            temperature=temperature,
            prompt=() if hot else tuple(self.prompt(window)),
            timestamps=self.options.timestamps,
            seed=self.options.seed,
            seek=window.seek,
            min_tokens=self.options.min_tokens,
            max_tokens=self.options.sample_len,
            max_compression_ratio=self.options.compression_ratio_threshold,
        )

    def prompt(self, window: Window) -> list[int]:
        raise NotImplementedError

    def ready(self) -> Iterator[Window]:
        """Windows that can be decoded now."""
        raise NotImplementedError

    def accept(self, window: Window, result: WindowResult, times: TokenTimes | None = None) -> None:
        """Take a window's result; times: its text tokens' (`engine.timing`), for word
        timestamps."""
        raise NotImplementedError

    @property
    def done(self) -> bool:
        raise NotImplementedError

    @property
    def done_seconds(self) -> float:
        raise NotImplementedError

    def pieces(self, window: Window, result: WindowResult) -> tuple[list[Piece], int]:
        """What a window's result adds: its (start, end, tokens) pieces, and how many of its
        frames they cover (all of them for silence, which adds nothing)."""
        if self.options.is_silence(result):
            return [], window.size
        if self.options.timestamps:
            return split_segments(result.tokens, self.tokenizer, window)
        # one piece, the whole window: a timestamp token here means nothing
        return [
            (window.offset, window.offset + window.size / FRAMES_PER_SECOND, result.tokens)
        ], window.size

    def _segments(
        self, window: Window, result: WindowResult, times: TokenTimes | None
    ) -> tuple[list[Segment], int]:
        window_end = window.offset + window.size / FRAMES_PER_SECOND
        pieces, advance = self.pieces(window, result)
        out = []
        for start, end, tokens in pieces:
            # The model may place an end past the audio it heard: keep segments inside it.
            end = min(end, window_end)
            start = min(start, end)
            # the whole window as one piece (no timestamp pairs): its text is decoded already
            text = result.text if tokens is result.tokens else self.tokenizer.decode(tokens)
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
        if times is not None:
            eot = self.tokenizer.eot
            texts = [[t for t in s.tokens if t < eot] for s in out]
            words = segment_words(self.tokenizer, texts, self.language or "en", times)
            out, self.speech_end = place_words(
                out, words, window.offset, self.speech_end_before(window)
            )
        # instantaneous or empty: no segment (after the words, which count every piece's tokens)
        return [s for s in out if s.start != s.end and s.text.strip()], advance

    def speech_end_before(self, window: Window) -> float:
        """Where speech last ended before this window (word timestamps' first-word fix)."""
        return window.offset


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

    def speech_end_before(self, window: Window) -> float:
        return self.speech_end  # windows come in order

    def accept(self, window: Window, result: WindowResult, times: TokenTimes | None = None) -> None:
        self.outstanding = False
        if self.options.is_silence(result):
            self.seek += window.size
            return
        segments, advance = self._segments(window, result, times)
        ends = [w.end for s in segments for w in s.words or ()]
        if ends and advance < window.size:
            # the text after the last complete timestamp is decoded again from there; with
            # word timestamps, not from inside a word already given (as in openai-whisper,
            # the next window starts where the last word ended; here never earlier than the
            # last timestamp, which would decode again what is kept)
            last_word = round((ends[-1] - window.offset) * FRAMES_PER_SECOND)
            advance = min(max(advance, last_word), window.size)
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

    def accept(self, window: Window, result: WindowResult, times: TokenTimes | None = None) -> None:
        self.pending -= 1
        segments, advance = self._segments(window, result, times)
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


# the request kind of each mode (`TranscriptionOptions.mode`)
REQUESTS: dict[str, type[Request]] = {"sequential": SequentialRequest, "chunked": ChunkedRequest}
