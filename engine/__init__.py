"""whisperfleet's Whisper engine: it knows nothing of queues, HTTP or S3.

The front door is `Engine.open(EngineConfig(...))`, which returns the `Stream` that runs a
model: `submit` inputs, `step` while `busy`, `abort` one; or `transcribe` a list at once.
"""

from engine.audio import AudioError, InputTooLong
from engine.decoding import DecodingRules
from engine.engine import Engine, EngineConfig
from engine.inputs import SpectrogramError
from engine.options import OptionsError, TranscriptionOptions
from engine.result import Segment, Transcription
from engine.stream import Finished, Stream, StreamStats

__all__ = [
    "AudioError",
    "DecodingRules",
    "Engine",
    "EngineConfig",
    "Finished",
    "InputTooLong",
    "OptionsError",
    "Segment",
    "SpectrogramError",
    "Stream",
    "StreamStats",
    "Transcription",
    "TranscriptionOptions",
]
