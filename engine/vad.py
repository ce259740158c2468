"""Voice activity: Silero VAD (v6, 16 kHz) on the weights its wheel ships, as plain torch.

Silero's own runtime reads 32 ms chunks one at a time, each through its convolutions and an
LSTM cell, from Python. The convolutions see only their chunk (and the 4 ms before it), so here
they run over a whole block of chunks at once and the LSTM over the block's sequence in one
call: the same probabilities (tests/engine/test_vad.py, against the wheel's TorchScript model),
at the cost of a few large kernels a block on any device. `Detector` is fed blocks of samples
as a long input is decoded, carrying the context and the LSTM's state across them.

`speech_regions` turns the probabilities into speech as Silero's `get_speech_timestamps` does:
a threshold to enter speech and a lower one to leave it, short pauses bridged, short bursts
dropped, each region padded a little.
"""

from __future__ import annotations

import warnings
from bisect import bisect_right
from dataclasses import dataclass
from functools import cache
from importlib import resources
from operator import itemgetter

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

SAMPLE_RATE = 16000
CHUNK = 512  # samples a probability (32 ms)
CONTEXT = 64  # samples of the chunk before that the model sees with each chunk
BLOCK_CHUNKS = 4096  # chunks a front-end pass at most (131 s: about 50 MB of activations)


