"""Speech models the native engine does not implement, run through transformers.

A model named `hf:/local/dir` (a transformers directory with its processor; hub ids stay out)
is served by `TransformersStream`, which has the native stream's interface (`submit`, `step`,
`abort`, `transcribe`; engine.stream), so the worker's batcher, the job contract and the
results are the same whichever runs a model:

- a speech sequence-to-sequence model (`AutoModelForSpeechSeq2Seq`: Whisper, Speech2Text,
  Moonshine, ...) decodes greedily with its own `generate`;
- a CTC model (`AutoModelForCTC`: wav2vec2, HuBERT, WavLM, ...) takes the most likely token
  of each frame;
- an audio language model whose processor builds a transcription request (transformers'
  `apply_transcription_request`: Qwen3-ASR, Voxtral, ...) generates greedily after that
  prompt; a prompt given to the job becomes the request's context, a language its forced
  language, and Qwen3-ASR's `language X<asr_text>` answer is parsed as its processor does.

Audio is cut into windows of at most 30 s, decoded independently; each `step` runs one batch
of windows, urgent inputs' first, and hands back the inputs whose last window it decoded.
A window is one segment, timed by its place in the audio; what the model cannot tell is null
(a segment's log-probability, compression ratio, no-speech probability; a CTC model's
language). Options it cannot honour are refused before any work (`check`).
"""

from __future__ import annotations

import bisect
import importlib
import itertools
import operator
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine.config import DTYPES, EngineConfig, Input
from engine.host import LongAudio, SpectrogramError, read_input
from engine.mel import SAMPLE_RATE
from engine.options import OptionsError, TranscriptionOptions
from engine.result import Segment, Transcription
from engine.stream import Finished, Progress, Streaming, StreamStats

PREFIX = "hf:"
WINDOW = 30 * SAMPLE_RATE  # samples a window at most
BATCH = 16  # windows a step at most (halved after running out of device memory)
MAX_NEW_TOKENS = 448  # a chat model's answer for one window at most (Whisper's own bound)


def is_transformers(model: str) -> bool:
    """Whether a model source names the transformers backend (`hf:/dir`)."""
    return model.startswith(PREFIX)


