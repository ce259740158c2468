"""How a model runs (`EngineConfig`, the front door's one argument) and what it takes
(`Input`): down-hill of both backends, the native engine's (`engine.engine`) and
transformers' (`engine.hf`), which each read it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, get_args

import numpy as np
import torch

from engine.audio import Audio
from engine.decoding import DecodingRules
from engine.host import MAX_AUDIO_S
from engine.kernels import triton_installed

Dtype = Literal["auto", "fp32", "fp16", "bf16"]
CrossKV = Literal["model", "fp8"]
Encoder = Literal["model", "fp8"]
Kernels = Literal["auto", "triton", "torch"]

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
CROSS_DTYPES = {"model": None, "fp8": torch.float8_e4m3fn}

# bytes (an audio file or a .npy spectrogram), decoded 16 kHz samples (1-D), or a
# spectrogram array (2-D or 3-D)
Input = bytes | np.ndarray | Audio


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass(frozen=True)
class EngineConfig:
    """How a model runs: the front door's one argument."""

    # a packaged name (tiny.en, base), a Hugging Face or CTranslate2 directory, a hub id, or
    # random:<size> (Whisper's shapes with random weights, for speed work; engine.loader);
    # a transformers Qwen3-ASR directory (engine.qwen3_asr), or hf:/dir: a transformers speech
    # model the native engine does not run (engine.hf); both with `name`, `device`, `dtype`,
    # `slots` (windows at once), `slot_memory_bytes` (Qwen3-ASR) and `max_audio_s` as here
    model: str = "tiny.en"
    name: str | None = None  # what results call the model (default: `model`)
    device: str = "auto"  # auto: CUDA if present; or cpu, cuda, cuda:1, ...
    dtype: Dtype = "auto"  # auto: fp16 on CUDA, fp32 elsewhere
    # converted weights, and compiled kernels in triton/ unless TRITON_CACHE_DIR says
    # otherwise (default: ~/.cache/whisperfleet): a restart finds both there
    cache_dir: Path | None = None

    # The pool of decoding slots (windows decoded at once): `slots` of them, else as many as
    # `slot_memory_bytes` of cache holds (default: half the free GPU memory; 16 on the CPU),
    # at most 512. The encoder takes up to `encoder_batch` new windows at once.
    slots: int | None = None
    slot_memory_bytes: int | None = None
    encoder_batch: int = 16
    # cross-attention K/V in the weights' dtype, or in fp8 (half the bytes; CUDA, compute
    # capability 8.9+)
    cross_kv: CrossKV = "model"
    # the encoder's products in the weights' dtype, or in fp8 (e4m3; a scale per weight row
    # and per input row: engine.quantize; CUDA compute capability 8.9+, or the CPU, which
    # rounds alike in fp32 arithmetic). Experimental, for `whisperfleet bench` and accuracy
    # work: 1.24x the engine's large-v3-turbo on an H100, but outside the accuracy rule on
    # base (docs/accuracy.md, docs/benchmarks.md), so not a worker setting
    encoder: Encoder = "model"

    # graphs: capture CUDA graphs (default: on CUDA); False runs the same steps eagerly.
    # kernels: the decode step's Triton kernels on CUDA where Triton is installed (auto), always
    # (triton: refused where they cannot run), or never (torch: the reference path)
    graphs: bool | None = None
    kernels: Kernels = "auto"

    # the longest input in seconds, audio or spectrogram (100 frames a second): longer ones
    # are refused (InputTooLong) before their work, audio as soon as decoding passes it
    max_audio_s: float = MAX_AUDIO_S
    rules: DecodingRules = field(default_factory=DecodingRules)
    # who spoke when, for inputs that ask (option diarize): "builtin" (engine.diarize) or
    # "pyannote:/dir", a pyannote.audio pipeline in a local directory (engine.pyannote)
    diarization: str = "builtin"

    def __post_init__(self) -> None:
        for name, allowed in (
            ("dtype", Dtype),
            ("cross_kv", CrossKV),
            ("encoder", Encoder),
            ("kernels", Kernels),
        ):
            if getattr(self, name) not in get_args(allowed):
                expected = ", ".join(get_args(allowed))
                raise ValueError(f"{name} {getattr(self, name)!r}: expected one of {expected}")
        if not self.max_audio_s > 0:
            raise ValueError(f"max_audio_s {self.max_audio_s!r}: expected seconds above 0")

    def placement(self) -> tuple[torch.device, torch.dtype]:
        """The device asked for (auto: CUDA if present) and the weights' dtype there (auto:
        fp16 on CUDA, fp32 elsewhere), for the engines that load their own weights."""
        device = default_device() if self.device == "auto" else torch.device(self.device)
        cuda = device.type == "cuda"
        return device, DTYPES.get(self.dtype) or (torch.float16 if cuda else torch.float32)

    def speedups(self, device: torch.device) -> tuple[bool, bool]:
        """(the Triton kernels, CUDA graphs) on `device`, as `kernels` and `graphs` ask:
        refused where they cannot run."""
        cuda = device.type == "cuda"
        graphs = cuda if self.graphs is None else self.graphs
        if graphs and not cuda:
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        triton = self.kernels != "torch" and cuda and triton_installed()
        if self.kernels == "triton" and not triton:
            raise ValueError("kernels='triton' needs a CUDA device and Triton installed")
        return triton, graphs
