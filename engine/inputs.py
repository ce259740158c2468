"""What the engine transcribes: audio or a precomputed log-mel spectrogram, as 30 s windows.

Both kinds become a `MelSource`: `window(seek)` gives the 3000 frames from frame `seek`. A clip
of up to 30 s starts as its audio zero-padded to 30 s (`WhisperFeatureExtractor`'s default, so
the frames after it hold the clip's floor value, what digital silence becomes); any window
that runs past the end of its input after a seek is padded with zeros, as openai-whisper's,
faster-whisper's and transformers' long-form `transcribe` pad it (docs/accuracy.md, Long-form).
Seeks only move forward, so long audio is decoded and turned into frames as a stream, twice:
once for the clip's maximum (Whisper clamps every frame to max - 8) and its speech
(`engine.vad`), once for the frames themselves. At most a few windows of frames are held at
any time.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch

from engine.audio import Audio, AudioTooLong
from engine.host import (
    MAX_AUDIO_S,
    LongAudio,
    SpectrogramError,
    SpectrogramTooLong,
    read_input,
    within_limit,
)
from engine.mel import (
    FRAMES_PER_SECOND,
    HOP_LENGTH,
    N_FRAMES,
    N_SAMPLES,
    SAMPLE_RATE,
    log_mel_spectrogram,
    stream_log10_mel,
    to_device,
)
from engine.vad import BLOCK_CHUNKS, CHUNK, Detector, speech_regions

SPECTROGRAM_DTYPES = (np.float16, np.float32, np.float64)
# a first pass (and diarization, reading it again) reads long audio in blocks of this many
# seconds (Silero's largest pass, 131 s): each block is a few launches and one copy to the
# device, whatever its length, and 30 s blocks made the first passes of 16 long inputs side by
# side bound by the host
FIRST_PASS_S = BLOCK_CHUNKS * CHUNK / SAMPLE_RATE


def _normalize(log10_mel: torch.Tensor, log10_max: float) -> torch.Tensor:
    return (log10_mel.clamp(min=log10_max - 8.0) + 4.0) / 4.0


def _padded(frames: torch.Tensor) -> torch.Tensor:
    """Up to N_FRAMES frames, zero-padded to exactly N_FRAMES; a view of `frames` when nothing
    is missing (windows are read, never written)."""
    frames = frames[:, :N_FRAMES]
    if frames.shape[1] == N_FRAMES:
        return frames
    return torch.nn.functional.pad(frames, (0, N_FRAMES - frames.shape[1]))


class MelSource:
    """Log-mel frames of one input, read window by window, forward only."""

    n_mels: int
    n_frames: int  # frames of content (100 per second)
    duration: float  # seconds of content
    floor: float  # the value of a frame of digital silence (what cut windows are padded with)
    # (start s, end s) of each stretch of speech (engine.vad), where the source's samples were
    # read: audio over 30 s, whose first pass reads them anyway
    speech: list[tuple[float, float]] | None = None
    unheard = False  # long audio whose first pass was told not to find its speech

    def window(self, seek: int) -> torch.Tensor:
        """shape = (n_mels, N_FRAMES): frames seek .. seek + 3000; past the end of the input,
        zeros (but a clip's first window, the extractor's, is its padded audio's)."""
        raise NotImplementedError

    hears = False  # whether it holds audio (`samples`), not a spectrogram

    def samples(self) -> Iterator[np.ndarray]:
        """The input's 16 kHz samples, block by block (long audio decoded once more: for
        speaker embeddings, `engine.diarize`)."""
        raise TypeError("a spectrogram has no samples")

    def pad(self, window: torch.Tensor, size: int) -> torch.Tensor:
        """The window with its frames from `size` on replaced by silence (a cut window)."""
        out = window.clone()
        out[:, size:] = self.floor
        return out


# an input validated and decoded: a source of windows, or the samples of up to 30 s of audio
Prepared = MelSource | np.ndarray


class _HeldMel(MelSource):
    """All frames already in memory: short audio, or a spectrogram the caller sent."""

    def __init__(
        self, mel: torch.Tensor, n_frames: int, floor: float, clip: np.ndarray | None = None
    ):
        self.mel, self.n_mels, self.n_frames, self.floor = mel, mel.shape[0], n_frames, floor
        self.clip = clip  # the samples of a clip; None for a spectrogram
        self.hears = clip is not None
        self.duration = n_frames / FRAMES_PER_SECOND if clip is None else len(clip) / SAMPLE_RATE

    def samples(self) -> Iterator[np.ndarray]:
        return iter([self.clip]) if self.clip is not None else super().samples()

    def window(self, seek: int) -> torch.Tensor:
        if seek == 0 and self.mel.shape[1] == N_FRAMES:  # a clip as the extractor pads it
            return self.mel
        return _padded(self.mel[:, seek : self.n_frames])


class _StreamedMel(MelSource):
    """Frames of long audio, computed as the seek advances. The first pass refuses audio
    longer than `max_s` seconds as soon as it passes the limit, and finds its speech unless
    told not to (`speech`: options that use none, `TranscriptionOptions.finds_speech`)."""

    hears = True

    def __init__(self, audio: Audio, n_mels: int, device: torch.device, max_s: float, speech: bool):
        self.n_mels, self._audio = n_mels, audio
        n_frames, n_samples = 0, 0

        def sent(blocks: Iterator[np.ndarray]) -> Iterator[torch.Tensor]:
            nonlocal n_samples
            for block in within_limit(blocks, max_s, audio.format):
                n_samples += len(block)
                x = to_device(block, device)
                if voice is not None:
                    voice.feed(x)
                yield x

        with own_stream(device):  # first pass: the host waits for the device once, at the end
            voice = Detector(device) if speech else None
            peak = torch.full((), -math.inf, device=device)
            blocks = sent(audio.blocks(FIRST_PASS_S))
            for frames in stream_log10_mel(blocks, n_mels, device):
                peak = torch.maximum(peak, frames.amax())
                n_frames += frames.shape[1]
            probs = None if voice is None else voice.finish()
            log10_max = peak.item()
        self.log10_max, self.n_frames = log10_max, n_frames
        self.duration = n_samples / SAMPLE_RATE
        if probs is not None:
            self.speech = speech_regions(probs, self.duration)
        self.floor = (log10_max - 8.0 + 4.0) / 4.0
        self._frames: Iterator[torch.Tensor] = stream_log10_mel(audio.blocks(), n_mels, device)
        self._held = torch.zeros(n_mels, 0, device=device)
        self._start = 0  # frame index of self._held[:, 0]

    @property
    def unheard(self) -> bool:
        return self.speech is None  # long audio's speech is found in its first pass, or never

    def samples(self) -> Iterator[np.ndarray]:
        return self._audio.blocks(FIRST_PASS_S)

    def window(self, seek: int) -> torch.Tensor:
        if seek < self._start:
            raise ValueError(f"seek {seek} is behind frame {self._start}: windows go forward")
        while True:  # drop frames before the seek; pull more until a window is held
            drop = min(seek - self._start, self._held.shape[1])
            self._held, self._start = self._held[:, drop:], self._start + drop
            if self._start == seek and self._held.shape[1] >= N_FRAMES:
                break
            frames = next(self._frames, None)
            if frames is None:
                break
            self._held = torch.cat([self._held, _normalize(frames, self.log10_max)], dim=1)
        return _padded(self._held if self._start == seek else self._held[:, :0])


@contextmanager
def own_stream(device: torch.device | str) -> Iterator[None]:
    """On CUDA, the device work inside on a stream of its own, waited for at the end: a long
    input's first pass (log-mel and voice activity, read back block by block) and a
    diarization run, on their own threads, neither wait for the decode steps queued on the
    default stream nor keep them waiting, and several run at once. (Silero's LSTM steps
    through an input's 32 ms chunks in order, a few microseconds each, and fills a sliver of
    the GPU: 16 long inputs one after another took 0.9 s of an H100.) Only what stays inside
    may be used inside: the stream waits for the default stream's work queued before it, and
    results leave through the host."""
    device = torch.device(device)
    if device.type != "cuda":
        yield
        return
    # one of torch's pool of streams, reused in turn: never one a graph is captured on
    # (engine.graphs takes those from the high-priority pool)
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        yield
    stream.synchronize()


def open_audio(
    audio: Audio | LongAudio | np.ndarray,
    n_mels: int,
    device: torch.device,
    max_s: float = MAX_AUDIO_S,
    speech: bool = True,
) -> Prepared:
    """Decoded audio (or 16 kHz samples): the samples of up to 30 s, for `sources`, or a
    streamed source of longer audio (as the extractor with `truncation=False`), whose speech
    its first pass finds if `speech`. Which one is found by decoding at most 30 s (files do
    not always say how long they are). Audio longer than `max_s` seconds is refused
    (AudioTooLong): from the length a file declares, else while it is decoded. `LongAudio`
    (what `read_input` found longer) is streamed at once."""
    if isinstance(audio, np.ndarray):
        if len(audio) > max_s * SAMPLE_RATE:
            seconds = len(audio) / SAMPLE_RATE
            raise AudioTooLong(f"got {seconds:.1f} s of samples; expected at most {max_s:g} s")
        if len(audio) <= N_SAMPLES:
            return audio
        return _StreamedMel(_SamplesAsAudio(audio), n_mels, device, max_s, speech)
    read = read_input(audio, max_s)
    if isinstance(read, LongAudio):
        return _StreamedMel(read.audio, n_mels, device, max_s, speech)
    return read


def sources(prepared: Sequence[Prepared], n_mels: int, device: torch.device) -> list[MelSource]:
    """Prepared inputs as windows. The clips of up to 30 s among them, each zero-padded to
    30 s as `WhisperFeatureExtractor` does by default, get their log-mel together: one copy to
    the device, one pass, one wait for their floors."""
    clips = [x for x in prepared if isinstance(x, np.ndarray)]
    held: Iterator[MelSource] = iter(())
    if clips:
        mels = log_mel_spectrogram(_to_device(clips, device), n_mels)
        floors = _floor(mels).tolist()
        held = (
            _HeldMel(mel, len(x) // HOP_LENGTH, floor, x)
            for x, mel, floor in zip(clips, mels, floors, strict=True)
        )
    return [next(held) if isinstance(x, np.ndarray) else x for x in prepared]


def audio_sources(
    items: Sequence[Audio | np.ndarray], n_mels: int, device: torch.device
) -> list[MelSource]:
    """Decoded audio (or 16 kHz samples) as windows: `open_audio`, then `sources`."""
    return sources([open_audio(a, n_mels, device) for a in items], n_mels, device)


def _to_device(clips: list[np.ndarray], device: torch.device) -> torch.Tensor:
    """The clips as rows of one zero-padded tensor on `device`. Only their samples cross to a
    GPU, in one copy from pinned memory: padding them to 30 s on the host first would move
    up to 6x the bytes through the host's memory twice, which took longer than the STFT."""
    flat = torch.empty(sum(map(len, clips)), pin_memory=device.type == "cuda")
    np.concatenate(clips, out=flat.numpy())
    rows = flat.to(device, non_blocking=True).split([len(x) for x in clips])
    return torch.nn.utils.rnn.pad_sequence(list(rows), batch_first=True)


class _SamplesAsAudio:
    """Decoded samples offered as `Audio` blocks (for callers holding an array already)."""

    format = "decoded"

    def __init__(self, samples: np.ndarray):
        self.samples = samples

    def blocks(self, seconds: float = N_SAMPLES / SAMPLE_RATE) -> Iterator[np.ndarray]:
        n = round(seconds * SAMPLE_RATE)
        for i in range(0, len(self.samples), n):
            yield self.samples[i : i + n]


def spectrogram_source(
    array: np.ndarray, n_mels: int, device: torch.device, max_s: float = MAX_AUDIO_S
) -> MelSource:
    """A caller's log-mel spectrogram, validated, as windows.

    Accepted: float16/32/64, finite, shape (n_mels, 3000) or (1, n_mels, 3000) for one window
    (what `WhisperFeatureExtractor` returns for up to 30 s), or (n_mels, T) / (1, n_mels, T)
    with T > 3000 for longer audio (`truncation=False`). Frames past `max_s` seconds (100 a
    second) are refused as SpectrogramTooLong: from the shape, before the values are read.
    """
    max_frames = int(max_s * FRAMES_PER_SECOND)
    forms = (
        f"expected a float16/32/64 array of shape [{n_mels}, 3000] or [1, {n_mels}, 3000] "
        f"(one 30 s window), or [{n_mels}, T] / [1, {n_mels}, T] with T > 3000 (longer "
        "audio, WhisperFeatureExtractor with truncation=False)"
    )
    if not isinstance(array, np.ndarray) or array.dtype not in SPECTROGRAM_DTYPES:
        kind = array.dtype if isinstance(array, np.ndarray) else type(array).__name__
        raise SpectrogramError(f"got {kind}; {forms}")
    if array.ndim == 3 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 2 or array.shape[0] != n_mels:
        raise SpectrogramError(f"got shape {list(array.shape)}; {forms}")
    n = array.shape[1]
    if n < N_FRAMES:
        raise SpectrogramError(f"got {n} frames; {forms}")
    if n > max(N_FRAMES, max_frames):
        raise _too_many_frames(n, max_s)
    if not np.isfinite(array).all():
        raise SpectrogramError(f"the spectrogram holds NaN or infinite values; {forms}")
    # Measured on the host, a window copied without waiting: a GPU worker prepares inputs
    # while decode steps are queued, and a read back from the device (or a copy from pageable
    # memory) waits for all of them, one input at a time (base's spectrogram jobs ran at half
    # the pace of its audio jobs through the fleet, docs/benchmarks.md).
    host = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
    floor = float(_floor(host))
    if n > N_FRAMES:  # long: one plain copy (no pinned buffer of its size), its wait small
        return _HeldMel(host.to(device), n, floor)  # beside its windows' work
    # One window, padded by the extractor: the content ends where digital silence begins.
    loud = (host > floor + 1e-3).any(dim=0).nonzero()
    content = int(loud[-1]) + 1 if len(loud) else 0
    if content > max_frames:  # a limit under 30 s
        raise _too_many_frames(content, max_s)
    return _HeldMel(to_device(host, device), content, floor)


def _too_many_frames(n: int, max_s: float) -> SpectrogramTooLong:
    return SpectrogramTooLong(
        f"got {n} frames ({n / FRAMES_PER_SECOND:g} s at 100 a second); expected at most "
        f"{int(max_s * FRAMES_PER_SECOND)} frames ({max_s:g} s)"
    )


def _floor(mel: torch.Tensor) -> torch.Tensor:
    """What a frame of digital silence is in each clip (mel: shape = (..., n_mels, frames)):
    (log10 max - 8 + 4) / 4, which is the normalised maximum, (log10 max + 4) / 4, less 2."""
    return mel.amax(dim=(-2, -1)) - 2.0
