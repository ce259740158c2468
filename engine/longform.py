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

from bisect import bisect_left, bisect_right
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import torch

from engine.audio import CHUNK_LENGTH
from engine.decoding import WindowResult, WindowTask
from engine.inputs import MelSource
from engine.mel import FRAMES_PER_SECOND, HOP_LENGTH, N_FRAMES, SAMPLE_RATE
from engine.options import TranscriptionOptions
from engine.result import Segment, Word
from engine.runner import LanguageGuess
from engine.timing import TokenTimes, place_words, segment_words
from engine.tokenizer import Tokenizer
from engine.vad import voiced_seconds

Piece = tuple[float, float, list[int]]  # a segment to be: (start s, end s, tokens)


@dataclass
class Window:
    seek: int  # first frame
    size: int  # frames of content in it (the rest is padding)
    mel: torch.Tensor  # (n_mels, N_FRAMES)
    # cut to a stretch of speech an earlier window left without a segment (SequentialRequest)
    focused: bool = False

    @property
    def offset(self) -> float:
        return self.seek * HOP_LENGTH / SAMPLE_RATE


TIME_PRECISION = CHUNK_LENGTH / 1500  # seconds per timestamp token (0.02)

# Voice activity (option `vad`, where the input's speech is known): a segment further than
# SPEECH_SLACK_S from any speech is dropped (a segment's own timestamps can be that far off).
# A silence of MAX_GAP_S or more is not decoded: a sequential request's seek jumps over it, and
# chunked windows join stretches of speech up to 30 s only across shorter ones (WhisperX joins
# them whatever the gap: a long silence inside a window is where Whisper invents text). Speech
# after a skipped silence is decoded from LEAD_IN_S before Silero found it: it finds quiet
# speech late (the first words of the dev set's earnings call, 2.6 s in, and LEAD_S below).
SPEECH_SLACK_S = 0.5
MAX_GAP_S = 4.0
LEAD_IN_S = 1.0

# Speech a sequential request does not let a window skip (inputs whose speech is known:
# `MelSource.speech`): a stretch of UNCOVERED_S seconds of it (pauses under BRIDGE_S bridged)
# that no word covers. Segments suggest such a stretch (none over it, or one over SPARSE_MIN_S
# of speech with fewer than SPARSE_TOKENS_PER_S text tokens a second of it: on the dev set's
# recordings every segment had 1.4 or more, one the model jumped ahead in 0.7); the window's
# words (`engine.timing`, timed only then) confirm it, since a segment's own timestamps can be
# seconds off where a long pause comes before it.
UNCOVERED_S = 1.0
BRIDGE_S = 0.5
SPARSE_MIN_S = 4.0
SPARSE_TOKENS_PER_S = 1.0
WORD_SLACK_S = 0.1  # a word covers this much more on each side
# A window decoded again starts up to LEAD_S before the speech it missed (never before the
# words kept): Silero finds quiet speech up to 2.5 s after it starts where louder speech came
# just before (the dev set's FLEURS clips); it ends TAIL_S after it.
LEAD_S, TAIL_S = 3.0, 0.3


def first_gap(
    speech: list[tuple[float, float]],
    covered: list[tuple[float, float]],
    start: float,
    end: float,
) -> float | None:
    """Where the first stretch of UNCOVERED_S seconds of speech in [start, end) that nothing
    in `covered` overlaps begins (seconds), or None. (Asked of every window decoded with its
    words' times: one sweep of the speech and the covered time in order.)"""
    stretch: list[float] | None = None  # [begin, end, seconds of speech]
    merged = _merged(covered)
    ends = [e for _, e in merged]
    for s, e in speech[bisect_right([e for _, e in speech], start) :]:
        s, e = max(s, start), min(e, end)
        if e <= s:
            if s >= end:
                break
            continue
        for piece_start, piece_end in _minus(s, e, merged, ends):
            if stretch is None or piece_start - stretch[1] > BRIDGE_S:
                stretch = [piece_start, piece_end, 0.0]
            stretch[1] = piece_end
            stretch[2] += piece_end - piece_start
            if stretch[2] >= UNCOVERED_S:
                return stretch[0]
    return None


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of the intervals, as disjoint ones in order."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        elif e > s:
            out.append((s, e))
    return out