def quiet_transformers() -> None:
    """transformers' noise left out of a worker's log and a tool's table: its progress bar
    for loading weights, and its warnings about its own internals (Whisper's `generate` passes
    `generation_config` with the suppressed tokens beside it, which its next version
    deprecates); its errors stay."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


class TransformersEngine:
    """A transformers speech model and its processor on one device."""

    def __init__(self, config: EngineConfig):
        from transformers import (
            AutoConfig,
            AutoModelForCTC,
            AutoModelForSpeechSeq2Seq,
            AutoProcessor,
        )
        from transformers.models.auto.modeling_auto import MODEL_FOR_CTC_MAPPING_NAMES

        from engine.loader import default_device

        self.config = config
        path = Path(config.model.removeprefix(PREFIX)).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{config.model!r}: expected a transformers model directory (with config.json)"
            )
        self.device = default_device() if config.device == "auto" else torch.device(config.device)
        self.dtype = DTYPES.get(config.dtype) or (
            torch.float16 if self.device.type == "cuda" else torch.float32
        )
        quiet_transformers()
        self.ctc = AutoConfig.from_pretrained(path).model_type in MODEL_FOR_CTC_MAPPING_NAMES
        auto = AutoModelForCTC if self.ctc else AutoModelForSpeechSeq2Seq
        model = auto.from_pretrained(path, dtype=self.dtype)
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.processor = AutoProcessor.from_pretrained(path)
        self.chat = hasattr(self.processor, "apply_transcription_request")
        # the languages a chat model can be told, by code (its processor's own list)
        module = importlib.import_module(type(self.processor).__module__)
        self.chat_languages: dict[str, str] = getattr(module, "LANGUAGE_CODE_TO_NAME", {})
        self._chat_codes = {n.lower(): c for c, n in self.chat_languages.items()}  # its answers
        self.name = config.name or config.model
        self.n_slots = config.slots or BATCH  # windows a step
        self.whisper = self.model.config.model_type == "whisper"
        multilingual = self.whisper and self.model.generation_config.is_multilingual
        self.languages = set(self.model.generation_config.lang_to_id) if multilingual else set()
        self.english_only = self.whisper and not multilingual

    @property
    def encoder_batch(self) -> int:
        return self.n_slots

    @property
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())

    def shrink(self) -> bool:
        """Halve the windows a step (after running out of device memory); False at one."""
        if self.n_slots == 1:
            return False
        self.n_slots //= 2
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return True

    def check(self, options: TranscriptionOptions) -> TranscriptionOptions:
        """Refuse, before any work, what this model cannot do as asked."""
        cannot = []
        if options.word_timestamps:
            cannot.append("word timestamps (the native engine's, for Whisper models)")
        if options.vad or options.diarize:
            cannot.append("voice activity or speakers (the native engine's, for Whisper models)")
        if options.initial_prompt and not self.chat:
            cannot.append("a prompt")
        if options.temperature[0] > 0:
            cannot.append("sampling (temperature above 0): it decodes greedily")
        if options.task != "transcribe" and not self.languages:
            cannot.append(f"task {options.task!r}: only a multilingual Whisper model translates")
        if options.language is not None:
            if self.english_only and options.language != "en":
                cannot.append(f"language {options.language!r}: the model is English-only")
            elif self.chat:
                if self.chat_languages and options.language not in self.chat_languages:
                    cannot.append(f"language {options.language!r}: the model does not know it")
            elif not self.whisper:
                cannot.append("a language: the model takes none (omit it)")
            elif self.languages and f"<|{options.language}|>" not in self.languages:
                cannot.append(f"language {options.language!r}: the model does not know it")
        if cannot:
            raise OptionsError(
                f"{self.name} runs through transformers, which cannot give {'; '.join(cannot)}"
            )
        return options

    @torch.inference_mode()
    def decode(self, windows: list[np.ndarray], options: list[TranscriptionOptions]):
        """Each window's (tokens, text, language): one batch through the model."""
        if self.ctc:
            return self._ctc(windows)
        if self.chat:
            return self._chat(windows, options)
        extract = self.processor.feature_extractor
        inputs = extract(windows, sampling_rate=SAMPLE_RATE, return_tensors="pt")
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        key = next(k for k in ("input_features", "input_values") if k in inputs)
        inputs[key] = inputs[key].to(self.dtype)
        languages = [o.language for o in options]
        kwargs: dict = {"do_sample": False, "num_beams": 1}
        if self.whisper:
            if self.languages and None in languages:
                guess = self.model.detect_language(inputs[key])
                words = self.processor.tokenizer.convert_ids_to_tokens(guess.tolist())
                languages = [o or w[2:-2] for o, w in zip(languages, words, strict=True)]
            languages = [o or "en" for o in languages]
            if self.languages:
                kwargs["language"] = languages
                kwargs["task"] = options[0].task  # a step holds one task (`step`)
        tokens = self.model.generate(**inputs, **kwargs)
        tokenizer = self.processor.tokenizer
        special = set(tokenizer.all_special_ids)
        out = []
        for row, language in zip(tokens.tolist(), languages, strict=True):
            text_tokens = [t for t in row if t not in special]
            out.append((text_tokens, tokenizer.decode(text_tokens), language))
        return out

    def _chat(self, windows: list[np.ndarray], options: list[TranscriptionOptions]):
        """A transcription request per window (its language forced, its prompt as context),
        greedy generation after it, the answer parsed as the model's processor parses it."""
        processor, tokenizer = self.processor, self.processor.tokenizer
        languages = [o.language for o in options]
        prompts = [o.initial_prompt for o in options]
        inputs = processor.apply_transcription_request(
            audio=list(windows),
            language=languages if any(languages) else None,
            prompt=prompts if any(prompts) else None,
        )
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        inputs["input_features"] = inputs["input_features"].to(self.dtype)
        width = inputs["input_ids"].shape[1]
        generated = self.model.generate(
            **inputs, do_sample=False, num_beams=1, max_new_tokens=MAX_NEW_TOKENS
        )[:, width:]
        marker = tokenizer.convert_tokens_to_ids("<asr_text>")
        special = set(tokenizer.all_special_ids)
        out = []
        for row, forced in zip(generated.tolist(), languages, strict=True):
            text = tokenizer.decode(row, skip_special_tokens=True)
            parsed = processor.parse_output(text) if hasattr(processor, "parse_output") else {}
            if marker in row:  # the text's tokens: after the model's language answer
                row = row[row.index(marker) + 1 :]
            tokens = [t for t in row if t not in special]
            answered = (parsed.get("language") or "").lower()  # "English": "en", if known
            language = forced or self._chat_codes.get(answered)
            out.append((tokens, parsed.get("transcription", text), language))
        return out

    def _ctc(self, windows: list[np.ndarray]):
        inputs = self.processor(
            windows, sampling_rate=SAMPLE_RATE, return_tensors="pt", padding=True
        )
        values = inputs["input_values"].to(self.device, self.dtype)
        mask = inputs.get("attention_mask")
        logits = self.model(values, attention_mask=None if mask is None else mask.to(self.device))
        best = logits.logits.argmax(dim=-1).tolist()
        tokenizer = self.processor.tokenizer
        blank, special = tokenizer.pad_token_id, set(tokenizer.all_special_ids)
        texts = tokenizer.batch_decode(best, skip_special_tokens=True)  # its own CTC collapse
        out = []
        for row, text in zip(best, texts, strict=True):
            collapsed = [t for t, _ in itertools.groupby(row) if t != blank]
            out.append(([t for t in collapsed if t not in special], text, None))
        return out


