"""Recognise an upload from its first bytes, before any decoding.

Light on purpose: the API uses it to refuse non-audio cheaply; the worker decodes for real.
"""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED = ("wav", "flac", "ogg", "mp3")
EXPECTED = "expected WAV, FLAC, OGG or MP3 audio"


@dataclass(frozen=True)
class Sniffed:
    format: str | None  # wav, flac, ogg, mp3, npy, or a recognised unsupported container
    supported: bool


def sniff(head: bytes) -> Sniffed:
    """Name the container from at least the first 12 bytes of a file."""
    if head[:4] == b"RIFF" and head[8:12] == b"WAVE":
        return Sniffed("wav", True)
    if head[:4] == b"fLaC":
        return Sniffed("flac", True)
    if head[:4] == b"OggS":
        return Sniffed("ogg", True)
    if head[:3] == b"ID3":
        return Sniffed("mp3", True)
    if len(head) >= 2 and head[0] == 0xFF and head[1] & 0xE0 == 0xE0:
        # MPEG audio frame sync: layer bits 00 mean ADTS AAC, anything else MPEG layer I-III
        return Sniffed("mp3", True) if head[1] & 0x06 else Sniffed("aac", False)
    if head[:6] == b"\x93NUMPY":
        return Sniffed("npy", False)
    if head[4:8] == b"ftyp":
        return Sniffed("mp4", False)
    if head[:4] == b"\x1a\x45\xdf\xa3":
        return Sniffed("webm", False)
    return Sniffed(None, False)