def _minus(
    start: float, end: float, merged: list[tuple[float, float]], ends: list[float]
) -> list[tuple[float, float]]:
    """[start, end) less the disjoint intervals `merged` (in order, ending at `ends`)."""
    pieces, at = [], start
    for c_start, c_end in merged[bisect_right(ends, start) :]:
        if c_start >= end:
            break
        if c_start > at:
            pieces.append((at, c_start))
        at = max(at, c_end)
    if end > at:
        pieces.append((at, end))
    return pieces


def words_in_speech(segments: list[Segment], speech: list[tuple[float, float]]) -> list[Segment]:
    """The segments with their words kept to the speech (voice activity, its stretches in
    order). A word that reaches into a stretch without speech is cut back to the stretch of
    speech it overlaps most; one wholly outside moves to the edge of the nearest, taking no
    more time than it had, and shares what it then overlaps of a word beside it with that
    word, half each; a segment starts and ends with its words. Word timing finds speech's
    edges against silence, noise or music late or early, by up to seconds: 4 of 16 built
    conversations had a word timed into a tone or music (scripts/diarization_check.py), and a
    speaker is found by when each word was said."""
    starts, ends = [s for s, _ in speech], [e for _, e in speech]
    return [_words_in_speech(s, starts, ends) if s.words and speech else s for s in segments]


def _words_in_speech(segment: Segment, starts: list[float], ends: list[float]) -> Segment:
    out: list[Word] = []
    n = len(starts)
    for w in segment.words:
        first = bisect_right(ends, w.start)
        if first < n and starts[first] <= w.start and w.end <= ends[first]:
            out.append(w)  # inside speech, as most are: kept as it is (timed to 0.01 s)
            continue
        last = bisect_left(starts, w.end)  # speech[first:last] overlaps it
        if first < last:
            shared = [min(w.end, ends[k]) - max(w.start, starts[k]) for k in range(first, last)]
            most = first + shared.index(max(shared))
            start, end = max(w.start, starts[most]), min(w.end, ends[most])
        else:  # between speech[first - 1] and speech[first]: to the nearer edge
            before = w.start - ends[first - 1] if first > 0 else float("inf")
            after = starts[first] - w.end if first < len(starts) else float("inf")
            if after < before:
                start = starts[first]
                end = min(start + w.end - w.start, ends[first])
            else:
                end = ends[first - 1]
                start = max(end - (w.end - w.start), starts[first - 1])
        start, end = round(start, 2), round(end, 2)
        out.append(w if (start, end) == (w.start, w.end) else replace(w, start=start, end=end))
    for k in range(1, len(out)):  # a moved word and its neighbour share what they overlap
        a, b = out[k - 1], out[k]
        if a.end > b.start:
            middle = (max(a.start, b.start) + min(a.end, b.end)) / 2
            cut = round(min(max(middle, a.start), b.end), 2)
            out[k - 1], out[k] = replace(a, end=cut), replace(b, start=cut)
    if out == segment.words:
        return segment
    start, end = out[0].start, min(segment.end, out[-1].end)
    if end <= start:  # its words moved past its end: it ends with them
        end = out[-1].end
    return replace(segment, start=start, end=end, words=out)


def speech_stretches(speech: list[tuple[float, float]], n_frames: int) -> list[tuple[int, int]]:
    """The spans of a chunked request's windows where the speech is known, in frames: each
    stretch of speech joined to the ones after it while they fit a window together and no
    silence of MAX_GAP_S comes between (nor before the first, from the start); one after a
    longer silence begins LEAD_IN_S early; a stretch longer than a window stays one span, cut
    as it is decoded."""
    gap, lead = round(MAX_GAP_S * FRAMES_PER_SECOND), round(LEAD_IN_S * FRAMES_PER_SECOND)
    out: list[tuple[int, int]] = [(0, 0)]  # the start of the input, as if speech ended there
    for s, e in speech:
        start, end = round(s * FRAMES_PER_SECOND), min(round(e * FRAMES_PER_SECOND), n_frames)
        if end <= start:
            continue
        if start - out[-1][1] < gap and end - out[-1][0] <= N_FRAMES:
            out[-1] = (out[-1][0], end)
        else:
            out.append((max(out[-1][1], start - lead), end))
    return [span for span in out if span[1] > span[0]]


