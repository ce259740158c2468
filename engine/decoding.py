"""Whisper's decoding rules, for a batch of windows decoded together (`engine.scheduler`).

Each row carries its own task: language, temperature, previous-text prompt and whether it
predicts timestamps. Rules are small `LogitFilter`s whose `apply` edits the logits of every
live row at once with tensor operations (no per-row Python loop and no host sync), so a decode
step stays one batched computation that a CUDA graph can capture.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.mel import CHUNK_LENGTH
from engine.tokenizer import Tokenizer

NEG_INF = float("-inf")


@dataclass(frozen=True)
class WindowTask:
    """How to decode one window."""

    language: str  # ISO 639-1 (ignored by English-only models)
    task: str = "transcribe"  # or "translate"
    temperature: float = 0.0  # 0: greedy; above: sampling
    prompt: tuple[int, ...] = ()  # previous-text tokens, fed after <|startofprev|>
    timestamps: bool = True  # predict segment timestamps (else <|notimestamps|>)


@dataclass(frozen=True)
class WindowResult:
    tokens: list[int]  # sampled tokens (text and timestamps), end-of-text excluded
    text: str
    avg_logprob: float  # per sampled token, end-of-text included
    no_speech_prob: float
    compression_ratio: float
    temperature: float


def compression_ratio(text: str) -> float:
    data = text.encode("utf-8")
    return len(data) / len(zlib.compress(data)) if data else 0.0


class LogitFilter:
    only_with_timestamps = False  # a rule that edits nothing unless some row has timestamps

    def apply(self, logits: Tensor, state: DecodeState) -> None:
        """Edit `logits` (batch, n_vocab) in place."""
        raise NotImplementedError


@dataclass
class DecodeState:
    """Per-row state of a batch, as tensors of shape (batch,)."""

    n_sampled: Tensor  # tokens sampled so far
    last: Tensor  # last sampled token, -1 before any
    penultimate: Tensor  # the one before, -1 before any
    last_timestamp: Tensor  # last sampled timestamp token, -1 before any
    timestamps: Tensor  # bool: this row predicts timestamps
    min_tokens: Tensor  # end-of-text is not sampled before this many tokens (benchmarks: 100)


class SuppressEarlyEnd(LogitFilter):
    """No end-of-text before a row's `min_tokens` (fixed-length work for benchmarks)."""

    def __init__(self, eot: int):
        self.eot = eot

    def apply(self, logits: Tensor, state: DecodeState) -> None:
        early = state.n_sampled < state.min_tokens
        logits[:, self.eot] = logits[:, self.eot].masked_fill(early, NEG_INF)


class SuppressTokens(LogitFilter):
    def __init__(self, token_ids: list[int], n_vocab: int, device: torch.device):
        self.mask = torch.zeros(n_vocab, dtype=torch.bool, device=device)
        self.mask[token_ids] = True

    def apply(self, logits: Tensor, state: DecodeState) -> None:
        logits.masked_fill_(self.mask, NEG_INF)


class SuppressBlank(LogitFilter):
    """No blank and no end-of-text as a window's first token (Whisper's begin-suppress)."""

    def __init__(self, token_ids: list[int], device: torch.device):
        self.token_ids = torch.tensor(token_ids, device=device)

    def apply(self, logits: Tensor, state: DecodeState) -> None:
        first = (state.n_sampled == 0)[:, None]
        logits[:, self.token_ids] = logits[:, self.token_ids].masked_fill(first, NEG_INF)


