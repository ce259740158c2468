"""Speech models the native engine does not implement, run through transformers.

A model named `hf:/local/dir` (a transformers directory with its processor; hub ids stay out)
is decoded window by window by `TransformersEngine` behind `engine.windows.WindowStream`, which
has the native stream's interface, so the worker's batcher, the job contract and the results
are the same whichever runs a model:

- a speech sequence-to-sequence model (`AutoModelForSpeechSeq2Seq`: Whisper, Speech2Text,
  Moonshine, ...) decodes greedily with its own `generate`;
- a CTC model (`AutoModelForCTC`: wav2vec2, HuBERT, WavLM, ...) takes the most likely token
  of each frame;
- an audio language model whose processor builds a transcription request (transformers'
  `apply_transcription_request`: Qwen3-ASR, Voxtral, ...) generates greedily after that
  prompt (`Chat`); a prompt given to the job becomes the request's context, a language its
  forced language, and Qwen3-ASR's `language X<asr_text>` answer is parsed as its processor
  does. The engine runs Qwen3-ASR natively too (engine.qwen3_asr), through the same `Chat`.

Each step decodes one batch of windows to its end, urgent inputs' first.
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import Hashable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from engine.config import EngineConfig
from engine.mel import SAMPLE_RATE
from engine.options import OptionsError, TranscriptionOptions
from engine.windows import Decoded, Request, WindowModel

PREFIX = "hf:"
BATCH = 16  # windows a step at most (halved after running out of device memory)
MAX_NEW_TOKENS = 448  # a chat model's answer for one window at most (Whisper's own bound)
TEMPLATES_HELD = 256  # (language, prompt) pairs whose request text a Chat keeps tokenized


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


def window_refusals(options: TranscriptionOptions) -> list[str]:
    """What no model decoded window by window gives here (engine.windows): the native Whisper
    engine's timing and voice work, and sampling."""
    cannot = []
    if options.word_timestamps:
        cannot.append("word timestamps (the native engine's, for Whisper models)")
    if options.vad or options.diarize:
        cannot.append("voice activity or speakers (the native engine's, for Whisper models)")
    if options.temperature[0] > 0:
        cannot.append("sampling (temperature above 0): it decodes greedily")
    if options.hallucination_silence_threshold is not None:
        cannot.append("hallucination_silence_threshold (the native engine's, with word timings)")
    return cannot


class TransformersEngine(WindowModel):
    """A transformers speech model and its processor on one device."""

    def __init__(self, config: EngineConfig):
        from transformers import (
            AutoConfig,
            AutoModelForCTC,
            AutoModelForSpeechSeq2Seq,
            AutoProcessor,
        )
        from transformers.models.auto.modeling_auto import MODEL_FOR_CTC_MAPPING_NAMES

        self.config = config
        path = Path(config.model.removeprefix(PREFIX)).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(
                f"{config.model!r}: expected a transformers model directory (with config.json)"
            )
        self.device, self.dtype = config.placement()
        quiet_transformers()
        self.ctc = AutoConfig.from_pretrained(path).model_type in MODEL_FOR_CTC_MAPPING_NAMES
        auto = AutoModelForCTC if self.ctc else AutoModelForSpeechSeq2Seq
        model = auto.from_pretrained(path, dtype=self.dtype)
        self.model = model.to(self.device).eval().requires_grad_(False)
        self.processor = AutoProcessor.from_pretrained(path)
        chat = hasattr(self.processor, "apply_transcription_request")
        self.chat = Chat(self.processor) if chat else None
        self.name = config.name or config.model
        self.n_slots = config.slots or BATCH  # windows a step
        self.whisper = self.model.config.model_type == "whisper"
        multilingual = self.whisper and self.model.generation_config.is_multilingual
        self.languages = set(self.model.generation_config.lang_to_id) if multilingual else set()
        self.english_only = self.whisper and not multilingual

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
        cannot = window_refusals(options)
        if options.initial_prompt and not self.chat:
            cannot.append("a prompt")
        if options.sample_len is not None or options.min_tokens:
            cannot.append("a number of tokens a window (sample_len, min_tokens)")
        if options.task != "transcribe" and not self.languages:
            cannot.append(f"task {options.task!r}: only a multilingual Whisper model translates")
        if options.language is not None:
            if self.english_only and options.language != "en":
                cannot.append(f"language {options.language!r}: the model is English-only")
            elif self.chat:
                cannot += self.chat.refusals(options.language)
            elif not self.whisper:
                cannot.append("a language: the model takes none (omit it)")
            elif self.languages and f"<|{options.language}|>" not in self.languages:
                cannot.append(f"language {options.language!r}: the model does not know it")
        if cannot:
            raise OptionsError(
                f"{self.name} runs through transformers, which cannot give {'; '.join(cannot)}"
            )
        return options

    def room(self) -> int:
        return self.n_slots

    def run(self, windows: list[Request]) -> list[tuple[Hashable, Decoded]]:
        """Decode these windows as one batch, to the end of each."""
        if not windows:
            return []
        decoded = self.decode([w for _, w, _ in windows], [o for _, _, o in windows])
        return [(key, d) for (key, _, _), d in zip(windows, decoded, strict=True)]

    def drop(self, keys: set[Hashable]) -> None:
        """Nothing to forget: no window outlives the step that decodes it."""

    def reset(self) -> None:
        """Nothing held between steps."""

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
        """A transcription request per window, greedy generation after it."""
        inputs = self.chat.requests(windows, options)
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        inputs["input_features"] = inputs["input_features"].to(self.dtype)
        width = inputs["input_ids"].shape[1]
        generated = self.model.generate(
            **inputs, do_sample=False, num_beams=1, max_new_tokens=MAX_NEW_TOKENS
        )[:, width:]
        rows = zip(generated.tolist(), options, strict=True)
        return [self.chat.answer(row, o.language) for row, o in rows]

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