# openai-whisper's marks that are not words (`transcribe.punctuation`)
PUNCTUATION = "\"'“¿([{-\"'.。,，!！?？:：”)]}、"


def is_anomaly(segment: Segment) -> bool:
    """openai-whisper's test of a segment that may be made up: its first eight words (marks
    left out) improbable (under 0.15), very short (under 0.133 s) or very long (over 2 s)."""
    words = [w for w in segment.words or () if w.word not in PUNCTUATION][:8]
    if not words:
        return False
    score = 0.0
    for w in words:
        duration = w.end - w.start
        score += (w.probability < 0.15) + max(0.0, 0.133 - duration) * 15
        score += max(0.0, duration - 2.0)
    return score >= 3 or score + 0.01 >= len(words)


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
        # voice activity: as asked, else on for chunked long audio (its windows hold speech
        # only) and for inputs diarized, where the speech is found anyway; off in sequential
        # mode, where Silero's misses cost more than the silences it skips (docs/accuracy.md)
        vad, speech = self.options.vad, self.source.speech
        if vad is None:
            chunked = self.options.mode == "chunked" and self.source.duration > CHUNK_LENGTH
            vad = speech is not None and (chunked or self.options.diarize is not None)
        self.vad: list[tuple[float, float]] | None = speech if vad else None

    @property
    def needs_language(self) -> bool:
        return self.language is None

    def detected(self, guess: LanguageGuess) -> None:
        """The language detected in one of this request's windows: the first decides."""
        if self.language is None:
            self.language, self.language_probability = guess.language, guess.probability

    def task(self, window: Window, attempt: int) -> WindowTask:
        """How to decode `window` at its `attempt`-th temperature. Above
        `prompt_reset_on_temperature` the window goes without its prompt (previous text,
        initial prompt), not only the windows after it: the prompt that drove the cooler tries
        into repeating itself would drive this one too (issue 12: "ha " * 333 as the initial
        prompt). A window cut to speech another skipped goes without it too. A try with a
        hotter one after it ends as soon as its text so far fails the compression check (it
        would be tried again anyway); the last try is decoded to its end, as openai-whisper
        decodes it, since its text is kept whatever it is."""
        temperature = self.options.temperature[attempt]
        hot = temperature > self.options.prompt_reset_on_temperature
        last = attempt == len(self.options.temperature) - 1
        return WindowTask(
            language=self.language or "en",
            task=self.options.task,
            temperature=temperature,
            prompt=() if hot or window.focused else tuple(self.prompt(window)),
            timestamps=self.options.timestamps,
            seed=self.options.seed,
            seek=window.seek,
            min_tokens=self.options.min_tokens,
            max_tokens=self.options.sample_len,
            max_compression_ratio=None if last else self.options.compression_ratio_threshold,
        )

    def prompt(self, window: Window) -> list[int]:
        raise NotImplementedError

    def ready(self) -> Iterator[Window]:
        """Windows that can be decoded now."""
        raise NotImplementedError

    def accept(self, window: Window, result: WindowResult, times: TokenTimes | None = None) -> None:
        """Take a window's result; times: its text tokens' (`engine.timing`), for word
        timestamps or where `wants_times` asked for them."""
        raise NotImplementedError

    def wants_times(self, window: Window, result: WindowResult) -> bool:
        """Whether to time this window's text tokens though its input asks for no word
        timestamps (before its slot, which holds what timing reads, is freed)."""
        return False

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
        out = [s for s in out if s.start != s.end and s.text.strip()]
        if self.vad is not None:
            out = [s for s in out if self.heard(s)]
        return out, advance

    def heard(self, segment: Segment) -> bool:
        """Whether any speech is under the segment (or its words), give or take SPEECH_SLACK_S:
        text over none is what Whisper makes up in silence, noise or music."""
        spans = [(w.start, w.end) for w in segment.words or ()] or [(segment.start, segment.end)]
        return any(
            voiced_seconds(self.vad, start - SPEECH_SLACK_S, end + SPEECH_SLACK_S) > 0
            for start, end in spans
        )

    def speech_end_before(self, window: Window) -> float:
        """Where speech last ended before this window (word timestamps' first-word fix)."""
        return window.offset

    @staticmethod
    def past_words(window: Window, segments: list[Segment], advance: int) -> int:
        """Frames to advance: the text after the last complete timestamp is decoded again
        from there, but with word timestamps not from inside a word already given (as in
        openai-whisper, the next window starts where the last word ended; here never earlier
        than the last timestamp, which would decode again what is kept). A window whose
        timestamps end seconds before its words would otherwise give its last words twice."""
        ends = [w.end for s in segments for w in s.words or ()]
        if not ends or advance >= window.size:
            return advance
        last_word = round((ends[-1] - window.offset) * FRAMES_PER_SECOND)
        return min(max(advance, last_word), window.size)


