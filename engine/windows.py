"""The stream of models that decode 30 s windows independently: transformers' (engine.hf) and
the engine's native Qwen3-ASR (engine.qwen3_asr), behind the native stream's interface
(`submit`, `step`, `abort`, `transcribe`; engine.stream), so the worker's batcher, the job
contract and the results are the same whichever runs a model.

Audio is cut into windows of at most 30 s. Each `step` hands the model the windows it has
room for, urgent inputs' first, and back come the windows it finished: all of them for a model
that decodes a batch to its end (transformers'), those that ended in this step's decode steps
for one that batches continuously. An input whose last window is back is handed back. A window
is one segment, timed by its place in the audio; what the model cannot tell is null (a
segment's log-probability, compression ratio, no-speech probability; a CTC model's language).
Options a model cannot honour are refused before any work (its `check`).
"""

from __future__ import annotations

import bisect
import itertools
import operator
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import numpy as np
import torch

from engine import heap
from engine.config import EngineConfig, Input
from engine.host import LongAudio, SpectrogramError, read_input
from engine.mel import SAMPLE_RATE
from engine.options import TranscriptionOptions
from engine.result import Segment, Transcription
from engine.stream import Finished, Progress, Streaming, StreamStats

WINDOW = 30 * SAMPLE_RATE  # samples a window at most

Decoded = tuple[list[int], str, str | None]  # a window's text tokens, text and language
Request = tuple[Hashable, np.ndarray, TranscriptionOptions]  # a window to decode, by key


