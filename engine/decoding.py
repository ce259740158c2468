"""Whisper's decoding rules and decode state, for a batch of windows decoded together.

Each row carries its own task (`WindowTask`): language, temperature, previous-text prompt and
whether it predicts timestamps. Rules are small `LogitFilter`s whose `apply` edits the logits
of every live row at once with tensor operations (no per-row Python loop and no host sync), so
a decode step stays one batched computation that a CUDA graph can capture. `SlotState` is the
decode state machine: every slot's tokens, position and scores as tensors, advanced by
`commit` after each step and read back, for the rows that finished, as `WindowResult`s.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor

from engine.audio import CHUNK_LENGTH
from engine.tokenizer import Tokenizer

NEG_INF = float("-inf")
PROMPT_BASE = 4  # <|startoftranscript|> language task <|notimestamps|>: the longest start
# A row still decoding whose last REPEAT_RUN tokens equal the REPEAT_RUN tokens p before them
# (1 <= p <= REPEAT_PERIOD) repeats itself: the host checks its text so far (`SlotState.rows`).
REPEAT_RUN, REPEAT_PERIOD = 8, 32


@dataclass(frozen=True)
class DecodingRules:
    """What every window of a stream is decoded under. The rules are built into the stream's
    filters, caches and CUDA graphs, so they are fixed when it opens (`EngineConfig.rules`);
    what varies from input to input is in `TranscriptionOptions`."""

    suppress_blank: bool = True  # no blank and no end-of-text as a window's first token
    suppress_tokens: tuple[int, ...] = ()  # in addition to the model's non-speech symbols
    max_initial_timestamp: float | None = 1.0  # seconds: the first timestamp of a window
    sample_len: int | None = None  # tokens a window at most; None: half the text context (224)
    # prompt tokens a window at most; None: room for previous text (half the text context + 4).
    # With sample_len it sizes the self-attention cache: 4 (no previous text) keeps it small.
    max_prompt: int | None = None

    def sizes(self, n_text_ctx: int) -> tuple[int, int]:
        """(prompt tokens, sampled tokens) a window has room for."""
        full_prompt = n_text_ctx // 2 + PROMPT_BASE  # previous text: half the context
        return self.max_prompt or full_prompt, self.sample_len or n_text_ctx // 2


@dataclass(frozen=True)
class WindowTask:
    """How to decode one window."""

    language: str  # ISO 639-1 (ignored by English-only models)
    task: str = "transcribe"  # or "translate"
    temperature: float = 0.0  # 0: greedy; above: sampling
    prompt: tuple[int, ...] = ()  # previous-text tokens, fed after <|startofprev|>
    timestamps: bool = True  # predict segment timestamps (else <|notimestamps|>)
    # what a sampled token depends on besides the logits, with the attempt and the step
    # (engine.sampling): the input's seed and the window's first frame in it
    seed: int = 0
    seek: int = 0
    min_tokens: int = 0  # no end-of-text before this many tokens (fixed work for benchmarks)
    max_tokens: int | None = None  # at most this many (default: the rules' sample_len)
    # end the window as soon as its text so far compresses better than this (it repeats
    # itself): it has failed the fallback's compression check, and decoding on to the token
    # limit would only repeat more (issue 12). None: decode to the end.
    max_compression_ratio: float | None = None


@dataclass(frozen=True)
class WindowResult:
    tokens: list[int]  # sampled tokens (text and timestamps), end-of-text excluded
    text: str
    avg_logprob: float  # per sampled token, end-of-text included
    no_speech_prob: float
    compression_ratio: float
    temperature: float

    @classmethod
    def of(cls, row: FinishedRow, temperature: float, tokenizer: Tokenizer) -> WindowResult:
        text = tokenizer.decode(row.tokens)
        return cls(
            tokens=row.tokens,
            text=text,
            avg_logprob=row.sum_logprob / (len(row.tokens) + 1),
            no_speech_prob=row.no_speech_prob,
            compression_ratio=compression_ratio(text.strip()),
            temperature=temperature,
        )


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


@dataclass(frozen=True)
class FinishedRow:
    """A slot whose window is decoded, as read back from the GPU."""

    slot: int
    tokens: list[int]  # sampled, up to the end-of-text (excluded)
    sum_logprob: float  # of every sampled token, end-of-text included
    no_speech_prob: float
    finished: bool = True  # False: still decoding, read because it repeats itself


@dataclass
class SlotState:
    """The decode state of every slot, one row a slot: what a decode step reads and advances on
    the GPU, and what moves with a sequence when the pool compacts (`tensors`)."""

    token: Tensor  # the token the next step feeds
    position: Tensor  # its position
    n_sampled: Tensor  # tokens sampled so far
    last: Tensor  # last sampled token, -1 before any
    penultimate: Tensor  # the one before, -1 before any
    last_timestamp: Tensor  # last sampled timestamp token, -1 before any
    timestamps: Tensor  # bool: the row predicts timestamps
    finished: Tensor  # bool: end-of-text sampled, or the row's limit reached
    temperature: Tensor  # float32; 0: greedy
    sample_key: Tensor  # what the row's sampling noise depends on (engine.sampling.window_key)
    min_tokens: Tensor  # no end-of-text before this many tokens
    limit: Tensor  # tokens the row samples at most
    sum_logprob: Tensor  # float32
    no_speech: Tensor  # float32: no-speech probability, from the prompt's <|startoftranscript|>
    sampled: Tensor  # shape = (n_slots, sample_len): the tokens sampled so far

    @classmethod
    def allocate(cls, n_slots: int, sample_len: int, eot: int, device: torch.device) -> SlotState:
        def slots(fill, dtype=torch.long) -> Tensor:
            return torch.full((n_slots,), fill, dtype=dtype, device=device)

        return cls(
            token=slots(0),
            position=slots(0),
            n_sampled=slots(0),
            last=slots(-1),
            penultimate=slots(-1),
            last_timestamp=slots(-1),
            timestamps=slots(False, torch.bool),
            finished=slots(True, torch.bool),
            temperature=slots(0.0, torch.float32),
            sample_key=slots(0),
            min_tokens=slots(0),
            limit=slots(sample_len),
            sum_logprob=slots(0.0, torch.float32),
            no_speech=slots(0.0, torch.float32),
            sampled=torch.full((n_slots, sample_len), eot, device=device),
        )

    @property
    def sample_len(self) -> int:
        return self.sampled.shape[1]

    def tensors(self) -> list[Tensor]:
        return [getattr(self, f.name) for f in fields(self)]

    def view(self, b: int) -> DecodeState:
        """What the rules read of rows [:b]."""
        return DecodeState(
            n_sampled=self.n_sampled[:b],
            last=self.last[:b],
            penultimate=self.penultimate[:b],
            last_timestamp=self.last_timestamp[:b],
            timestamps=self.timestamps[:b],
            min_tokens=self.min_tokens[:b],
        )

    def start(
        self,
        rows: slice | Tensor,
        *,
        token: Tensor,
        position: Tensor,
        timestamps: Tensor,
        temperature: Tensor,
        sample_key: Tensor,
        min_tokens: Tensor,
        limit: Tensor,
        no_speech: Tensor,
        eot: int,
    ) -> None:
        """Rows whose prompts were just prefilled: nothing sampled yet; `token` is each row's
        last prompt token, which the first step feeds again to sample after it. rows: their
        slots (written by index, so a CUDA graph may take them from a tensor)."""
        if isinstance(rows, slice):
            rows = torch.arange(rows.start, rows.stop, device=self.token.device)
        for t, value in (
            (self.token, token),
            (self.position, position),
            (self.temperature, temperature),
            (self.sample_key, sample_key),
            (self.timestamps, timestamps),
            (self.min_tokens, min_tokens),
            (self.limit, limit),
            (self.no_speech, no_speech),
        ):
            t.index_copy_(0, rows, value.to(t.dtype))
        for t, fill in (
            (self.n_sampled, 0),
            (self.last, -1),
            (self.penultimate, -1),
            (self.last_timestamp, -1),
            (self.finished, False),
            (self.sum_logprob, 0.0),
            (self.sampled, eot),
        ):
            t.index_fill_(0, rows, fill)

    def commit(
        self,
        b: int,
        chosen: Tensor,
        logprob: Tensor,
        eot: int,
        timestamp_begin: int,
        max_position: int,
    ) -> None:
        """Append each of rows [:b]'s chosen token and advance its state; finished rows stay as
        they are (they feed end-of-text until they leave)."""
        done = self.finished[:b]
        self.sum_logprob[:b] += logprob.masked_fill(done, 0.0)
        chosen = chosen.masked_fill(done, eot)
        column = self.n_sampled[:b].clamp(max=self.sample_len - 1)
        self.sampled[:b].scatter_(1, column[:, None], chosen[:, None])
        self.penultimate[:b] = torch.where(done, self.penultimate[:b], self.last[:b])
        self.last[:b] = torch.where(done, self.last[:b], chosen)
        stamp = ~done & (chosen >= timestamp_begin)
        self.last_timestamp[:b] = torch.where(stamp, chosen, self.last_timestamp[:b])
        self.n_sampled[:b] += (~done).long()
        ended = (chosen == eot) | (self.n_sampled[:b] >= self.limit[:b])
        self.finished[:b] = done | ended
        self.token[:b] = chosen
        self.position[:b] = (self.position[:b] + 1).clamp(max=max_position)

    def repeating(self, n: int) -> Tensor:
        """Rows among [:n] whose last REPEAT_RUN tokens equal the REPEAT_RUN tokens p before
        them, for some period p up to REPEAT_PERIOD (shape (n,), bool; no host sync). Rows
        held to `min_tokens` are left out until they have them: benchmarks decode a fixed
        length of random-weight output, often repetitive, and that work must not change."""
        run, periods = REPEAT_RUN, REPEAT_PERIOD
        start = self.n_sampled[:n, None] - (run + periods)  # (n, 1)
        offsets = torch.arange(run + periods, device=self.sampled.device)
        last = self.sampled[:n].gather(1, (start + offsets).clamp(min=0))  # the last run + periods
        # its run-long windows: the last is the tail, the j-th starts periods - j before it
        views = last.unfold(1, run, 1)  # (n, periods + 1, run)
        same = (views[:, :periods] == views[:, periods:]).all(dim=-1)  # (n, periods)
        repeats = (same & (start + offsets[:periods] >= 0)).any(dim=-1)
        return repeats & (self.n_sampled[:n] >= self.min_tokens[:n])

    def rows(self, n: int, eot: int, also: Tensor | None = None) -> list[FinishedRow]:
        """Rows among [:n] that finished, and those `also` marks, read back (this waits for
        the GPU): a row still decoding comes with its tokens so far and `finished` False."""
        finished = self.finished[:n]
        done = (finished if also is None else finished | also).nonzero()[:, 0]
        if len(done) == 0:
            return []
        rows, counts = done.tolist(), self.n_sampled[done].tolist()
        sampled, ended = self.sampled[done].tolist(), finished[done].tolist()
        sums, no_speech = self.sum_logprob[done].tolist(), self.no_speech[done].tolist()
        out = []
        for slot, row, count, total, ns, end in zip(
            rows, sampled, counts, sums, no_speech, ended, strict=True
        ):
            tokens = row[:count]
            if eot in tokens:
                tokens = tokens[: tokens.index(eot)]
            out.append(FinishedRow(slot, tokens, total, ns, end))
        return out