@dataclass(eq=False)
class _Input:
    owner: Hashable
    samples: np.ndarray
    options: TranscriptionOptions
    progress: Progress | None
    order: tuple[bool, int]
    decoded: dict[int, tuple[list[int], str, str | None]] = field(default_factory=dict)

    @property
    def n_windows(self) -> int:
        return max(1, -(-len(self.samples) // WINDOW))


_ORDER = operator.itemgetter(0)


class TransformersStream(Streaming):
    """The native stream's interface over a transformers model (engine.stream.Stream)."""

    def __init__(self, engine: TransformersEngine):
        self.engine = engine
        self.stats = StreamStats()
        self._inputs: dict[Hashable, _Input] = {}
        self._arrivals = itertools.count()
        self._queue: list[tuple[tuple[bool, int, int], _Input, int]] = []  # windows to decode

    def prepare(self, item: Input) -> np.ndarray:
        """An input's 16 kHz samples; raises AudioError, or SpectrogramError for a spectrogram
        (a model's own features are made from audio here)."""
        host = read_input(item, self.engine.config.max_audio_s)
        if isinstance(host, LongAudio):
            host = host.audio.decode()
        if host.ndim != 1:
            raise SpectrogramError(
                f"{self.engine.name} runs through transformers: send audio, not a spectrogram"
            )
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
        return True

    def reset(self) -> None:
        self._inputs.clear()
        self._queue.clear()

    def shrink(self) -> bool:
        self.reset()
        return self.engine.shrink()

    def warm(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Run a second of silence through the model (its first call's costs); no graphs."""
        self.transcribe([np.zeros(SAMPLE_RATE, np.float32)])
        self.stats = StreamStats()
        return 0

    def warm_next(self) -> bool:
        return False  # no graphs

    def step(self) -> list[Finished]:
        """Decode the next batch of windows (one task a batch: a multilingual Whisper model
        translates or transcribes a whole batch); hand back the inputs done."""
        start = time.perf_counter()
        first = self._queue[0][1].options.task
        batch = [q for q in self._queue if q[1].options.task == first][: self.engine.n_slots]
        taken = {id(q) for q in batch}
        self._queue = [q for q in self._queue if id(q) not in taken]
        windows = [e.samples[i * WINDOW : (i + 1) * WINDOW] for _, e, i in batch]
        decoded = self.engine.decode(windows, [e.options for _, e, _ in batch])
        finished = []
        for (_, entry, i), result in zip(batch, decoded, strict=True):
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
