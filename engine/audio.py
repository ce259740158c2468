"""Decode audio bytes to what Whisper hears: mono float32 at 16 kHz.

libsndfile (through soundfile) reads WAV, FLAC, OGG/Vorbis/Opus and MP3 from memory. It
quietly returns part of a truncated WAV, OGG or MP3, so those cases are checked here: a
transcript of half a file must not pass for the transcript of the file.
"""

from __future__ import annotations

import io
import math
import struct

import numpy as np
import soundfile as sf
import torch
import torch.nn.functional as F

SAMPLE_RATE = 16000
EXPECTED = "expected WAV, FLAC, OGG or MP3 audio"


class AudioError(ValueError):
    """The bytes are not audio the engine can decode; the message says why."""


def _wav_declared_bytes(data: bytes) -> tuple[int, int] | None:
    """(declared, present) byte counts of a RIFF/WAVE `data` chunk, or None if not a WAV."""
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    pos = 12
    while pos + 8 <= len(data):
        chunk, size = data[pos : pos + 4], struct.unpack("<I", data[pos + 4 : pos + 8])[0]
        if chunk == b"data":
            return size, len(data) - pos - 8
        pos += 8 + size + (size & 1)
    return None


def _ogg_has_last_page(data: bytes) -> bool:
    """True if the final Ogg page carries the end-of-stream flag (absent when cut short)."""
    last = data.rfind(b"OggS")
    return last >= 0 and len(data) > last + 5 and data[last + 5] & 0x04 != 0


def _check_complete(data: bytes, info: sf._SoundFileInfo, frames_read: int) -> None:
    wav = _wav_declared_bytes(data)
    if wav is not None and wav[0] > wav[1] and wav[0] not in (0, 0xFFFFFFFF):
        raise AudioError(f"truncated WAV: its data chunk declares {wav[0]} bytes, {wav[1]} present")
    if info.format == "OGG" and not _ogg_has_last_page(data):
        raise AudioError("truncated OGG: the stream ends without its final page")
    if frames_read < info.frames:
        raise AudioError(
            f"truncated {info.format}: {info.frames} frames declared, {frames_read} decodable"
        )


def decode_audio(data: bytes) -> np.ndarray:
    """Decode a whole audio file held in memory.

    Returns:
        shape = (n_samples,), float32 mono at 16 kHz, channels averaged.
    Raises:
        AudioError: empty, unreadable, truncated, silent-by-emptiness or non-finite input.
    """
    if not data:
        raise AudioError(f"the file is empty; {EXPECTED}")
    try:
        info = sf.info(io.BytesIO(data))
        samples, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except (sf.LibsndfileError, RuntimeError) as e:
        raise AudioError(f"could not decode the audio ({e}); {EXPECTED}") from e
    _check_complete(data, info, len(samples))
    if len(samples) == 0:
        raise AudioError(f"the {info.format} file holds no samples")
    if not np.isfinite(samples).all():
        raise AudioError(f"the {info.format} file holds NaN or infinite samples")
    mono = samples.mean(axis=1) if samples.shape[1] > 1 else samples[:, 0]
    return resample(mono, rate, SAMPLE_RATE)


def resample(audio: np.ndarray, orig_rate: int, new_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Band-limited (windowed-sinc, Hann) resampling, as torchaudio's default `resample`.

    audio: shape = (n_samples,), float32; returns shape = (ceil(n_samples * new / orig),)
    """
    if orig_rate == new_rate:
        return np.ascontiguousarray(audio, dtype=np.float32)
    g = math.gcd(orig_rate, new_rate)
    orig, new = orig_rate // g, new_rate // g
    zeros = 6  # sinc lobes on each side
    cutoff = min(orig, new) * 0.99  # roll off just below Nyquist
    width = math.ceil(zeros * orig / cutoff)
    idx = torch.arange(-width, width + orig, dtype=torch.float64)[None, None] / orig
    t = (torch.arange(0, -new, -1, dtype=torch.float64)[:, None, None] / new + idx) * cutoff
    t = t.clamp(-zeros, zeros)
    window = torch.cos(t * math.pi / zeros / 2) ** 2
    t = t * math.pi
    sinc = torch.where(t == 0, torch.ones_like(t), torch.sin(t) / t)
    kernels = (sinc * window * cutoff / orig).float()  # (new, 1, 2 * width + orig)

    x = torch.from_numpy(np.ascontiguousarray(audio, dtype=np.float32))
    x = F.pad(x[None, None], (width, width + orig))
    y = F.conv1d(x, kernels, stride=orig).transpose(1, 2).reshape(-1)
    return y[: math.ceil(new * len(audio) / orig)].numpy()
