"""The models one worker process serves: each loaded on first use with a batcher that runs
it, kept while the memory budget allows, the least recently used dropped first."""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout

import torch

from engine.loader import load_model
from engine.longform import TranscriptionOptions
from engine.result import Transcription
from engine.transcribe import Transcriber, slots_for
from worker.batching import Batcher, EngineFailed, Ticket
from worker.contract.jobs import JobOptions
from worker.contract.settings import Settings

log = logging.getLogger(__name__)


class UnknownModel(ValueError):
    pass


def _model_bytes(t: Transcriber) -> int:
    return sum(p.numel() * p.element_size() for p in t.loaded.model.parameters())


class Engines:
    """Each model's transcriber and the batcher that runs it, shared by the job threads."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self._loaded: OrderedDict[str, Batcher] = OrderedDict()
        self._lock = threading.Lock()  # loading and dropping models

    def _get(self, name: str) -> Batcher:
        models = self.settings.models
        if name not in models:
            raise UnknownModel(f"unknown model {name!r}; available: {', '.join(models)}")
        if name in self._loaded:
            self._loaded.move_to_end(name)
            return self._loaded[name]
        device = None if self.settings.device == "auto" else self.settings.device
        loaded = load_model(
            models[name], device=device, cache_dir=self.settings.cache_dir, name=name
        )
        cross = torch.float8_e4m3fn if self.settings.cross_kv == "fp8" else None
        slots = slots_for(loaded, self.settings.slot_memory_bytes, cross)
        transcriber = Transcriber(loaded, slots, cross_dtype=cross)
        transcriber.max_spectrogram_frames = self.settings.max_spectrogram_frames
        budget, size = self.settings.model_memory_bytes, _model_bytes(transcriber)
        while self._loaded and size + sum(map(_model_bytes, self._transcribers())) > budget:
            dropped, batcher = self._loaded.popitem(last=False)
            batcher.close()  # after the inputs it holds are done
            log.info("dropped model %s to keep within %d bytes", dropped, budget)
        batch = self.settings.batch_size or transcriber.encoder_batch
        self._loaded[name] = Batcher(transcriber, batch, self.settings.batch_max_wait_ms / 1000)
        return self._loaded[name]

    def _transcribers(self) -> list[Transcriber]:
        return [b.transcriber for b in self._loaded.values()]

    def get(self, name: str) -> Transcriber:
        with self._lock:
            return self._get(name).transcriber

    def healthy(self, stall_s: float = 60.0) -> bool:
        """Whether every model's batcher has turned its loop within `stall_s`."""
        now = time.monotonic()
        return all(now - b.last_tick < stall_s for b in list(self._loaded.values()))

    @property
    def loaded(self) -> list[str]:
        return list(self._loaded)

    def transcribe(
        self,
        name: str,
        data: bytes,
        options: JobOptions,
        urgent: bool = True,
        on_wait: Callable[[Ticket], None] | None = None,
        wait_s: float = 2.0,
    ) -> Transcription:
        """Decode `data` on this thread, transcribe it among the other jobs' inputs, and call
        `on_wait` every `wait_s` seconds meanwhile (to record progress)."""
        with self._lock:
            batcher = self._get(name)
        t = batcher.transcriber
        engine_options = TranscriptionOptions(
            task=options.task,
            language=options.language,
            mode=options.mode,
            initial_prompt=options.prompt,
        ).verified(t.loaded.tokenizer)
        while True:
            ticket = batcher.submit(t.prepare(data), engine_options, urgent)
            try:
                while True:
                    try:
                        return ticket.future.result(timeout=wait_s)
                    except FutureTimeout:
                        if on_wait:
                            on_wait(ticket)
            except EngineFailed as e:
                # out of memory: the pool was halved, so run it again (at one slot, it fails)
                if not (e.retry and isinstance(e.__cause__, torch.OutOfMemoryError)):
                    raise
