"""The models one worker process serves, each loaded on first use and then kept."""

from __future__ import annotations

import threading

from engine.decoding import DecodingOptions
from engine.result import Transcription
from engine.transcribe import Transcriber
from worker.jobs import JobOptions
from worker.settings import Settings


class UnknownModel(ValueError):
    pass


class Engines:
    def __init__(self, settings: Settings):
        self.settings = settings
        self._loaded: dict[str, Transcriber] = {}
        self._load_lock = threading.Lock()
        # One transcription at a time per process: the engine keeps the device busy itself.
        self._run_lock = threading.Lock()

    def get(self, name: str) -> Transcriber:
        models = self.settings.models
        if name not in models:
            raise UnknownModel(f"unknown model {name!r}; available: {', '.join(models)}")
        with self._load_lock:
            if name not in self._loaded:
                device = None if self.settings.device == "auto" else self.settings.device
                self._loaded[name] = Transcriber.load(
                    models[name], device=device, cache_dir=self.settings.cache_dir, name=name
                )
            return self._loaded[name]

    def transcribe(self, name: str, audio: bytes, options: JobOptions) -> Transcription:
        transcriber = self.get(name)
        with self._run_lock:
            return transcriber.transcribe(
                audio, DecodingOptions(task=options.task, language=options.language)
            )