class SequentialRequest(Request):
    """openai-whisper's seek, and one rule more where the input's speech is known (option
    `cover_speech`): speech that a window skipped (`first_gap`) is decoded again. The seek
    goes back to where that speech starts, and the window from there is cut where that
    stretch of speech ends (padded with silence) and goes without the previous text, so that
    the model neither jumps past it again nor is led by what came before; a cut window's own
    start is not tried twice."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.seek = 0
        self.focus: int | None = None  # the next window ends at this frame (a cut window)
        self.outstanding = False
        self.initial = (
            self.tokenizer.encode(" " + self.options.initial_prompt.strip())
            if self.options.initial_prompt
            else []
        )
        self.all_tokens: list[int] = list(self.initial)
        self.prompt_reset_since = 0
        self.speech = self.source.speech if self.options.cover_speech else None
        self.skip_silence()

    def skip_silence(self) -> None:
        """With voice activity: a seek MAX_GAP_S or more before the next speech moves to
        LEAD_IN_S before it; with no speech after it, to the end."""
        if self.vad is None or self.done:
            return
        here = self.seek / FRAMES_PER_SECOND
        start = next((s for s, e in self.vad if e > here), None)
        if start is None:
            self.seek = self.source.n_frames
        elif start - here >= MAX_GAP_S:
            self.seek = round((start - LEAD_IN_S) * FRAMES_PER_SECOND)

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
        mel = self.source.window(self.seek)
        # a kept segment's end can pass the end of the speech it missed: then no cut
        focused = self.focus is not None and self.focus > self.seek
        if focused:
            size = min(size, self.focus - self.seek)
            mel = self.source.pad(mel, size)
        self.focus = None
        self.outstanding = True
        yield Window(self.seek, size, mel, focused)

    def speech_end_before(self, window: Window) -> float:
        return self.speech_end  # windows come in order

    def wants_times(self, window: Window, result: WindowResult) -> bool:
        """Whether this window's segments suggest it skipped speech: then its words are
        timed, to tell (`accept`)."""
        if not self.speech or self.options.is_silence(result):
            return False
        pieces, advance = self.pieces(window, result)
        eot, covered = self.tokenizer.eot, []
        for start, end, tokens in pieces:
            voiced = voiced_seconds(self.speech, start, end)
            text = sum(t < eot for t in tokens)
            if text and not (voiced >= SPARSE_MIN_S and text < SPARSE_TOKENS_PER_S * voiced):
                covered.append((start, end))
        end = window.offset + advance / FRAMES_PER_SECOND
        return first_gap(self.speech, covered, window.offset, end) is not None

    def accept(self, window: Window, result: WindowResult, times: TokenTimes | None = None) -> None:
        self.outstanding = False
        silence = self.options.is_silence(result)
        asked = times if self.options.word_timestamps else None
        speech_before = self.speech_end
        if silence:
            segments, advance = [], window.size
        else:
            segments, advance = self._segments(window, result, asked)
        advance = self.past_words(window, segments, advance)
        threshold = self.options.hallucination_silence_threshold
        if threshold is not None and segments and asked is not None:
            single_ending = [t >= self.tokenizer.timestamp_begin for t in result.tokens[-2:]]
            segments, advance, skip = self.unhallucinated(
                window, segments, advance, single_ending == [False, True], threshold, speech_before
            )
            kept = [w.end for s in segments for w in s.words or ()]
            self.speech_end = kept[-1] if kept else speech_before
            if skip:  # a window that may be all hallucination: past the silence, from there
                self.seek += max(advance, 1)
                self.skip_silence()
                return
        missed = None
        if self.speech and (silence or times is not None):
            timed = (
                segments
                if asked is not None or silence
                else self._segments(window, result, times)[0]
            )
            missed = self.missed(window, segments, timed, advance)
            if asked is None:
                segments = self.retimed(segments, timed)
        if missed is not None:
            kept, start = missed
            segments = segments[:kept]
            self.focus = self.speech_end_frame(start)
            # a cut window seeks to the speech it missed itself, with no lead: that speech
            # starts UNCOVERED_S or more after its start (`missed`), so every cut window moves
            # the seek on, and a window that seeks back is followed by a cut one
            floor = max([window.offset] + [s.end for s in segments])
            lead = 0.0 if window.focused else LEAD_S
            advance = round((max(start - lead, floor) - window.offset) * FRAMES_PER_SECOND)
        for s in segments:
            self.segments.append(Segment(**{**s.__dict__, "id": len(self.segments)}))
            self.all_tokens.extend(s.tokens)
        if missed is None:  # (a seek back to missed speech keeps its lead)
            self.seek += max(advance, 1)
            self.skip_silence()
        else:
            self.seek += advance
        if not silence and (
            not self.options.condition_on_previous_text
            or result.temperature > self.options.prompt_reset_on_temperature
        ):
            self.prompt_reset_since = len(self.all_tokens)

    def unhallucinated(
        self,
        window: Window,
        segments: list[Segment],
        advance: int,
        single_ending: bool,
        threshold: float,
        last_end: float,
    ) -> tuple[list[Segment], int, bool]:
        """openai-whisper's `hallucination_silence_threshold`: where a segment looks made up
        (`is_anomaly`) and silence of `threshold` seconds or more (by its words' times) comes
        before and after it, it and what follows are dropped and the seek goes to it; a window
        whose first segment looks made up after such a silence is skipped up to it (True).
        `last_end`: where speech ended before the window. Returns the segments kept, the
        frames to advance, and whether to skip the window."""
        offset, content = window.offset, window.size / FRAMES_PER_SECOND
        window_end = offset + content
        ends = [w.end for s in segments for w in s.words or ()]
        if not single_ending and ends and ends[-1] > offset:
            if window_end - ends[-1] > threshold:
                advance = round((ends[-1] - offset) * FRAMES_PER_SECOND)
            else:
                advance = window.size
        worded = [s for s in segments if s.words]
        if worded and is_anomaly(worded[0]) and worded[0].start - offset > threshold:
            return [], round((worded[0].start - offset) * FRAMES_PER_SECOND), True
        for i, segment in enumerate(segments):
            if not segment.words:
                continue
            after = next((s for s in segments[i + 1 :] if s.words), None)
            if is_anomaly(segment):
                next_start = after.words[0].start if after else offset + content
                before = (
                    segment.start - last_end > threshold
                    or segment.start < threshold
                    or segment.start - offset < 2.0
                )
                following = (
                    next_start - segment.end > threshold
                    or (after is not None and is_anomaly(after))
                    or window_end - segment.end < 2.0
                )
                if before and following:
                    seek = round(max(offset + 1, segment.start) * FRAMES_PER_SECOND)
                    if self.source.duration - segment.end < threshold:
                        seek = self.source.n_frames
                    return segments[:i], seek - window.seek, False
            last_end = segment.end
        return segments, advance, False

    @staticmethod
    def retimed(segments: list[Segment], timed: list[Segment]) -> list[Segment]:
        """The segments with the start and end of their words where the window's words were
        timed to look for skipped speech (without word timestamps asked): a window that looks
        as if it skipped speech often did not, but put one segment's end timestamp seconds
        before its last words (on the dev set's hour, 3083.5 s for words spoken to 3102.5 s),
        and those would be its subtitle's times."""
        by_tokens = {tuple(s.tokens): s for s in timed}
        out = []
        for s in segments:
            placed = by_tokens.get(tuple(s.tokens))
            out.append(s if placed is None else replace(s, start=placed.start, end=placed.end))
        return out

    def missed(
        self, window: Window, segments: list[Segment], timed: list[Segment], advance: int
    ) -> tuple[int, float] | None:
        """The first speech this window skipped, by the words of its segments as `timed`
        (openai-whisper's word placement: a word stretched over a pause or over speech the
        text skips is cut back at sentence boundaries): (how many of `segments` come before
        it, where it starts in seconds); None if it skipped none, or if that speech starts
        where this window, cut to it already, starts."""
        words = [w for s in timed for w in s.words or ()]
        covered = [(w.start - WORD_SLACK_S, w.end + WORD_SLACK_S) for w in words]
        end = window.offset + advance / FRAMES_PER_SECOND
        start = first_gap(self.speech, covered, window.offset, end)
        if start is None or (window.focused and start < window.offset + UNCOVERED_S):
            return None
        ends = {tuple(s.tokens): s.words[-1].end for s in timed if s.words}
        kept = 0  # the segments before it: their words end before it starts
        while (
            kept < len(segments)
            and ends.get(tuple(segments[kept].tokens), segments[kept].end) <= start
        ):
            kept += 1
        return kept, start

    def speech_end_frame(self, start: float) -> int:
        """Where the stretch of speech from `start` ends (its pauses shorter than BRIDGE_S
        bridged), as a frame (a window holds 30 s of it at most)."""
        end = start
        for s, e in self.speech:
            if e <= start:
                continue
            if s > end + BRIDGE_S and end > start:
                break
            end = max(end, e)
        return round((end + TAIL_S) * FRAMES_PER_SECOND)


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
        self.decoded_frames = 0  # and skipped, as silence
        self.stretches = (
            None if self.vad is None else speech_stretches(self.vad, self.source.n_frames)
        )
        self.next_stretch()

    def next_stretch(self) -> None:
        """With voice activity: the seek at the start of the stretch of speech not yet handed
        out (past the end when none is left), the silence before it counted as done."""
        if self.stretches is None:
            return
        while self.stretches and self.stretches[0][1] <= self.next_seek:
            self.stretches.pop(0)
        start = self.stretches[0][0] if self.stretches else self.source.n_frames
        if start > self.next_seek:
            self.decoded_frames += start - self.next_seek
            self.next_seek = start

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
            end = self.stretches[0][1] if self.stretches else self.source.n_frames
            mel = self.source.window(seek)
            size = end - seek
            if size > N_FRAMES:
                loudness = mel[:, N_FRAMES - self.QUIET_SEARCH :].mean(dim=0)
                size = N_FRAMES - self.QUIET_SEARCH + int(loudness.argmin())
            if seek + size < self.source.n_frames:
                mel = self.source.pad(mel, size)
            self.next_seek = seek + size
            self.next_stretch()
            self.pending += 1
            yield Window(seek, size, mel)

    def accept(self, window: Window, result: WindowResult, times: TokenTimes | None = None) -> None:
        self.pending -= 1
        segments, advance = self._segments(window, result, times)
        advance = max(self.past_words(window, segments, advance), 1)
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