class WindowModel(ABC):
    """What a model that decodes windows gives the stream."""

    config: EngineConfig
    name: str
    english_only: bool
    model: torch.nn.Module
    n_slots: int  # windows at once

    @property
    def encoder_batch(self) -> int:
        return self.n_slots

    @property
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    @abstractmethod
    def check(self, options: TranscriptionOptions) -> TranscriptionOptions:
        """Refuse, before any work, what the model cannot do as asked."""

    @abstractmethod
    def room(self) -> int:
        """Windows it can start now."""

    @abstractmethod
    def run(self, windows: list[Request]) -> list[tuple[Hashable, Decoded]]:
        """Start these windows (at most `room()`; maybe none) and decode; the windows that
        finished, by key."""

    @abstractmethod
    def drop(self, keys: set[Hashable]) -> None:
        """Forget these windows, started or not (their input was aborted)."""

    @abstractmethod
    def reset(self) -> None:
        """Forget every window."""

    def capture(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Capture the CUDA graphs the model replays, on an idle model; how many."""
        return 0

    @abstractmethod
    def shrink(self) -> bool:
        """Halve the windows at once (after running out of device memory); False at one."""


@dataclass(eq=False)
class _Input:
    owner: Hashable
    samples: np.ndarray
    options: TranscriptionOptions
    progress: Progress | None
    order: tuple[bool, int]
    decoded: dict[int, Decoded] = field(default_factory=dict)

    @property
    def n_windows(self) -> int:
        return max(1, -(-len(self.samples) // WINDOW))


_ORDER = operator.itemgetter(0)


class WindowStream(Streaming):
    """The native stream's interface over a model that decodes windows (engine.stream.Stream)."""

    def __init__(self, engine: WindowModel):
        self.engine = engine
        self.stats = StreamStats()
        self._inputs: dict[Hashable, _Input] = {}
        self._arrivals = itertools.count()
        self._queue: list[tuple[tuple[bool, int, int], _Input, int]] = []  # windows to start

    def prepare(self, item: Input, options: TranscriptionOptions | None = None) -> np.ndarray:
        """An input's 16 kHz samples; raises AudioError, or SpectrogramError for a spectrogram
        (a model's own features are made from audio here). The options change nothing: these
        models decode whole windows, without voice activity."""
        host = read_input(item, self.engine.config.max_audio_s)
        if isinstance(host, LongAudio):
            host = host.audio.decode()
        if host.ndim != 1:
            raise SpectrogramError(f"{self.engine.name} makes its own features: send audio")
        return host

    def check(self, options: TranscriptionOptions) -> TranscriptionOptions:
        return self.engine.check(options)

    def submit(
        self,
        owner: Hashable,
        item: np.ndarray,
        options: TranscriptionOptions | None = None,
        *,
        urgent: bool = False,
        progress: Progress | None = None,
    ) -> None:
        if owner in self._inputs:
            raise ValueError(f"{owner!r} is already in the stream")
        options = self.check(options or TranscriptionOptions())
        entry = _Input(owner, item, options, progress, (not urgent, next(self._arrivals)))
        self._inputs[owner] = entry
        for i in range(entry.n_windows):
            bisect.insort(self._queue, ((*entry.order, i), entry, i), key=_ORDER)

    def abort(self, owner: Hashable) -> bool:
        entry = self._inputs.pop(owner, None)
        if entry is None:
            return False
        self._queue = [q for q in self._queue if q[1] is not entry]
        self.engine.drop({(entry, i) for i in range(entry.n_windows)})
        return True

    def reset(self) -> None:
        self._inputs.clear()
        self._queue.clear()
        self.engine.reset()

    def shrink(self) -> bool:
        self.reset()
        return self.engine.shrink()

    def warm(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Run a second of silence through the model (its first call's costs), then capture
        the graphs the model has (progress: graphs done, in all), and freeze the objects
        alive then (`engine.heap`); returns how many graphs."""
        self.transcribe([np.zeros(SAMPLE_RATE, np.float32)])
        self.stats = StreamStats()
        captured = self.engine.capture(progress)
        heap.settle()
        return captured

    def warm_next(self) -> bool:
        return False  # no graphs

    def step(self) -> list[Finished]:
        """Start the windows the model has room for (one task at a time: a multilingual
        Whisper model translates or transcribes a whole batch), decode, and hand back the
        inputs whose last window finished."""
        start = time.perf_counter()
        batch = []
        if self._queue:
            first = self._queue[0][1].options.task
            batch = [q for q in self._queue if q[1].options.task == first]
            batch = batch[: self.engine.room()]
        taken = {id(q) for q in batch}
        self._queue = [q for q in self._queue if id(q) not in taken]
        requests = [
            ((e, i), e.samples[i * WINDOW : (i + 1) * WINDOW], e.options) for _, e, i in batch
        ]
        finished = []
        for (entry, i), result in self.engine.run(requests):
            entry.decoded[i] = result
            if entry.progress:
                done = min(len(entry.decoded) * WINDOW, len(entry.samples)) / SAMPLE_RATE
                entry.progress(done, len(entry.samples) / SAMPLE_RATE)
            if len(entry.decoded) == entry.n_windows and self._inputs.pop(entry.owner, None):
                finished.append(Finished(entry.owner, self._result(entry)))
        self.stats += StreamStats(decode_s=time.perf_counter() - start, windows=len(batch))
        return finished

    def _result(self, entry: _Input) -> Transcription:
        duration = len(entry.samples) / SAMPLE_RATE
        segments = []
        for i in range(entry.n_windows):
            tokens, text, _ = entry.decoded[i]
            if not text.strip():
                continue
            start, end = i * WINDOW / SAMPLE_RATE, min((i + 1) * WINDOW / SAMPLE_RATE, duration)
            segments.append(
                Segment(len(segments), start, round(end, 3), text, tokens, None, None, None, 0.0)
            )
        language = entry.options.language or entry.decoded[0][2]
        return Transcription(
            text=" ".join(s.text.strip() for s in segments),
            language=language or ("en" if self.engine.english_only else None),
            language_probability=None,
            duration=round(duration, 3),
            segments=segments,
            model=self.engine.name,
            options=dict(entry.options.__dict__),
        )
