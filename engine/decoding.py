"""Greedy decoding of 30 s windows with Whisper's rules, batched over cache slots.

Rules are small `LogitFilter`s whose `apply` edits the logits of every live row at once with
tensor operations (no per-row Python loop), so a decode step stays one batched computation.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.model import KVCache, Whisper
from engine.tokenizer import TASKS, Tokenizer


class OptionsError(ValueError):
    """Decoding options that cannot apply to this model or to each other."""


@dataclass(frozen=True)
class DecodingOptions:
    # what to do: "transcribe" in the spoken language, or "translate" to English
    task: str = "transcribe"
    # ISO 639-1 code of the spoken language; None detects it (multilingual models)
    language: str | None = None

    # sampling: at most this many new tokens per window (None: half the text context, 224)
    sample_len: int | None = None
    # forbid a blank or end-of-text as the first sampled token
    suppress_blank: bool = True
    # token ids never sampled, in addition to the model's non-speech symbols and specials
    suppress_tokens: tuple[int, ...] = field(default_factory=tuple)

    def verified(self, tokenizer: Tokenizer) -> DecodingOptions:
        """Check the options against the model before any work; return them."""
        if self.task not in TASKS:
            raise OptionsError(f"task {self.task!r} is not one of {', '.join(TASKS)}")
        if not tokenizer.is_multilingual:
            if self.task == "translate":
                raise OptionsError("translate needs a multilingual model; this one is English-only")
            if self.language not in (None, "en"):
                raise OptionsError(
                    f"language {self.language!r} needs a multilingual model; "
                    "this one is English-only"
                )
        elif self.language is not None and self.language not in tokenizer.language_ids:
            known = ", ".join(sorted(tokenizer.language_ids))
            raise OptionsError(f"unknown language {self.language!r}; expected one of: {known}")
        return self


@dataclass(frozen=True)
class DecodingResult:
    tokens: list[int]  # sampled text tokens, end-of-text excluded
    text: str
    language: str
    language_probability: float | None  # None when the language was given, not detected
    avg_logprob: float
    no_speech_prob: float
    compression_ratio: float
    temperature: float = 0.0


class LogitFilter:
    def apply(self, logits: Tensor, n_sampled: Tensor) -> None:
        """Edit `logits` (batch, n_vocab) in place; `n_sampled` (batch,) counts each row's
        tokens sampled so far."""
        raise NotImplementedError


class SuppressTokens(LogitFilter):
    def __init__(self, token_ids: list[int], n_vocab: int, device: torch.device):
        self.mask = torch.zeros(n_vocab, dtype=torch.bool, device=device)
        self.mask[token_ids] = True

    def apply(self, logits: Tensor, n_sampled: Tensor) -> None:
        logits.masked_fill_(self.mask, float("-inf"))


class SuppressBlank(LogitFilter):
    """No blank and no end-of-text as a window's first token (Whisper's begin-suppress)."""

    def __init__(self, token_ids: list[int], device: torch.device):
        self.token_ids = torch.tensor(token_ids, device=device)

    def apply(self, logits: Tensor, n_sampled: Tensor) -> None:
        first = (n_sampled == 0)[:, None]
        logits[:, self.token_ids] = logits[:, self.token_ids].masked_fill(first, float("-inf"))


def suppressed_tokens(
    tokenizer: Tokenizer, model_suppress: list[int], extra: tuple[int, ...]
) -> list[int]:
    """The model's non-speech symbols plus the specials openai-whisper never samples."""
    specials = [
        tokenizer.transcribe,
        tokenizer.translate,
        tokenizer.sot,
        tokenizer.sot_prev,
        tokenizer.no_speech,
    ]
    return sorted(set(model_suppress) | set(specials) | set(extra))


def compression_ratio(text: str) -> float:
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


@torch.inference_mode()
def detect_language(
    model: Whisper, cache: KVCache, slots: Tensor, tokenizer: Tokenizer
) -> tuple[list[str], list[float]]:
    """Most likely language of each row, from the first step's logits over language tokens."""
    codes = list(tokenizer.language_ids)
    ids = torch.tensor(list(tokenizer.language_ids.values()), device=slots.device)
    tokens = torch.full((len(slots), 1), tokenizer.sot, device=slots.device)
    positions = torch.zeros_like(tokens)
    logits = model.decoder(tokens, positions, slots, cache)[:, 0, ids]
    probs = logits.softmax(dim=-1)
    best = probs.argmax(dim=-1)
    return [codes[i] for i in best.tolist()], probs.gather(1, best[:, None])[:, 0].tolist()


@torch.inference_mode()
def greedy_decode(
    model: Whisper,
    cache: KVCache,
    slots: Tensor,
    prompts: list[list[int]],
    tokenizer: Tokenizer,
    filters: list[LogitFilter],
    sample_len: int,
) -> tuple[list[list[int]], list[float], list[float]]:
    """Greedy-decode each slot, whose cross-attention K/V are already projected.

    prompts: one start sequence per row, all of one length (sot [language task] notimestamps).
    returns: sampled tokens per row (end-of-text excluded), the sum of their log-probabilities
        (end-of-text included), and each row's no-speech probability.
    """
    device = slots.device
    batch = len(prompts)
    tokens = torch.tensor(prompts, device=device)
    positions = torch.arange(tokens.shape[1], device=device).expand(batch, -1)
    logits = model.decoder(tokens, positions, slots, cache)
    no_speech = logits[:, prompts[0].index(tokenizer.sot)].softmax(-1)[:, tokenizer.no_speech]
    logits = logits[:, -1]
    position = positions[:, -1]

    sampled = torch.full((batch, sample_len), tokenizer.eot, device=device)
    sum_logprobs = torch.zeros(batch, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    n_sampled = torch.zeros(batch, dtype=torch.long, device=device)
    for step in range(sample_len):
        for f in filters:
            f.apply(logits, n_sampled)
        next_tokens = logits.argmax(dim=-1)
        logprobs = F.log_softmax(logits, dim=-1).gather(1, next_tokens[:, None])[:, 0]
        sum_logprobs += logprobs * ~finished
        next_tokens = next_tokens.masked_fill(finished, tokenizer.eot)
        sampled[:, step] = next_tokens
        n_sampled += 1
        finished |= next_tokens == tokenizer.eot
        if bool(finished.all()) or step + 1 == sample_len:
            break
        position = position + 1
        logits = model.decoder(next_tokens[:, None], position[:, None], slots, cache)[:, -1]

    rows = []
    for row in sampled.tolist():
        rows.append(row[: row.index(tokenizer.eot)] if tokenizer.eot in row else row)
    return rows, sum_logprobs.tolist(), no_speech.tolist()
