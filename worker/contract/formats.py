"""Render a stored result (a TranscriptResult) as json, verbose_json, text, srt or vtt.

Light on purpose (no torch): the API renders results it reads from storage, and the CLI uses
the same writers. One small writer per format, each with its media type and file extension.
Subtitles are a cue per segment, or a cue per word (`granularity="word"`) for a result with
word timestamps. A result with speakers (the option diarize) names them: SRT as `[SPEAKER_00]`
before a cue's text, VTT as a voice span (`<v SPEAKER_00>`), text as one line per turn.
"""

from __future__ import annotations

import json
from itertools import groupby
from typing import ClassVar, Literal

from worker.contract.languages import LANGUAGES
from worker.contract.results import TranscriptResult

Granularity = Literal["segment", "word"]


def format_timestamp(seconds: float, decimal: str = ".", always_hours: bool = False) -> str:
    """12.345 -> "00:00:12.345" (SRT uses "," and always shows hours)."""
    ms = round(seconds * 1000)
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    head = f"{hours:02d}:" if always_hours or hours else ""
    return f"{head}{minutes:02d}:{secs:02d}{decimal}{ms:03d}"


class GranularityError(ValueError):
    """Word cues asked of a format that has none, or of a result without word timestamps."""


class ResultWriter:
    extension: ClassVar[str]
    media_type: ClassVar[str]
    granularities: ClassVar[tuple[str, ...]] = ("segment",)

    def render(self, result: TranscriptResult, granularity: Granularity = "segment") -> str:
        """The result in this format; granularity: a subtitle cue per segment or per word."""
        if granularity not in self.granularities:
            raise GranularityError(
                f"granularity={granularity} applies to srt and vtt only: the json formats "
                "carry the words of a job run with word_timestamps"
            )
        if granularity == "word" and result.words is None:
            raise GranularityError(
                "granularity=word needs a job run with word_timestamps=true; this one was not"
            )
        return self._render(result, granularity)

    def _render(self, result: TranscriptResult, granularity: Granularity) -> str:
        raise NotImplementedError


Cue = tuple[float, float, str, str | None]  # start, end, text, speaker


def cues(result: TranscriptResult, granularity: Granularity) -> list[Cue]:
    """(start, end, text, speaker) of each subtitle cue."""
    if granularity == "word":
        return [(w.start, w.end, w.word.strip(), w.speaker) for w in result.words or ()]
    return [(s.start, s.end, s.text.strip(), s.speaker) for s in result.segments]


class WriteJSON(ResultWriter):
    """whisperfleet's own result, as stored."""

    extension, media_type = "json", "application/json"

    def _render(self, result: TranscriptResult, granularity: Granularity) -> str:
        return json.dumps(result.model_dump(), ensure_ascii=False)


class WriteVerboseJSON(ResultWriter):
    """OpenAI's `verbose_json` transcription shape."""

    extension, media_type = "verbose.json", "application/json"

    def _render(self, result: TranscriptResult, granularity: Granularity) -> str:
        segments = [
            {
                "id": s.id,
                "seek": round(s.start * 100),
                "start": s.start,
                "end": s.end,
                "text": s.text,
                "tokens": s.tokens,
                "temperature": s.temperature,
                "avg_logprob": s.avg_logprob,
                "compression_ratio": s.compression_ratio,
                "no_speech_prob": s.no_speech_prob,
                **({} if s.speaker is None else {"speaker": s.speaker}),
                **({} if s.words is None else {"words": [w.model_dump() for w in s.words]}),
            }
            for s in result.segments
        ]
        body = {
            "task": result.options.task,
            "language": LANGUAGES.get(result.language, result.language),
            "duration": result.duration,
            "text": result.text,
            "segments": segments,
        }
        if result.words is not None:
            body["words"] = [w.model_dump() for w in result.words]
        return json.dumps(body, ensure_ascii=False)


class WriteText(ResultWriter):
    extension, media_type = "txt", "text/plain; charset=utf-8"

    def _render(self, result: TranscriptResult, granularity: Granularity) -> str:
        if result.speakers is None:
            return result.text + "\n"
        turns = groupby(result.segments, key=lambda s: s.speaker)
        return "".join(
            f"{speaker}: {''.join(s.text for s in turn).strip()}\n" for speaker, turn in turns
        )


class WriteSRT(ResultWriter):
    extension, media_type = "srt", "application/x-subrip; charset=utf-8"
    granularities = ("segment", "word")

    def _render(self, result: TranscriptResult, granularity: Granularity) -> str:
        out = []
        for i, (start, end, text, speaker) in enumerate(cues(result, granularity), start=1):
            start = format_timestamp(start, ",", always_hours=True)
            end = format_timestamp(end, ",", always_hours=True)
            text = text if speaker is None else f"[{speaker}] {text}"
            out.append(f"{i}\n{start} --> {end}\n{text}\n")
        return "\n".join(out)


class WriteVTT(ResultWriter):
    extension, media_type = "vtt", "text/vtt; charset=utf-8"
    granularities = ("segment", "word")

    def _render(self, result: TranscriptResult, granularity: Granularity) -> str:
        out = [
            f"{format_timestamp(start)} --> {format_timestamp(end)}\n"
            f"{text if speaker is None else f'<v {speaker}>{text}'}\n"
            for start, end, text, speaker in cues(result, granularity)
        ]
        return "\n".join(["WEBVTT\n", *out])


WRITERS: dict[str, ResultWriter] = {
    "json": WriteJSON(),
    "verbose_json": WriteVerboseJSON(),
    "text": WriteText(),
    "srt": WriteSRT(),
    "vtt": WriteVTT(),
}
