"""Decode audio bytes to what Whisper hears: mono float32 at 16 kHz, block by block.

libsndfile (through soundfile) reads WAV, FLAC, OGG/Vorbis/Opus and MP3; PyAV (FFmpeg) reads
the containers libsndfile cannot: M4A/AAC, MP4, WebM/Opus. Decoding is a stream of blocks, so a
two-hour recording never sits in memory decoded: `Audio.blocks()` can be iterated as often as
needed (the log-mel takes two passes over long audio). libsndfile quietly returns part of a
truncated WAV, OGG or MP3; those cases are checked here, because a transcript of half a file
must not pass for the transcript of the file.

Other rates are resampled by FFmpeg's libswresample (through PyAV), as openai-whisper
(`ffmpeg -ar 16000`) and faster-whisper (PyAV) resample: the model hears what it hears there.

PyAV is imported only where it is needed (those containers, those rates): without it, WAV,
FLAC, OGG and MP3 at 16 kHz still decode, and the others are refused saying what is missing.
"""

from __future__ import annotations

import io
import logging
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import soundfile as sf

SAMPLE_RATE = 16000
CHUNK_LENGTH = 30  # seconds in one of Whisper's windows
N_SAMPLES = CHUNK_LENGTH * SAMPLE_RATE  # 480000 samples in a 30 s window
# Sample rates accepted: telephone (8 kHz) up to studio (384 kHz). Outside, a file is far more
# likely a mistake or an attack than speech (a 7 KB WAV at 1 Hz declares two hours).
MIN_RATE, MAX_RATE = 8000, 384000

log = logging.getLogger(__name__)

EXPECTED = "expected WAV, FLAC, OGG, MP3, M4A/AAC, MP4 or WebM audio"
BLOCK_SECONDS = 30
_AV_FORMATS = {"mov,mp4,m4a,3gp,3g2,mj2": "MP4", "matroska,webm": "WebM", "aac": "AAC"}


class AudioError(ValueError):
    """The bytes are not audio the engine can decode; the message says why."""


def _pyav(needed_for: str):
    """The `av` module, or an AudioError saying what needed it."""
    try:
        import av
    except ImportError:
        raise AudioError(f"{needed_for} needs PyAV (pip install av), not installed here") from None
    return av


class InputTooLong(ValueError):
    """Audio or a spectrogram longer than the engine takes (`EngineConfig.max_audio_s`).

    Each kind also has its own error type (`AudioTooLong` is an `AudioError`,
    `engine.inputs.SpectrogramTooLong` a `SpectrogramError`), so a caller that tells the kinds
    apart still catches it; one that tells "too long" apart catches this."""


class AudioTooLong(InputTooLong, AudioError):
    """Audio longer than the limit: declared so by the file, or found so while decoding."""


@dataclass(frozen=True)
class AudioInfo:
    format: str  # container: WAV, FLAC, OGG, MP3 (libsndfile) or FFmpeg's name (PyAV)
    sample_rate: int
    channels: int
    frames: int | None  # declared length in samples at `sample_rate`, when the file says


def _wav_data_sizes(data: bytes) -> tuple[int, int] | None:
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