class ApplyTimestampRules(LogitFilter):
    """Whisper's timestamp grammar, for the rows that predict timestamps:

    - timestamps come in pairs (a segment's end, the next one's start) except at the end, so
      after a lone timestamp comes another timestamp or end-of-text, after a pair, text;
    - timestamps never decrease, and a segment never has zero length;
    - the first token is a timestamp, at most `max_initial_timestamp` seconds in;
    - when the timestamps together are likelier than any text token, a timestamp it is.
    """

    only_with_timestamps = True

    def __init__(
        self,
        tokenizer: Tokenizer,
        n_vocab: int,
        max_initial_index: int | None,
        device: torch.device,
    ):
        self.eot, self.no_timestamps = tokenizer.eot, tokenizer.no_timestamps
        self.begin = tokenizer.timestamp_begin
        self.max_initial_index = max_initial_index
        self.vocab = torch.arange(n_vocab, device=device)

    def apply(self, logits: Tensor, state: DecodeState) -> None:
        rows = state.timestamps[:, None]
        is_ts = self.vocab >= self.begin  # (n_vocab,)
        logits.masked_fill_(rows & (self.vocab == self.no_timestamps), NEG_INF)

        last_ts = (state.n_sampled >= 1) & (state.last >= self.begin)
        penultimate_ts = (state.n_sampled < 2) | (state.penultimate >= self.begin)
        after_pair = (last_ts & penultimate_ts)[:, None]
        after_lone = (last_ts & ~penultimate_ts)[:, None]
        logits.masked_fill_(rows & after_pair & is_ts, NEG_INF)
        logits.masked_fill_(rows & after_lone & (self.vocab < self.eot), NEG_INF)

        # monotonic, non-empty segments: nothing below the last timestamp (+1 unless closing)
        seen = (state.last_timestamp >= 0)[:, None]
        floor = torch.where(after_lone[:, 0], state.last_timestamp, state.last_timestamp + 1)
        logits.masked_fill_(rows & seen & is_ts & (self.vocab < floor[:, None]), NEG_INF)

        first = (state.n_sampled == 0)[:, None]
        logits.masked_fill_(rows & first & ~is_ts, NEG_INF)
        if self.max_initial_index is not None:
            last_allowed = self.begin + self.max_initial_index
            logits.masked_fill_(rows & first & (self.vocab > last_allowed), NEG_INF)

        logprobs = F.log_softmax(logits.float(), dim=-1)
        ts_logprob = logprobs[:, self.begin :].logsumexp(dim=-1)
        text_logprob = logprobs[:, : self.begin].max(dim=-1).values
        force = (ts_logprob > text_logprob)[:, None]
        logits.masked_fill_(rows & force & ~is_ts, NEG_INF)


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


def build_filters(
    tokenizer: Tokenizer,
    n_vocab: int,
    suppress: list[int],
    suppress_blank: bool,
    max_initial_timestamp: float | None,
    n_audio_ctx: int,
    device: torch.device,
) -> list[LogitFilter]:
    """The rules in the order they apply; the timestamp rules, which weigh what the others left,
    come last (the fused kernel, `engine.kernels.greedy`, keeps the same order)."""
    filters: list[LogitFilter] = [SuppressEarlyEnd(tokenizer.eot)]
    if suppress_blank:
        filters.append(SuppressBlank(tokenizer.encode(" ") + [tokenizer.eot], device))
    filters.append(SuppressTokens(suppress, n_vocab, device))
    precision = CHUNK_LENGTH / n_audio_ctx  # 0.02 s per timestamp token
    max_index = None if max_initial_timestamp is None else round(max_initial_timestamp / precision)
    filters.append(ApplyTimestampRules(tokenizer, n_vocab, max_index, device))
    return filters


def prompt_tokens(tokenizer: Tokenizer, task: WindowTask, n_text_ctx: int) -> list[int]:
    """[<|startofprev|> previous...] <|startoftranscript|> [language task] [<|notimestamps|>]"""
    tokens = tokenizer.sot_sequence(task.language, task.task)
    if task.timestamps:
        tokens = tokens[:-1]  # sot_sequence ends with <|notimestamps|>
    if task.prompt:
        tokens = [tokenizer.sot_prev, *task.prompt[-(n_text_ctx // 2 - 1) :], *tokens]
    return tokens
