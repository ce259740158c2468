"""Who spoke when through a pyannote.audio pipeline the operator has (`EngineConfig.diarization =
"pyannote:/dir"`): a directory holding a pipeline's `config.yaml` and the checkpoints it names
(pyannote's `speaker-diarization-community-1`, downloaded once with its weights, or any
pipeline saved with them). No hub: the directory is read as it is.

pyannote.audio is not a dependency of the project (it pins torchaudio and pulls Lightning):
install it beside the engine where this backend is used. The pipeline diarizes one recording
at a time, holding its samples (an hour: 230 MB).
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import torch

from engine.diarize import Recording, Turn
from engine.speakers import SAMPLE_RATE


@cache
def load(directory: str, device: str = "cpu") -> PyannoteDiarizer:
    return PyannoteDiarizer(directory, device)


class DiarizationSetupError(RuntimeError):
    """A diarization backend that cannot run as configured; the message says what to change."""


class PyannoteDiarizer:
    """Speaker turns from a pyannote pipeline in a local directory."""

    def __init__(self, directory: str, device: str = "cpu"):
        path, name = Path(directory), f"diarization pyannote:{directory}"
        if not path.is_dir():
            raise DiarizationSetupError(f"{name}: no such directory")
        if not (path / "config.yaml").is_file():
            raise DiarizationSetupError(
                f"{name} is not a pyannote pipeline: it has no config.yaml (a pipeline "
                "directory holds its config.yaml and the checkpoints it names)"
            )
        try:
            from pyannote.audio import Pipeline
        except ImportError:
            raise DiarizationSetupError(
                f"{name}: pyannote.audio is not installed (pip install pyannote.audio)"
            ) from None
        try:
            pipeline = Pipeline.from_pretrained(path)
        except Exception as e:  # whatever the pipeline's own code raises, said in words
            raise DiarizationSetupError(
                f"{name} could not be loaded as a pyannote pipeline: {type(e).__name__}: {e}"
            ) from e
        if pipeline is None:
            raise DiarizationSetupError(f"{name} could not be loaded as a pyannote pipeline")
        self.pipeline = pipeline.to(torch.device(device))

    def __call__(self, recordings: list[Recording]) -> list[list[Turn]]:
        return [self.turns(r) for r in recordings]

    def turns(self, recording: Recording) -> list[Turn]:
        if not recording.regions:  # no speech: no turns, as the built-in pipeline
            return []
        samples = np.concatenate(list(recording.blocks))
        count = recording.count
        output = self.pipeline(
            {"waveform": torch.from_numpy(samples)[None], "sample_rate": SAMPLE_RATE},
            num_speakers=count.speakers,
            min_speakers=count.min_speakers if count.speakers is None else None,
            max_speakers=count.max_speakers if count.speakers is None else None,
        )
        # pyannote.audio 4 answers with both; the one without overlaps suits words best
        annotation = getattr(output, "exclusive_speaker_diarization", None) or getattr(
            output, "speaker_diarization", output
        )
        labels: dict[str, int] = {}
        out: list[Turn] = []
        for segment, _, label in sorted(annotation.itertracks(yield_label=True)):
            # turns in order without overlap, as `engine.diarize.speaker_at` takes them
            start = max(segment.start, out[-1].end if out else 0.0)
            if segment.end > start:
                out.append(Turn(start, segment.end, labels.setdefault(label, len(labels))))
        return out
