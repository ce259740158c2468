"""Decoding 30 s windows with Whisper's rules, batched over cache slots.

Each row of a batch carries its own task: language, temperature, previous-text prompt and
whether it predicts timestamps. Rules are small `LogitFilter`s whose `apply` edits the logits
of every live row at once with tensor operations (no per-row Python loop), so a decode step
stays one batched computation.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.mel import CHUNK_LENGTH
from engine.model import KVCache, Whisper
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
    filters: list[LogitFilter] = []
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


@torch.inference_mode()
def detect_language(
    model: Whisper, cache: KVCache, slots: Tensor, tokenizer: Tokenizer
) -> tuple[list[str], list[float]]:
    """Most likely language of each row, from the first step's logits over language tokens."""
    codes = list(tokenizer.language_ids)
    ids = torch.tensor(list(tokenizer.language_ids.values()), device=slots.device)
    tokens = torch.full((len(slots), 1), tokenizer.sot, device=slots.device)
    logits = model.decoder(tokens, torch.zeros_like(tokens), slots, cache)[:, 0, ids]
    probs = logits.softmax(dim=-1)
    best = probs.argmax(dim=-1)
    return [codes[i] for i in best.tolist()], probs.gather(1, best[:, None])[:, 0].tolist()


@torch.inference_mode()
def decode(
    model: Whisper,
    cache: KVCache,
    slots: Tensor,
    tasks: list[WindowTask],
    tokenizer: Tokenizer,
    filters: list[LogitFilter],
    sample_len: int,
    generator: torch.Generator | None = None,
) -> list[WindowResult]:
    """Decode one window per slot, whose cross-attention K/V are already projected.

    Prompts may differ in length: each row's prompt is right-padded, the padding placed at
    the positions its first sampled tokens will overwrite, and causal masking by position
    keeps real tokens from seeing it.
    """
    device, batch, n_ctx = slots.device, len(tasks), model.dims.n_text_ctx
    prompts = [prompt_tokens(tokenizer, t, n_ctx) for t in tasks]
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    width = max(len(p) for p in prompts)
    tokens = torch.tensor([p + [tokenizer.eot] * (width - len(p)) for p in prompts], device=device)
    positions = torch.arange(width, device=device).expand(batch, -1)
    logits = model.decoder(tokens, positions, slots, cache)
    rows = torch.arange(batch, device=device)
    sot_index = torch.tensor([p.index(tokenizer.sot) for p in prompts], device=device)
    no_speech = logits[rows, sot_index].softmax(-1)[:, tokenizer.no_speech]
    logits = logits[rows, lengths - 1]
    position = lengths - 1
    limit = torch.clamp(n_ctx - lengths, max=sample_len)  # a row's prompt + samples fit n_ctx

    temperature = torch.tensor([t.temperature for t in tasks], device=device)
    sampling = bool((temperature > 0).any())
    state = DecodeState(
        n_sampled=torch.zeros(batch, dtype=torch.long, device=device),
        last=torch.full((batch,), -1, device=device),
        penultimate=torch.full((batch,), -1, device=device),
        last_timestamp=torch.full((batch,), -1, device=device),
        timestamps=torch.tensor([t.timestamps for t in tasks], device=device),
    )
    sampled = torch.full((batch, sample_len), tokenizer.eot, device=device)
    sum_logprobs = torch.zeros(batch, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    for step in range(sample_len):
        for f in filters:
            f.apply(logits, state)
        next_tokens = logits.argmax(dim=-1)
        if sampling:
            scaled = logits / temperature.clamp(min=1e-6)[:, None]
            drawn = torch.multinomial(scaled.softmax(dim=-1), 1, generator=generator)[:, 0]
            next_tokens = torch.where(temperature > 0, drawn, next_tokens)
        logprobs = F.log_softmax(logits.float(), dim=-1).gather(1, next_tokens[:, None])[:, 0]
        sum_logprobs += logprobs * ~finished
        next_tokens = next_tokens.masked_fill(finished, tokenizer.eot)
        sampled[:, step] = next_tokens
        state.penultimate, state.last = state.last, next_tokens
        is_ts = next_tokens >= tokenizer.timestamp_begin
        state.last_timestamp = torch.where(is_ts, next_tokens, state.last_timestamp)
        state.n_sampled += 1
        finished |= (next_tokens == tokenizer.eot) | (state.n_sampled >= limit)
        if bool(finished.all()):
            break
        position = position + 1
        logits = model.decoder(next_tokens[:, None], position[:, None], slots, cache)[:, -1]

    results = []
    for i, row in enumerate(sampled.tolist()):
        row = row[: row.index(tokenizer.eot)] if tokenizer.eot in row else row
        row = row[: int(limit[i])]
        text = tokenizer.decode(row)
        results.append(
            WindowResult(
                tokens=row,
                text=text,
                avg_logprob=sum_logprobs[i].item() / (len(row) + 1),
                no_speech_prob=no_speech[i].item(),
                compression_ratio=compression_ratio(text.strip()),
                temperature=tasks[i].temperature,
            )
        )
    return results