class Chat:
    """An audio language model's processor (one with `apply_transcription_request`): each
    window's transcription request, its language forced and the job's prompt as its context,
    and the answer, parsed as the processor parses it."""

    def __init__(self, processor):
        self.processor = processor
        # the languages the model can be told, by code (its processor's own list)
        module = importlib.import_module(type(processor).__module__)
        self.languages: dict[str, str] = getattr(module, "LANGUAGE_CODE_TO_NAME", {})
        self._codes = {n.lower(): c for c, n in self.languages.items()}  # its answers
        tokenizer = processor.tokenizer
        self.marker = tokenizer.convert_tokens_to_ids("<asr_text>")
        self.special = set(tokenizer.all_special_ids)
        # (language, prompt) -> a request's tokens before and after its audio (`prompt_ids`)
        self._around_audio: dict[tuple[str | None, str | None], tuple[list[int], list[int]]] = {}

    def prompt_ids(self, language: str | None, prompt: str | None, n_audio: int) -> list[int]:
        """A window's request tokens with `n_audio` audio tokens: what `requests` gives, with
        the chat template's text around the audio tokenized once for each language and
        prompt (by the processor, on a second of silence), not once a window."""
        key = (language, prompt)
        if key not in self._around_audio:
            if len(self._around_audio) >= TEMPLATES_HELD:  # prompts are the jobs' own text
                self._around_audio.clear()
            built = self.processor.apply_transcription_request(
                audio=[np.zeros(SAMPLE_RATE, np.float32)],
                language=[language] if language else None,
                prompt=[prompt] if prompt else None,
            )
            ids, audio = built["input_ids"][0].tolist(), self.processor.audio_token_id
            first, n = ids.index(audio), ids.count(audio)
            self._around_audio[key] = (ids[:first], ids[first + n :])
        before, after = self._around_audio[key]
        return [*before, *[self.processor.audio_token_id] * n_audio, *after]

    def refusals(self, language: str | None) -> list[str]:
        if language is not None and self.languages and language not in self.languages:
            return [f"language {language!r}: the model does not know it"]
        return []

    def requests(self, windows: list[np.ndarray], options: list[TranscriptionOptions]):
        """A batch of requests: `input_ids` and `attention_mask` padded on the left,
        `input_features` and `input_features_mask` on the right. Each window's request is
        built alone: the processor's log-mel of a batch is floored at 8 below its loudest
        member's peak, so a window's features would depend on its neighbours."""
        built = [
            self.processor.apply_transcription_request(
                audio=[samples],
                language=[o.language] if o.language else None,
                prompt=[o.initial_prompt] if o.initial_prompt else None,
            )
            for samples, o in zip(windows, options, strict=True)
        ]
        pad = self.processor.tokenizer.pad_token_id or 0
        out = {}
        for key, left, value in (
            ("input_ids", True, pad),
            ("attention_mask", True, 0),
            ("input_features", False, 0),
            ("input_features_mask", False, 0),
        ):
            width = max(b[key].shape[-1] for b in built)
            spare = [width - b[key].shape[-1] for b in built]
            sides = [(n, 0) if left else (0, n) for n in spare]
            out[key] = torch.cat(
                [F.pad(b[key], s, value=value) for b, s in zip(built, sides, strict=True)]
            )
        return out

    def answer(self, row: list[int], forced: str | None) -> Decoded:
        """The (text tokens, text, language) of the tokens generated for one window."""
        processor = self.processor
        text = processor.tokenizer.decode(row, skip_special_tokens=True)
        parsed = processor.parse_output(text) if hasattr(processor, "parse_output") else {}
        if self.marker in row:  # the text's tokens: after the model's language answer
            row = row[row.index(self.marker) + 1 :]
        tokens = [t for t in row if t not in self.special]
        answered = (parsed.get("language") or "").lower()  # "English": "en", if known
        return tokens, parsed.get("transcription", text), forced or self._codes.get(answered)