class SileroVAD(nn.Module):
    """Silero VAD v6's 16 kHz network: a learned STFT, four convolutions, an LSTM, a
    probability per chunk."""

    def __init__(self) -> None:
        super().__init__()
        self.stft_conv = nn.Conv1d(1, 258, kernel_size=256, stride=128, bias=False)
        self.conv1 = nn.Conv1d(129, 128, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(128, 64, kernel_size=3, stride=2, padding=1)
        self.conv3 = nn.Conv1d(64, 64, kernel_size=3, stride=2, padding=1)
        self.conv4 = nn.Conv1d(64, 128, kernel_size=3, padding=1)
        self.lstm = nn.LSTM(128, 128)
        self.final_conv = nn.Conv1d(128, 1, kernel_size=1)

    def features(self, frames: Tensor) -> Tensor:
        """(n, CONTEXT + CHUNK) samples -> (n, 128): what the LSTM reads of each chunk."""
        x = F.pad(frames[:, None], (0, CONTEXT), mode="reflect")
        x = self.stft_conv(x)
        x = (x[:, :129] ** 2 + x[:, 129:] ** 2).sqrt()
        for conv in (self.conv1, self.conv2, self.conv3, self.conv4):
            x = F.relu(conv(x))
        return x[:, :, 0]

    def forward(
        self, frames: Tensor, state: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """(n, CONTEXT + CHUNK) consecutive chunks of one input -> (n,) speech probabilities
        and the LSTM's state after them."""
        out, state = self.lstm(self.features(frames)[:, None], state)
        p = torch.sigmoid(self.final_conv(F.relu(out).permute(1, 2, 0)))
        return p[0, 0], state


# the wheel's TorchScript model (its default, `load_silero_vad()`) names its parts so
_NAMES = {
    "stft.forward_basis_buffer": "stft_conv.weight",
    "encoder.0.reparam_conv": "conv1",
    "encoder.1.reparam_conv": "conv2",
    "encoder.2.reparam_conv": "conv3",
    "encoder.3.reparam_conv": "conv4",
    "decoder.rnn.weight_ih": "lstm.weight_ih_l0",
    "decoder.rnn.weight_hh": "lstm.weight_hh_l0",
    "decoder.rnn.bias_ih": "lstm.bias_ih_l0",
    "decoder.rnn.bias_hh": "lstm.bias_hh_l0",
    "decoder.decoder.2": "final_conv",
}


@cache
def load(device: str = "cpu") -> SileroVAD:
    """The network with the weights of the `silero-vad` wheel's default model (MIT), on
    `device`. (The wheel's safetensors file holds other weights than its TorchScript model,
    which its own functions load.)"""
    path = resources.files("silero_vad.data").joinpath("silero_vad.jit")
    # TorchScript is the one form of these weights the wheel ships that torch reads; torch
    # deprecates reading it (torch.export's), which is the wheel's to change, not ours
    with resources.as_file(path) as file, warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`torch.jit.load` is deprecated", DeprecationWarning)
        scripted = torch.jit.load(str(file), map_location="cpu")
    weights = {}
    for name, tensor in scripted._model.state_dict().items():
        for theirs, ours in _NAMES.items():
            name = name.replace(theirs, ours)
        weights[name] = tensor
    model = SileroVAD()
    model.load_state_dict(weights)
    model = model.eval().to(device)
    if model.lstm.weight_hh_l0.is_cuda:  # shared by every thread's stream: whole before
        torch.cuda.current_stream(device).synchronize()  # another reads it (own_stream)
    return model


class Detector:
    """Speech probabilities of one input, fed its 16 kHz samples block by block (arrays, or
    tensors already on its device: a first pass sends each block there once, for its log-mel
    and for this)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.model = load(str(device))
        self.device = device
        self._tail = torch.zeros(CONTEXT, device=device)  # the samples before the next chunk
        self._rest = torch.zeros(0, device=device)  # samples not yet a whole chunk
        self._state: tuple[Tensor, Tensor] | None = None
        self._probs: list[Tensor] = []
        self.n_samples = 0

    @torch.inference_mode()
    def feed(self, samples: np.ndarray | Tensor) -> None:
        samples = torch.as_tensor(samples, dtype=torch.float32, device=self.device)
        self.n_samples += len(samples)
        samples = torch.cat([self._rest, samples]) if len(self._rest) else samples
        whole = len(samples) // CHUNK * CHUNK
        self._rest = samples[whole:].clone()
        for start in range(0, whole, BLOCK_CHUNKS * CHUNK):
            self._run(samples[start : min(whole, start + BLOCK_CHUNKS * CHUNK)])

    def _run(self, block: Tensor) -> None:
        x = torch.cat([self._tail, block])
        frames = x.unfold(0, CONTEXT + CHUNK, CHUNK)
        probs, self._state = self.model(frames, self._state)
        self._probs.append(probs)
        self._tail = x[-CONTEXT:]

    @torch.inference_mode()
    def finish(self) -> np.ndarray:
        """Every chunk's speech probability (the last chunk zero-padded), in order."""
        if len(self._rest):
            self._run(F.pad(self._rest, (0, CHUNK - len(self._rest))))
            self._rest = self._rest[:0]
        if not self._probs:
            return np.zeros(0, np.float32)
        return torch.cat(self._probs).float().cpu().numpy()


@torch.inference_mode()
def clip_probabilities(
    clips: list[np.ndarray], device: torch.device | str = "cpu"
) -> list[np.ndarray]:
    """`speech_probabilities` of several clips in one pass: all their chunks through the front
    end at once, the LSTM over the clips as one batch. A shorter clip is zero-padded at its end,
    which changes none of its probabilities (the LSTM reads forward)."""
    counts = [-(-len(x) // CHUNK) for x in clips]
    if not clips or not max(counts):
        return [np.zeros(0, np.float32) for _ in clips]
    x = np.zeros((len(clips), CONTEXT + max(counts) * CHUNK), np.float32)
    for row, clip in zip(x, clips, strict=True):
        row[CONTEXT : CONTEXT + len(clip)] = clip
    frames = torch.from_numpy(x).to(device).unfold(1, CONTEXT + CHUNK, CHUNK)
    model = load(str(device))
    features = model.features(frames.flatten(0, 1)).unflatten(0, frames.shape[:2])
    out, _ = model.lstm(features.transpose(0, 1))  # (chunks, clips, 128)
    probs = torch.sigmoid(model.final_conv(F.relu(out).permute(1, 2, 0)))[:, 0]
    host = probs.float().cpu().numpy()
    return [p[:n] for p, n in zip(host, counts, strict=True)]


def speech_probabilities(samples: np.ndarray, device: torch.device | str = "cpu") -> np.ndarray:
    detector = Detector(device)
    detector.feed(samples)
    return detector.finish()


@dataclass(frozen=True)
class VadOptions:
    """Silero's defaults (`get_speech_timestamps`)."""

    threshold: float = 0.5  # a chunk at least this likely starts speech
    neg_threshold: float | None = None  # below this speech ends; None: threshold - 0.15
    min_speech_s: float = 0.25  # shorter bursts are dropped
    min_silence_s: float = 0.1  # shorter pauses do not end speech
    pad_s: float = 0.03  # each region widened by this on both sides


def speech_regions(
    probs: np.ndarray, duration: float, options: VadOptions = VadOptions()
) -> list[tuple[float, float]]:
    """(start s, end s) of each stretch of speech, in order, inside [0, duration]."""
    kept = [r for r in stretches(probs, duration, options) if r[1] - r[0] > options.min_speech_s]
    out: list[tuple[float, float]] = []
    for begin, end in kept:
        begin, end = max(0.0, begin - options.pad_s), min(duration, end + options.pad_s)
        if out and begin <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((begin, end))
    return out


def stretches(probs: np.ndarray, duration: float, options: VadOptions) -> list[list[float]]:
    """[start s, end s] of speech as Silero's loop finds it, before short bursts are dropped and
    the rest padded. That loop goes chunk by chunk, but only chunks above the threshold (speech
    goes on or starts) or below the lower one (silence goes on or starts) change anything: this
    goes run by run of those, in order (an hour is 112,500 chunks, read by a job thread that
    holds the GIL)."""
    chunk_s = CHUNK / SAMPLE_RATE
    neg = options.neg_threshold
    if neg is None:
        neg = max(options.threshold - 0.15, 0.01)
    probs = np.asarray(probs)
    high = probs >= options.threshold
    chunks = np.flatnonzero(high | (probs < neg))
    loud = high[chunks]
    starts_run = np.ones(len(loud), bool)
    starts_run[1:] = loud[1:] != loud[:-1]
    runs = np.flatnonzero(starts_run)
    lasts = (np.append(runs[1:], len(chunks)) - 1)[: len(runs)]
    firsts, lasts = chunks[runs].tolist(), chunks[lasts].tolist()
    out: list[list[float]] = []
    start = None
    for first, last, speech in zip(firsts, lasts, loud[runs].tolist(), strict=True):
        t = first * chunk_s
        if speech:
            if start is None:
                start = t
        elif start is not None and last * chunk_s - t >= options.min_silence_s:
            out.append([start, t])  # quiet from its first chunk long enough: speech ended
            start = None
    if start is not None:
        out.append([start, duration])
    return out


def regions_of(
    samples: np.ndarray, device: torch.device | str = "cpu"
) -> list[tuple[float, float]]:
    """Speech in 16 kHz samples, as (start s, end s) stretches."""
    return speech_regions(speech_probabilities(samples, device), len(samples) / SAMPLE_RATE)


def voiced_seconds(regions: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of speech in [start, end); regions in order and apart, as `speech_regions`
    gives them (found by bisection: a long input's segments each ask)."""
    total = 0.0
    for k in range(bisect_right(regions, start, key=itemgetter(1)), len(regions)):
        s, e = regions[k]
        if s >= end:
            break
        total += max(0.0, min(e, end) - max(s, start))  # none of an interval backwards
    return total
