"""Whisper's log-mel spectrogram, numerically matching `WhisperFeatureExtractor`.

Runs on whatever device the audio is on. The filter bank is computed here (Slaney mel scale and
area normalisation, as transformers' `mel_filter_bank`) rather than read from a file. Long
audio is turned into frames as a stream (`stream_log10_mel`): the frames equal those of the
whole signal's centred STFT, without holding the signal.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from functools import lru_cache

import numpy as np
import torch

from engine.audio import N_SAMPLES, SAMPLE_RATE

N_FFT = 400
HOP_LENGTH = 160
N_FRAMES = N_SAMPLES // HOP_LENGTH  # 3000 frames in a mel window
FRAMES_PER_SECOND = SAMPLE_RATE // HOP_LENGTH  # 100 frames: 10 ms each


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    mel = 3.0 * hz / 200.0
    log_region = hz >= 1000.0
    mel[log_region] = 15.0 + np.log(hz[log_region] / 1000.0) * (27.0 / np.log(6.4))
    return mel


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    hz = 200.0 * mel / 3.0
    log_region = mel >= 15.0
    hz[log_region] = 1000.0 * np.exp(np.log(6.4) / 27.0 * (mel[log_region] - 15.0))
    return hz


@lru_cache
def mel_filters(n_mels: int) -> np.ndarray:
    """shape = (n_fft // 2 + 1, n_mels): triangular filters over 0-8 kHz, area-normalised."""
    fft_freqs = np.linspace(0, SAMPLE_RATE // 2, N_FFT // 2 + 1)
    mel_edges = np.linspace(
        _hz_to_mel(np.array([0.0]))[0], _hz_to_mel(np.array([8000.0]))[0], n_mels + 2
    )
    hz_edges = _mel_to_hz(mel_edges)
    slopes = hz_edges[None, :] - fft_freqs[:, None]
    widths = np.diff(hz_edges)
    down = -slopes[:, :-2] / widths[:-1]
    up = slopes[:, 2:] / widths[1:]
    filters = np.maximum(0.0, np.minimum(down, up))
    return filters * (2.0 / (hz_edges[2:] - hz_edges[:-2]))[None, :]


@lru_cache(maxsize=16)
def _constants(n_mels: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The STFT window and mel filters on `device`, made once: each copy to a GPU costs a
    host-device round trip per clip."""
    filters = torch.from_numpy(mel_filters(n_mels)).to(device, torch.float32)
    window = torch.hann_window(N_FFT, device=device)
    if window.is_cuda:  # shared by every thread's stream (engine.inputs.own_stream): whole
        torch.cuda.current_stream(window.device).synchronize()  # before another reads them
    return window, filters


def log_mel_spectrogram(audio: torch.Tensor, n_mels: int) -> torch.Tensor:
    """Log-mel features of mono 16 kHz audio, scaled as Whisper expects.

    audio: shape = (n_samples,) or (batch, n_samples), float32, at most 30 s; zero-padded to
        30 s first, as the extractor does by default. A batch is one pass on the device (a
        clip's STFT is a few kernel launches of little work, so clips are cheaper together);
        each row is scaled by its own maximum.
    returns: shape = (n_mels, N_FRAMES) or (batch, n_mels, N_FRAMES), float32, on the audio's
        device.
    """
    return log_mel(torch.nn.functional.pad(audio, (0, max(0, N_SAMPLES - audio.shape[-1]))), n_mels)


def log_mel(audio: torch.Tensor, n_mels: int) -> torch.Tensor:
    """`log_mel_spectrogram` of audio as long as it is (n_samples // HOP_LENGTH frames), as
    the extractors compute a batch padded to its longest member (Qwen3-ASR's)."""
    window, filters = _constants(n_mels, audio.device)
    stft = torch.stft(audio, N_FFT, HOP_LENGTH, window=window, return_complex=True)
    power = stft[..., :-1].abs() ** 2
    log_spec = torch.clamp(filters.T @ power, min=1e-10).log10()
    log_spec = torch.maximum(log_spec, log_spec.amax(dim=(-2, -1), keepdim=True) - 8.0)
    return (log_spec + 4.0) / 4.0


def _log10_mel(segment: torch.Tensor, n_mels: int) -> torch.Tensor:
    """log10 mel power of every full STFT frame in `segment` (no centring, no clamp-to-max).

    segment: shape = (n,), n >= N_FFT; returns shape = (n_mels, 1 + (n - N_FFT) // HOP_LENGTH)
    """
    window, filters = _constants(n_mels, segment.device)
    stft = torch.stft(segment, N_FFT, HOP_LENGTH, window=window, center=False, return_complex=True)
    return torch.clamp(filters.T @ (stft.abs() ** 2), min=1e-10).log10()


def to_device(samples: np.ndarray | torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """float32 samples (or a host tensor: a spectrogram) on `device`. To a GPU through pinned
    memory, without waiting: a copy from pageable memory first waits for the work queued on the
    stream, which would hold a long input's reading to the pace of the work on each block
    before (its Silero, a diarization's embedding passes), and a window's preparing to the
    pace of the decode steps queued."""
    if isinstance(samples, torch.Tensor):
        x = samples.float()
    else:
        x = torch.from_numpy(np.ascontiguousarray(samples, dtype=np.float32))
    if torch.device(device).type != "cuda":
        return x.to(device)
    return x.pin_memory().to(device, non_blocking=True)


def stream_log10_mel(
    blocks: Iterable[np.ndarray | torch.Tensor], n_mels: int, device: torch.device | str = "cpu"
) -> Iterator[torch.Tensor]:
    """log10 mel frames of a 16 kHz sample stream (arrays, or tensors on `device`), in pieces
    of shape (n_mels, k).

    Equal to `torch.stft(center=True)` over the whole signal (reflect-padded at both ends),
    less its last frame, as `WhisperFeatureExtractor` computes with `truncation=False`:
    n_samples // HOP_LENGTH frames in all. The signal must be longer than N_FFT // 2 samples.
    """
    pad = N_FFT // 2
    buffer: torch.Tensor | None = None
    tail = torch.zeros(0, device=device)  # the last pad + 1 samples seen, for the right edge
    total = emitted = 0

    def frames(buf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        n = (len(buf) - N_FFT) // HOP_LENGTH + 1 if len(buf) >= N_FFT else 0
        if n == 0:
            return buf.new_zeros(n_mels, 0), buf
        return _log10_mel(buf[: (n - 1) * HOP_LENGTH + N_FFT], n_mels), buf[n * HOP_LENGTH :]

    started = False
    for block in blocks:
        x = torch.as_tensor(block, dtype=torch.float32, device=device)
        total += len(x)
        tail = torch.cat([tail, x])[-(pad + 1) :]
        buffer = x if buffer is None else torch.cat([buffer, x])
        if not started:
            if len(buffer) <= pad:
                continue
            buffer = torch.cat([buffer[1 : pad + 1].flip(0), buffer])  # reflect the left edge
            started = True
        out, buffer = frames(buffer)
        if out.shape[1]:
            out = out[:, : total // HOP_LENGTH - emitted]
            emitted += out.shape[1]
            yield out
    if not started:
        raise ValueError(f"{total} samples are too few for a centred STFT (need > {pad})")
    out, _ = frames(torch.cat([buffer, tail[:-1].flip(0)]))  # reflect the right edge
    out = out[:, : total // HOP_LENGTH - emitted]
    if out.shape[1]:
        yield out
