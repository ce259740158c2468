"""An input read on the host, before any device work: what a process without the model does
(a worker's job threads, many at once), with numpy, libsndfile and FFmpeg and without torch, so
that a job process, which only reads and sends inputs to its engine core, does not spend its
start importing it. `engine.inputs` turns what is read here into windows on the device.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from engine.audio import N_SAMPLES, SAMPLE_RATE, Audio, AudioTooLong, InputTooLong

# Audio or a spectrogram longer than this is refused (issue 12: without a limit, a 7 KB WAV
# at 1 Hz was two hours of work); `EngineConfig.max_audio_s`.
MAX_AUDIO_S = 4 * 3600.0


class SpectrogramError(ValueError):
    """An array that is not a Whisper log-mel spectrogram this model can take."""


class SpectrogramTooLong(InputTooLong, SpectrogramError):
    """A spectrogram with more frames than the limit allows (100 a second)."""


def within_limit(blocks: Iterator[np.ndarray], max_s: float, fmt: str) -> Iterator[np.ndarray]:
    """The blocks of 16 kHz samples, refused as soon as they pass `max_s` seconds: a file
    is never decoded further than the limit to find out it is too long."""
    n = 0
    for block in blocks:
        n += len(block)
        if n > max_s * SAMPLE_RATE:
            raise AudioTooLong(
                f"the {fmt} audio runs past {n / SAMPLE_RATE:.1f} s; expected at most {max_s:g} s"
            )
        yield block


@dataclass(frozen=True)
class LongAudio:
    """Audio read far enough to know it runs past 30 s: left encoded, streamed by
    `engine.inputs.open_audio` without decoding its start again."""

    audio: Audio


# an input read on the host, before any device work: the samples of up to 30 s of audio
# (1-D), a spectrogram array (2-D or 3-D), or longer audio still encoded
Host = np.ndarray | LongAudio


def read_input(item: bytes | np.ndarray | Audio | LongAudio, max_s: float = MAX_AUDIO_S) -> Host:
    """The host's part of reading an input, which a process without the model can do (a
    worker's job threads, many at once): a .npy file loaded, audio of up to 30 s decoded to
    16 kHz samples; longer audio only probed and checked against `max_s`, left encoded so
    that it is never held decoded whole. Raises AudioError or SpectrogramError."""
    if isinstance(item, bytes) and item[:6] == b"\x93NUMPY":
        try:
            return np.load(io.BytesIO(item), allow_pickle=False)
        except ValueError as e:  # numpy's words may quote the header back: keep to ours
            raise SpectrogramError("not a readable .npy array (header or data damaged)") from e
    if isinstance(item, np.ndarray | LongAudio):  # read already
        return item
    audio = Audio(item) if isinstance(item, bytes) else item
    clip = _clip(audio, max_s)
    return LongAudio(audio) if clip is None else clip


def _clip(audio: Audio, max_s: float) -> np.ndarray | None:
    """The samples of audio of up to 30 s; None for longer audio. Which one is found by
    decoding at most 30 s (files do not always say how long they are). Audio longer than
    `max_s` seconds is refused (AudioTooLong): from the length a file declares, else while it
    is decoded."""
    info = audio.info
    if info.frames and info.frames > max_s * info.sample_rate:
        seconds = info.frames / info.sample_rate
        raise AudioTooLong(
            f"the {info.format} file declares {seconds:.1f} s; expected at most {max_s:g} s"
        )
    blocks, n = [], 0
    for block in within_limit(audio.blocks(), max_s, info.format):
        blocks.append(block)
        n += len(block)
        if n > N_SAMPLES:
            return None
    return np.concatenate(blocks) if blocks else np.zeros(0, np.float32)
