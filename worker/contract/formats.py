"""Render a stored result (a TranscriptResult) as json, verbose_json, text, srt or vtt.

Light on purpose (no torch): the API renders results it reads from storage, and the CLI uses
the same writers. One small writer per format, each with its media type and file extension.
"""

from __future__ import annotations

import json
from typing import ClassVar

from worker.contract.languages import LANGUAGES
from worker.contract.results import TranscriptResult


def format_timestamp(seconds: float, decimal: str = ".", always_hours: bool = False) -> str:
    """12.345 -> "00:00:12.345" (SRT uses "," and always shows hours)."""
    ms = round(seconds * 1000)
    hours, ms = divmod(ms, 3_600_000)
    minutes, ms = divmod(ms, 60_000)
    secs, ms = divmod(ms, 1000)
    head = f"{hours:02d}:" if always_hours or hours else ""
    return f"{head}{minutes:02d}:{secs:02d}{decimal}{ms:03d}"


class ResultWriter:
    extension: ClassVar[str]
    media_type: ClassVar[str]

    def render(self, result: TranscriptResult) -> str:
        raise NotImplementedError


class WriteJSON(ResultWriter):
    """whisperfleet's own result, as stored."""

    extension, media_type = "json", "application/json"

    def render(self, result: TranscriptResult) -> str:
        return json.dumps(result.model_dump(), ensure_ascii=False)


class WriteVerboseJSON(ResultWriter):
    """OpenAI's `verbose_json` transcription shape."""

    extension, media_type = "verbose.json", "application/json"

    def render(self, result: TranscriptResult) -> str:
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
        return json.dumps(body, ensure_ascii=False)


class WriteText(ResultWriter):
    extension, media_type = "txt", "text/plain; charset=utf-8"

    def render(self, result: TranscriptResult) -> str:
        return result.text + "\n"


class WriteSRT(ResultWriter):
    extension, media_type = "srt", "application/x-subrip; charset=utf-8"

    def render(self, result: TranscriptResult) -> str:
        cues = []
        for i, s in enumerate(result.segments, start=1):
            start = format_timestamp(s.start, ",", always_hours=True)
            end = format_timestamp(s.end, ",", always_hours=True)
            cues.append(f"{i}\n{start} --> {end}\n{s.text.strip()}\n")
        return "\n".join(cues)


class WriteVTT(ResultWriter):
    extension, media_type = "vtt", "text/vtt; charset=utf-8"

    def render(self, result: TranscriptResult) -> str:
        cues = []
        for s in result.segments:
            start, end = format_timestamp(s.start), format_timestamp(s.end)
            cues.append(f"{start} --> {end}\n{s.text.strip()}\n")
        return "\n".join(["WEBVTT\n", *cues])


WRITERS: dict[str, ResultWriter] = {
    "json": WriteJSON(),
    "verbose_json": WriteVerboseJSON(),
    "text": WriteText(),
    "srt": WriteSRT(),
    "vtt": WriteVTT(),
}