class Audio:
    """An encoded audio file held in memory, decoded on demand."""

    def __init__(self, data: bytes):
        if not data:
            raise AudioError(f"the file is empty; {EXPECTED}")
        self.data = data
        self.backend, self.info = self._probe()

    def _probe(self) -> tuple[str, AudioInfo]:
        try:
            i = sf.info(io.BytesIO(self.data))
            info = AudioInfo(i.format, i.samplerate, i.channels, i.frames)
            backend = "soundfile"
        except (sf.LibsndfileError, RuntimeError) as libsndfile_error:
            try:
                info = self._probe_av()
            except AudioError:
                raise
            except Exception as e:  # FFmpeg's errors vary by container; none names the input
                log.debug("undecodable: libsndfile: %s; FFmpeg: %s", libsndfile_error, e)
                raise AudioError(f"could not decode the audio; {EXPECTED}") from e
            backend = "av"
        wav = _wav_data_sizes(self.data)
        if wav is not None and wav[0] > wav[1] and wav[0] not in (0, 0xFFFFFFFF):
            raise AudioError(
                f"truncated WAV: its data chunk declares {wav[0]} bytes, {wav[1]} present"
            )
        if info.format == "OGG" and not _ogg_has_last_page(self.data):
            raise AudioError("truncated OGG: the stream ends without its final page")
        if info.sample_rate <= 0 or info.channels <= 0:
            raise AudioError(f"the {info.format} file declares no sample rate or channels")
        if not MIN_RATE <= info.sample_rate <= MAX_RATE:
            raise AudioError(
                f"the {info.format} file's sample rate is {info.sample_rate} Hz; "
                f"expected {MIN_RATE} to {MAX_RATE} Hz"
            )
        return backend, info

    def _probe_av(self) -> AudioInfo:
        av = _pyav("audio that is not WAV, FLAC, OGG or MP3 (M4A/AAC, MP4, WebM)")
        with av.open(io.BytesIO(self.data)) as container:
            if not container.streams.audio:
                raise AudioError(
                    f"the {container.format.name} file has no audio stream; {EXPECTED}"
                )
            stream = container.streams.audio[0]
            name = _AV_FORMATS.get(container.format.name, container.format.name.upper())
            frames = None
            # Containers with an index know their length; raw streams (ADTS AAC) only guess it.
            if container.duration and name in ("MP4", "WebM"):  # microseconds
                frames = round(container.duration * stream.rate / 1_000_000)
            return AudioInfo(name, stream.rate, stream.codec_context.channels, frames)

    @property
    def format(self) -> str:
        return self.info.format

    def _source_blocks(self, block: int) -> Iterator[np.ndarray]:
        """Mono float32 blocks at the file's own rate."""
        if self.backend == "soundfile":
            read = 0
            try:
                with sf.SoundFile(io.BytesIO(self.data)) as f:
                    # f.read, not f.blocks: blocks pads a short read with zeros to the
                    # declared length, which would hide truncation
                    while len(b := f.read(block, dtype="float32", always_2d=True)):
                        read += len(b)
                        yield b.mean(axis=1) if b.shape[1] > 1 else b[:, 0]
            except (sf.LibsndfileError, RuntimeError) as e:
                log.debug("libsndfile: %s", e)
                raise AudioError(f"the {self.format} audio is damaged or cut short") from e
            if read < self.info.frames:
                raise AudioError(
                    f"truncated {self.format}: {self.info.frames} frames declared, {read} decodable"
                )
            return
        read = 0
        av = _pyav(f"{self.format} audio")
        try:
            with av.open(io.BytesIO(self.data)) as container:
                stream = container.streams.audio[0]
                # to float planar, same layout and rate: channels are averaged and rates
                # resampled here, as for every other container
                to_float = av.AudioResampler(format="fltp", layout=stream.layout, rate=stream.rate)
                for frame in container.decode(stream):
                    for converted in to_float.resample(frame):
                        planes = converted.to_ndarray()  # (channels, n)
                        read += planes.shape[1]
                        yield planes.mean(axis=0)
        except Exception as e:  # FFmpeg raises many kinds; all mean "undecodable"
            log.debug("FFmpeg: %s", e)
            raise AudioError(f"the {self.format} audio is damaged or cut short") from e
        if self.info.frames and read < 0.98 * self.info.frames:
            raise AudioError(
                f"truncated {self.format}: {self.info.frames} frames declared, {read} decodable"
            )

    def blocks(self, seconds: float = BLOCK_SECONDS) -> Iterator[np.ndarray]:
        """Mono float32 blocks at 16 kHz of up to `seconds`; the last may be shorter, and so
        are those of audio above 16 kHz (read 16 kHz's worth of samples at a time, so the
        memory a block takes does not grow with the rate).

        Raises AudioError (truncation, corrupt data, NaN) when it is found, mid-stream.
        """
        rate = self.info.sample_rate
        resampler = Resampler(rate)
        empty = True
        for x in self._source_blocks(max(1, round(seconds * min(rate, SAMPLE_RATE)))):
            if not np.isfinite(x).all():
                raise AudioError(f"the {self.format} file holds NaN or infinite samples")
            empty = empty and len(x) == 0
            out = resampler.push(x)
            if len(out):
                yield out
        out = resampler.flush()
        if len(out):
            yield out
        if empty:
            raise AudioError(f"the {self.format} file holds no samples")

    def decode(self) -> np.ndarray:
        """The whole file, shape = (n_samples,): for clips, not for long recordings."""
        return np.concatenate(list(self.blocks()))


def decode_audio(data: bytes) -> np.ndarray:
    """Decode a whole audio file held in memory to mono float32 at 16 kHz."""
    return Audio(data).decode()


class Resampler:
    """Resampling of a mono stream by libswresample: pushing a signal in pieces gives the same
    samples as resampling it whole. Its filter keeps a bounded number of phases (1024), so its
    memory does not depend on the rates; the windowed-sinc table it replaces held one row per
    output phase, 16000 x rate entries for a rate sharing no factor with 16 kHz (issue 12: an
    8 KB file at 4,001 Hz took 2.5 GB)."""

    def __init__(self, orig_rate: int, new_rate: int = SAMPLE_RATE):
        self.orig_rate = orig_rate
        self._av = None if orig_rate == new_rate else _pyav(f"resampling {orig_rate} Hz audio")
        self._swr = self._av and self._av.AudioResampler(format="flt", layout="mono", rate=new_rate)

    def push(self, x: np.ndarray) -> np.ndarray:
        """Samples of shape (n,) in; the resampled samples ready so far out."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        if self._swr is None or not len(x):
            return x
        frame = self._av.AudioFrame.from_ndarray(x[None], format="flt", layout="mono")
        frame.sample_rate = self.orig_rate
        return self._convert(frame)

    def flush(self) -> np.ndarray:
        """The samples still held (the filter's delay) at the end of the stream."""
        return np.zeros(0, np.float32) if self._swr is None else self._convert(None)

    def _convert(self, frame) -> np.ndarray:  # an av.AudioFrame, or None to flush
        out = [converted.to_ndarray()[0] for converted in self._swr.resample(frame)]
        return np.concatenate(out) if out else np.zeros(0, np.float32)


def resample(audio: np.ndarray, orig_rate: int, new_rate: int = SAMPLE_RATE) -> np.ndarray:
    """Resample a whole signal: shape = (n,) -> (about n * new / orig,)."""
    r = Resampler(orig_rate, new_rate)
    return np.concatenate([r.push(audio), r.flush()])
