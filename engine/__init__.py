"""whisperfleet's Whisper engine: it knows nothing of queues, HTTP or S3.

The front door is `Engine.open(EngineConfig(...))`, which returns the `Stream` that runs a
model: `submit` inputs, `step` while `busy`, `abort` one; or `transcribe` a list at once.

Each name is imported on first use: a worker's job process takes the input errors and options
from here, and reads inputs with `engine.host`, without importing torch.
"""

from __future__ import annotations

import importlib

_HOMES = {
    "AudioError": "engine.audio",
    "InputTooLong": "engine.audio",
    "DecodingRules": "engine.decoding",
    "Engine": "engine.engine",
    "EngineConfig": "engine.config",
    "SpectrogramError": "engine.host",
    "OptionsError": "engine.options",
    "TranscriptionOptions": "engine.options",
    "Segment": "engine.result",
    "Transcription": "engine.result",
    "Finished": "engine.stream",
    "Stream": "engine.stream",
    "StreamStats": "engine.stream",
}

__all__ = list(_HOMES)


def __getattr__(name: str):
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = globals()[name] = getattr(importlib.import_module(home), name)
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOMES])
