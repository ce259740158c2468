"""The models one worker process serves: each loaded on first use, kept while the memory
budget allows, the least recently used dropped first."""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

import torch

from engine.loader import load_model
from engine.longform import TranscriptionOptions
from engine.result import Transcription
from engine.transcribe import Progress, Transcriber, slots_for
from worker.jobs import JobOptions
from worker.settings import Settings

log = logging.getLogger(__name__)


class UnknownModel(ValueError):
    pass


def _model_bytes(t: Transcriber) -> int:
    return sum(p.numel() * p.element_size() for p in t.loaded.model.parameters())


class Engines:
    def __init__(self, settings: Settings):
        self.settings = settings
        self._loaded: OrderedDict[str, Transcriber] = OrderedDict()
        # One transcription at a time per process: the engine keeps the device busy itself,
        # and a model is never dropped while it runs.
        self._lock = threading.Lock()

    def _get(self, name: str) -> Transcriber:
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
        while self._loaded and size + sum(map(_model_bytes, self._loaded.values())) > budget:
            dropped, _ = self._loaded.popitem(last=False)
            log.info("dropped model %s to keep within %d bytes", dropped, budget)
        self._loaded[name] = transcriber
        return transcriber

    def get(self, name: str) -> Transcriber:
        with self._lock:
            return self._get(name)

    @property
    def loaded(self) -> list[str]:
        return list(self._loaded)

    def transcribe(
        self, name: str, data: bytes, options: JobOptions, progress: Progress | None = None
    ) -> Transcription:
        engine_options = TranscriptionOptions(
            task=options.task,
            language=options.language,
            mode=options.mode,
            initial_prompt=options.prompt,
        )
        with self._lock:
            transcriber = self._get(name)
            while True:
                try:
                    return transcriber.transcribe(data, engine_options, progress)
                except torch.OutOfMemoryError:
                    # another process took the memory the pool was sized from: decode fewer
                    # windows at once rather than fail the job (at one slot, it fails)
                    if transcriber.n_slots == 1:
                        raise
                    transcriber.shrink()
                    log.warning(
                        "out of GPU memory: %s now decodes %d windows at once",
                        name,
                        transcriber.n_slots,
                    )
