"""Continuous batching of 30 s windows over a pool of cache slots.

The only module that knows sequences and slots. Live sequences are packed at the front of the
pool (slots 0 .. n_live - 1), so a decode step is the model run on the range `[:bucket]` of
every buffer, and every cache read is a view. Between steps, finished sequences leave (the
last live sequence moves into the hole) and new windows join: their encoder batch runs, their
cross-attention K/V are projected once into their slots, their prompts are prefilled; then
they decode in the same steps as everyone else. A batch of mixed lengths never waits for its
longest member.

On CUDA the encoder (per batch bucket) and the decode step (per live-count bucket) are
captured as CUDA graphs and replayed; elsewhere the same functions run eagerly. A step's
choice of tokens is one fused kernel (`engine.kernels.greedy`) unless some row samples.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.decoding import DecodeState, LogitFilter, WindowResult, WindowTask, compression_ratio
from engine.decoding import prompt_tokens as build_prompt
from engine.kernels.greedy import GreedyRules
from engine.loader import LoadedModel
from engine.mel import N_FRAMES
from engine.model import KVCache

DECODE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256, 320, 384, 448, 512)
ENCODER_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
KEY_STEP = 64  # self-attention reads positions in buckets of this many
HORIZON = 4  # decode steps per look at which rows finished, on CUDA (the look syncs the host)


def slot_bytes(loaded: LoadedModel, cross_dtype: torch.dtype | None = None) -> int:
    """Cache bytes one slot takes at most: self- (all n_text_ctx positions) and cross-attention
    K/V of every layer."""
    d = loaded.dims
    cross_size = (cross_dtype or loaded.dtype).itemsize
    per_position = 2 * d.n_text_layer * d.n_text_state
    return per_position * (d.n_text_ctx * loaded.dtype.itemsize + d.n_audio_ctx * cross_size)


@dataclass
class Sequence:
    """One window being decoded in a slot."""

    owner: object  # what the caller gets back with the result
    task: WindowTask
    attempt: int = 0  # index into the caller's temperatures
    min_tokens: int = 0  # end-of-text is suppressed before this many tokens (benchmarks)
    max_tokens: int | None = None  # at most this many (default: the scheduler's sample_len)


class Scheduler:
    def __init__(
        self,
        loaded: LoadedModel,
        filters: list[LogitFilter],
        n_slots: int,
        sample_len: int,
        encoder_batch: int = 16,
        graphs: bool | None = None,
        generator: torch.Generator | None = None,
        full_keys: bool | None = None,
        max_prompt: int | None = None,
        cross_dtype: torch.dtype | None = None,
        horizon: int | None = None,
    ):
        """max_prompt: the longest prompt a window will have (default: half the text context,
        room for previous text); with `sample_len` it sizes the self-attention cache.
        cross_dtype: of the cross-attention cache (default: the model's; torch.float8_e4m3fn
        halves the bytes each step reads).
        horizon: decode steps between looks at which rows finished (default: `HORIZON` on
        CUDA, 1 elsewhere). A row that ends inside the horizon idles until the look; fewer
        looks keep the GPU fed without waiting on the host."""
        self.m = loaded
        d, device = loaded.dims, loaded.device
        self.rules = GreedyRules(filters, d.n_vocab, device)
        self.sample_len, self.generator = sample_len, generator
        self.n_slots, self.encoder_batch = n_slots, encoder_batch
        self.graphs = device.type == "cuda" if graphs is None else graphs
        self.horizon = horizon or (HORIZON if device.type == "cuda" else 1)
        # Under graphs the self-attention reads a bucket of positions (KEY_STEP multiples)
        # covering the furthest live one; eagerly, just up to it. `full_keys` forces buckets,
        # to compare graph and eager on the same shapes.
        self.pad_to_buckets = self.graphs if full_keys is None else full_keys
        self.tok = loaded.tokenizer
        self.max_prompt = max_prompt = max_prompt or d.n_text_ctx // 2 + 4
        text_ctx = min(d.n_text_ctx, -(-(max_prompt + sample_len) // KEY_STEP) * KEY_STEP)
        self.text_ctx = text_ctx
        if cross_dtype == torch.float8_e4m3fn and device.type == "cuda":
            if torch.cuda.get_device_capability(device) < (8, 9):
                raise ValueError("an fp8 cross-attention cache needs compute capability 8.9+")
        self.cache = KVCache.allocate(d, n_slots, device, loaded.dtype, text_ctx, cross_dtype)

        def slots(fill, dtype=torch.long):
            return torch.full((n_slots,), fill, dtype=dtype, device=device)

        self.token, self.position, self.n_sampled = slots(0), slots(0), slots(0)
        self.last, self.penultimate, self.last_timestamp = slots(-1), slots(-1), slots(-1)
        self.timestamps = slots(False, torch.bool)
        self.finished = slots(True, torch.bool)
        self.temperature = slots(0.0, torch.float32)
        self.sampling = slots(False, torch.bool)
        self.min_tokens, self.limit = slots(0), slots(sample_len)
        self.sum_logprob, self.no_speech = slots(0.0, torch.float32), slots(0.0, torch.float32)
        self.sampled = torch.full((n_slots, sample_len), self.tok.eot, device=device)
        self.logits = torch.zeros(n_slots, d.n_vocab, device=device)  # filtered, when sampling
        self.chosen, self.chosen_logprob = slots(0), slots(0.0, torch.float32)
        # every per-slot tensor: what moves with a sequence, and what graph capture restores
        self._per_slot = (
            self.token,
            self.position,
            self.n_sampled,
            self.last,
            self.penultimate,
            self.last_timestamp,
            self.timestamps,
            self.finished,
            self.temperature,
            self.sampling,
            self.min_tokens,
            self.limit,
            self.sum_logprob,
            self.no_speech,
            self.sampled,
        )
        self.live: list[Sequence | None] = []
        self.next_position: list[int] = []  # host copy of each live row's fed position

        self.mel_in = torch.zeros(
            encoder_batch, d.n_mels, N_FRAMES, device=device, dtype=loaded.dtype
        )
        self.xa_out: torch.Tensor | None = None
        self._pool = None
        self._step_graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph]] = {}
        self._launched: int | None = None  # live rows the launched steps decode
        self._encoder_graphs: dict[int, torch.cuda.CUDAGraph] = {}

    # --- bookkeeping -------------------------------------------------------------------------

    @property
    def n_live(self) -> int:
        return len(self.live)

    @property
    def free(self) -> int:
        return self.n_slots - len(self.live)

    def room(self, waiting: int) -> int:
        """How many of `waiting` windows to admit now. While others decode, wait until all of
        them, up to a full encoder batch, fit: the encoder then runs at its batch size rather
        than one window at a time."""
        want = min(waiting, self.encoder_batch)
        room = min(self.free, want)
        return room if not self.live or room == want else 0

    def _state(self, b: int) -> DecodeState:
        return DecodeState(
            n_sampled=self.n_sampled[:b],
            last=self.last[:b],
            penultimate=self.penultimate[:b],
            last_timestamp=self.last_timestamp[:b],
            timestamps=self.timestamps[:b],
            min_tokens=self.min_tokens[:b],
        )

    def _graph(self, fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """Capture `fn` into a graph sharing one memory pool.

        The warm-up runs that capture needs really execute; the decode state they advance is
        put back afterwards, so capturing mid-stream changes no sequence. Other threads may use
        the GPU meanwhile (a worker's job threads take a first pass over long audio there), so
        only this thread's own unsafe calls may break the capture ("thread_local").
        """
        saved = [t.clone() for t in self._per_slot]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            fn()
        self._pool = graph.pool()
        for t, s in zip(self._per_slot, saved, strict=True):
            t.copy_(s)
        return graph

    # --- encoder -----------------------------------------------------------------------------

    def _encode_into(self, n: int) -> None:
        self.xa_out[:n] = self.m.model.encoder(self.mel_in[:n])

    @torch.inference_mode()
    def encode(self, mels: torch.Tensor) -> slice:
        """Encode windows (n, n_mels, 3000) into the next free slots; return their range."""
        n = len(mels)
        if n > min(self.free, self.encoder_batch):
            raise ValueError(f"{n} windows, but room for {min(self.free, self.encoder_batch)}")
        rows = slice(self.n_live, self.n_live + n)
        self.mel_in[:n] = mels
        if self.xa_out is None:
            d = self.m.dims
            self.xa_out = torch.zeros(
                self.encoder_batch,
                d.n_audio_ctx,
                d.n_audio_state,
                device=self.m.device,
                dtype=self.m.dtype,
            )
        bucket = n
        if self.pad_to_buckets:
            bucket = ENCODER_BUCKETS[bisect.bisect_left(ENCODER_BUCKETS, n)]
            bucket = min(bucket, self.encoder_batch)
        if self.graphs:
            if bucket not in self._encoder_graphs:
                self._encoder_graphs[bucket] = self._graph(lambda: self._encode_into(bucket))
            self._encoder_graphs[bucket].replay()
        else:
            self._encode_into(bucket)
        self.m.model.project_cross_kv(self.xa_out[:n], rows, self.cache)
        return rows

    @torch.inference_mode()
    def detect_language(self, rows: slice) -> tuple[list[str], list[float]]:
        """Most likely language of each encoded window, from the first step's logits."""
        codes = list(self.tok.language_ids)
        ids = torch.tensor(list(self.tok.language_ids.values()), device=self.m.device)
        n = rows.stop - rows.start
        tokens = torch.full((n, 1), self.tok.sot, device=self.m.device)
        logits = self.m.model.decoder(tokens, torch.zeros_like(tokens), rows, self.cache, 1)
        probs = logits[:, 0, ids].float().softmax(dim=-1)
        best = probs.argmax(dim=-1)
        return [codes[i] for i in best.tolist()], probs.gather(1, best[:, None])[:, 0].tolist()

    # --- admission ---------------------------------------------------------------------------

    @torch.inference_mode()
    def start(self, rows: slice, sequences: list[Sequence]) -> None:
        """Prefill the prompts of encoded windows and make them live."""
        if rows.start != self.n_live or rows.stop - rows.start != len(sequences):
            raise ValueError("start the windows of the last encode, in order")
        self.live.extend(sequences)
        self.next_position.extend([0] * len(sequences))
        self._prefill(rows, sequences)

    def _prefill(self, rows: slice, sequences: list[Sequence]) -> None:
        device, n_ctx = self.m.device, self.m.dims.n_text_ctx
        prompts = [build_prompt(self.tok, s.task, n_ctx) for s in sequences]
        width = max(len(p) for p in prompts)
        # every row's numbers in one host tensor, copied once (a copy from pageable memory
        # would wait for the GPU each time)
        host = torch.tensor(
            [
                [
                    len(p),
                    p.index(self.tok.sot),
                    s.task.timestamps,
                    s.min_tokens,
                    min(s.max_tokens or self.sample_len, self.sample_len, self.text_ctx - len(p)),
                    *p,
                    *[self.tok.eot] * (width - len(p)),
                ]
                for p, s in zip(prompts, sequences, strict=True)
            ],
            pin_memory=device.type == "cuda",
        )
        fields = host.to(device, non_blocking=True)
        lengths, sot, timestamps, min_tokens, limit = fields[:, :5].unbind(1)
        tokens = fields[:, 5:]
        temperature = torch.tensor(
            [s.task.temperature for s in sequences], pin_memory=device.type == "cuda"
        ).to(device, non_blocking=True)
        positions = torch.arange(width, device=device).expand(len(prompts), -1)
        # the last prompt token is fed again by the first step, which samples after it;
        # n_keys given, not read off the positions (that would wait for the GPU)
        logits = self.m.model.decoder(tokens, positions, rows, self.cache, width)
        batch = torch.arange(len(prompts), device=device)
        self.no_speech[rows] = logits[batch, sot].float().softmax(-1)[:, self.tok.no_speech]
        self.token[rows] = tokens[batch, lengths - 1]
        self.position[rows] = lengths - 1
        self.next_position[rows] = [len(p) - 1 for p in prompts]
        self.n_sampled[rows] = 0
        self.last[rows], self.penultimate[rows], self.last_timestamp[rows] = -1, -1, -1
        self.finished[rows] = False
        self.sum_logprob[rows] = 0.0
        self.sampled[rows] = self.tok.eot
        self.temperature[rows] = temperature
        self.sampling[rows] = temperature > 0
        self.timestamps[rows] = timestamps.bool()
        self.min_tokens[rows] = min_tokens
        self.limit[rows] = limit

    @torch.inference_mode()
    def restart(self, index: int, task: WindowTask, attempt: int) -> None:
        """Decode a finished window again (a hotter temperature), in the same slot."""
        sequence = self.live[index]
        sequence.task, sequence.attempt = task, attempt
        self._prefill(slice(index, index + 1), [sequence])

    def reset(self) -> None:
        """Forget every sequence (after a failed transcription): the pool is free again. Steps
        still running on the GPU come before whatever is queued next."""
        self._launched = None
        self.live.clear()
        self.next_position.clear()

    def release(self, index: int) -> None:
        self.live[index] = None

    def compact(self) -> None:
        """Fill the holes released sequences left with the last live ones, all moves in one
        gather per buffer and layer."""
        if self._launched is not None:
            raise RuntimeError("collect the launched steps before compacting")

        def drop_tail() -> None:
            while self.live and self.live[-1] is None:
                self.live.pop()
                self.next_position.pop()

        drop_tail()
        sources, holes = [], []
        for hole in [i for i, s in enumerate(self.live) if s is None]:
            if hole >= len(self.live):
                break
            sources.append(len(self.live) - 1)
            holes.append(hole)
            self.live[hole] = self.live.pop()
            self.next_position[hole] = self.next_position.pop()
            drop_tail()
        if holes:
            src = torch.tensor(sources, device=self.m.device)
            dst = torch.tensor(holes, device=self.m.device)
            # a layer at a time: the gathered copy of every layer at once would be a
            # transient of 246 MB per moved slot for large-v3
            for t in (self.cache.self_k, self.cache.self_v, self.cache.cross_k, self.cache.cross_v):
                for layer in t:
                    layer[dst] = layer[src]
            for t in self._per_slot:
                t[dst] = t[src]

    # --- decoding ----------------------------------------------------------------------------

    def _forward(self, b: int, n_keys: int | None, timestamps: bool, sampling: bool) -> None:
        """Each of rows [:b]'s greedy next token and its log-probability, under Whisper's rules;
        when some row samples, also the filtered logits it draws from."""
        logits = self.m.model.decoder(
            self.token[:b, None], self.position[:b, None], slice(0, b), self.cache, n_keys
        )[:, -1]
        state = self._state(b)
        if sampling:
            logits = self.rules.apply(logits, state, timestamps)
            self.logits[:b] = logits
            chosen, logprob = self.rules.choose(logits)
        else:
            chosen, logprob = self.rules.select(logits, state, timestamps)
        self.chosen[:b], self.chosen_logprob[:b] = chosen, logprob

    def _draw(self, n: int) -> None:
        """Replace the greedy choice of sampling rows with a draw at their temperature."""
        logits, sampling = self.logits[:n], self.sampling[:n]
        scaled = logits / self.temperature[:n, None].clamp(min=1e-6)
        drawn = torch.multinomial(scaled.softmax(dim=-1), 1, generator=self.generator)[:, 0]
        logprob = logits.log_softmax(dim=-1).gather(1, drawn[:, None])[:, 0]
        self.chosen[:n] = torch.where(sampling, drawn, self.chosen[:n])
        self.chosen_logprob[:n] = torch.where(sampling, logprob, self.chosen_logprob[:n])

    def _commit(self, b: int) -> None:
        """Append each row's chosen token and advance its state."""
        chosen, done = self.chosen[:b], self.finished[:b]
        self.sum_logprob[:b] += self.chosen_logprob[:b].masked_fill(done, 0.0)
        chosen = chosen.masked_fill(done, self.tok.eot)
        column = self.n_sampled[:b].clamp(max=self.sample_len - 1)
        self.sampled[:b].scatter_(1, column[:, None], chosen[:, None])
        self.penultimate[:b] = torch.where(done, self.penultimate[:b], self.last[:b])
        self.last[:b] = torch.where(done, self.last[:b], chosen)
        stamp = ~done & (chosen >= self.tok.timestamp_begin)
        self.last_timestamp[:b] = torch.where(stamp, chosen, self.last_timestamp[:b])
        self.n_sampled[:b] += (~done).long()
        ended = (chosen == self.tok.eot) | (self.n_sampled[:b] >= self.limit[:b])
        self.finished[:b] = done | ended
        self.token[:b] = chosen
        self.position[:b] = (self.position[:b] + 1).clamp(max=self.text_ctx - 1)

    def _bucket(self, n: int) -> int:
        i = bisect.bisect_left(DECODE_BUCKETS, n)
        return min(DECODE_BUCKETS[i] if i < len(DECODE_BUCKETS) else self.n_slots, self.n_slots)

    @torch.inference_mode()
    def launch(self) -> None:
        """Queue decode steps (the horizon's, or one while a row samples) for every live
        sequence, without waiting for the GPU. Until `collect`, the caller may admit windows
        into free slots (`encode`, `start`): their work queues behind the steps, so the host
        prepares it while the GPU decodes."""
        if self._launched is not None:
            raise RuntimeError("collect the steps already launched first")
        n = self.n_live
        if n == 0:
            return
        self._launched = n
        timestamps = any(s.task.timestamps for s in self.live)
        sampling = any(s.task.temperature > 0 for s in self.live)
        steps = 1 if sampling else self.horizon
        b, n_keys = n, None
        if self.pad_to_buckets:
            b = self._bucket(n)
            furthest = max(self.next_position) + steps  # keys the last step reads
            n_keys = min(-(-furthest // KEY_STEP) * KEY_STEP, self.text_ctx)
        key = (b, n_keys, timestamps, sampling)
        if self.graphs and key not in self._step_graphs:
            self._step_graphs[key] = (
                self._graph(lambda: self._forward(*key)),
                self._graph(lambda: self._commit(b)),
            )
        for _ in range(steps):
            if self.graphs:
                self._step_graphs[key][0].replay()
            else:
                self._forward(*key)
            if sampling:
                self._draw(n)
            if self.graphs:
                self._step_graphs[key][1].replay()
            else:
                self._commit(b)
        self.next_position[:n] = [min(p + steps, self.text_ctx - 1) for p in self.next_position[:n]]

    @torch.inference_mode()
    def collect(self) -> list[tuple[int, Sequence, WindowResult]]:
        """Wait for the launched steps; return the sequences among them that finished."""
        n, self._launched = self._launched, None
        return self._finished(n) if n is not None else []

    def _finished(self, n: int) -> list[tuple[int, Sequence, WindowResult]]:
        done = self.finished[:n].nonzero()[:, 0]
        if len(done) == 0:
            return []
        rows = done.tolist()
        counts = self.n_sampled[done].tolist()
        sampled = self.sampled[done].tolist()
        sums, no_speech = self.sum_logprob[done].tolist(), self.no_speech[done].tolist()
        out = []
        for i, row, count, total, ns in zip(rows, sampled, counts, sums, no_speech, strict=True):
            tokens = row[:count]
            if self.tok.eot in tokens:
                tokens = tokens[: tokens.index(self.tok.eot)]
            text = self.tok.decode(tokens)
            sequence = self.live[i]
            out.append(
                (
                    i,
                    sequence,
                    WindowResult(
                        tokens=tokens,
                        text=text,
                        avg_logprob=total / (len(tokens) + 1),
                        no_speech_prob=ns,
                        compression_ratio=compression_ratio(text.strip()),
                        temperature=sequence.task.temperature,
                    ),
                )
            )
        return out
