"""Runs 30 s windows through the model over a pool of slots (`engine.slots`).

Windows join between decode steps: their encoder batch runs, then one decoder pass over their
prompts, which also projects their cross-attention K/V once into their slots; then they
decode in the same steps as everyone else, and leave as soon as they finish. A batch of mixed
lengths never waits for its longest member. `launch` queues decode steps without waiting for
the GPU, so the caller admits new windows while they run; `collect` then reads back the
windows that finished.

On CUDA the encoder (per batch bucket), the prefill of admitted windows (per batch and
prompt-width bucket) and the decode step (per live-count bucket; per key bucket too without
the Triton kernels, whose self-attention reads each row's own length) are captured as CUDA
graphs and replayed; elsewhere the same functions run eagerly. A
step's choice of tokens is one fused kernel (`engine.kernels.greedy`), which also keeps the
filtered logits of the rows that sample; such a row then draws from noise of its own
(`engine.sampling`), whatever else runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.decoding import DecodingRules, WindowResult, WindowTask, build_filters, prompt_tokens
from engine.decoding import suppressed_tokens as model_suppressed
from engine.graphs import capture
from engine.kernels.fp8 import require_fp8
from engine.kernels.greedy import GreedyRules
from engine.loader import LoadedModel
from engine.mel import N_FRAMES
from engine.sampling import draw, window_key
from engine.slots import (
    DECODE_BUCKETS,
    ENCODER_BUCKETS,
    Sequence,
    SlotPool,
    bucket,
    key_bucket,
)

HORIZON = 4  # decode steps per look at which rows finished, on CUDA (the look syncs the host)
# prompt widths a prefill is padded to on CUDA (then the longest prompt the rules allow): the
# first window of an input has 1 to 4 tokens, later ones up to half the context of previous text
PROMPT_BUCKETS = (4, 16, 64)


@dataclass(frozen=True)
class LanguageGuess:
    language: str  # ISO 639-1 (or Whisper's own code)
    probability: float


@dataclass(frozen=True)
class DecodedWindow:
    """A window that finished decoding, still holding its slot until released or restarted."""

    slot: int
    sequence: Sequence
    result: WindowResult


class Runner:
    def __init__(
        self,
        loaded: LoadedModel,
        rules: DecodingRules,
        n_slots: int,
        encoder_batch: int,
        graphs: bool,
        triton: bool,
        cross_dtype: torch.dtype | None = None,
        horizon: int | None = None,
    ):
        """graphs: capture CUDA graphs (CUDA only); triton: the Triton decode kernels.
        cross_dtype: of the cross-attention cache (default: the model's; torch.float8_e4m3fn
        halves the bytes each step reads).
        horizon: decode steps between looks at which rows finished (default: `HORIZON` on
        CUDA, 1 elsewhere). A row that ends inside the horizon idles until the look; fewer
        looks keep the GPU fed without waiting on the host."""
        self.m = loaded
        d, device, tok = loaded.dims, loaded.device, loaded.tokenizer
        if cross_dtype == torch.float8_e4m3fn:
            require_fp8(device, "a cross-attention cache")
        self.tok, self.triton, self.graphs = tok, triton, graphs
        self.max_prompt, self.sample_len = rules.sizes(d.n_text_ctx)
        text_ctx = key_bucket(self.max_prompt + self.sample_len, d.n_text_ctx)
        self.encoder_batch = encoder_batch
        self.horizon = horizon or (HORIZON if device.type == "cuda" else 1)
        # Under graphs the self-attention reads a bucket of positions covering the furthest
        # live one; eagerly too on CUDA, so graph and eager runs compare on the same shapes.
        self.pad_to_buckets = device.type == "cuda"
        self.slots = SlotPool(loaded, n_slots, text_ctx, self.sample_len, cross_dtype)
        suppress = model_suppressed(tok, loaded.suppress_tokens, rules.suppress_tokens)
        filters = build_filters(
            tok,
            d.n_vocab,
            suppress,
            rules.suppress_blank,
            rules.max_initial_timestamp,
            d.n_audio_ctx,
            device,
        )
        self.rules = GreedyRules(filters, d.n_vocab, device, triton)
        # a step's scratch: the filtered logits of sampling rows, each row's choice
        self.logits = torch.zeros(n_slots, d.n_vocab, device=device)
        self.chosen = torch.zeros(n_slots, dtype=torch.long, device=device)
        self.chosen_logprob = torch.zeros(n_slots, device=device)
        self.mel_in = torch.zeros(
            encoder_batch, d.n_mels, N_FRAMES, device=device, dtype=loaded.dtype
        )
        self.xa_out = torch.zeros(
            encoder_batch, d.n_audio_ctx, d.n_audio_state, device=device, dtype=loaded.dtype
        )
        # the windows about to start (`_stage`), and where (first slot, count)
        fields = (encoder_batch, 6 + self.max_prompt)
        self.admit_fields = torch.zeros(fields, dtype=torch.long, device=device)
        self.admit_temperature = torch.zeros(encoder_batch, device=device)
        self.admit_at = torch.zeros(2, dtype=torch.long, device=device)
        self._prompt_buckets = tuple(w for w in PROMPT_BUCKETS if w < self.max_prompt)
        self._pool = None
        self._step_graphs: dict[tuple, torch.cuda.CUDAGraph] = {}  # the forward, by shape
        self._commit_graphs: dict[int, torch.cuda.CUDAGraph] = {}  # by rows
        self._encoder_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._prefill_graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}  # by size, width
        self._later: list[tuple[int, int]] = []  # prefills `capture` left to `capture_next`
        self._launched: int | None = None  # live rows the launched steps decode

    # --- bookkeeping -------------------------------------------------------------------------

    @property
    def n_live(self) -> int:
        return self.slots.n_live

    def room(self, waiting: int) -> int:
        """How many of `waiting` windows to admit now. While others decode, wait until all of
        them, up to a full encoder batch, fit: the encoder then runs at its batch size rather
        than one window at a time."""
        want = min(waiting, self.encoder_batch)
        room = min(self.slots.free, want)
        return room if not self.slots.live or room == want else 0

    def release(self, slot: int) -> None:
        self.slots.release(slot)

    def release_where(self, owned: Callable[[Sequence], bool]) -> None:
        """Release the slots of the sequences `owned` picks (between steps: an abort)."""
        self._between_steps("release slots")
        self.slots.release_where(owned)

    def compact(self) -> None:
        self._between_steps("compact the pool")
        self.slots.compact()

    def reset(self) -> None:
        """Forget every sequence (after a failure): the pool is free again. Steps still
        running on the GPU come before whatever is queued next."""
        self._launched = None
        self.slots.clear()

    def _between_steps(self, what: str) -> None:
        if self._launched is not None:
            raise RuntimeError(f"collect the launched steps before you {what}")

    def _graph(self, fn: Callable[[], None]) -> torch.cuda.CUDAGraph:
        """Capture `fn` into a graph sharing one memory pool (engine.graphs.capture). Its
        warm-up run really executes; the decode state it advances is put back afterwards, so
        capturing mid-stream changes no sequence."""
        state = self.slots.state.tensors()
        saved = [t.clone() for t in state]
        graph = capture(fn, self._pool)
        self._pool = graph.pool()
        for t, s in zip(state, saved, strict=True):
            t.copy_(s)
        return graph

    def step_shapes(self) -> list[tuple[int, int, bool]]:
        """Every decode step shape `launch` can ask for: (rows bucket, keys bucket,
        timestamps). Sampling is no key: a graph's step keeps the filtered logits of whichever
        rows sample. Nor, with the Triton kernels, are the keys: their self-attention stops at
        each row's length, so every step reads up to `text_ctx` (tiny.en's pool of 512 slots
        then captures 41 graphs rather than 149, and loads fewer Triton specialisations)."""
        n_slots, text_ctx = self.slots.n_slots, self.slots.text_ctx
        rows = sorted({bucket(n, DECODE_BUCKETS, n_slots) for n in range(1, n_slots + 1)})
        keys = sorted({self._keys(k) for k in range(1, text_ctx + 1)})
        stamps = (True,) if self.pad_to_buckets else (False, True)  # see `launch`
        return [(b, k, t) for b in rows for k in keys for t in stamps]

    def _keys(self, furthest: int) -> int:
        """Self-attention positions a step reads to reach position `furthest - 1`."""
        text_ctx = self.slots.text_ctx
        return text_ctx if self.triton else key_bucket(furthest, text_ctx)

    @torch.inference_mode()
    def capture(self, progress: Callable[[int, int], None] | None = None) -> int:
        """Capture every graph an input without a prompt can need (every encoder batch, its
        prefill at the narrowest prompt width, every decode step shape), so that no such input
        waits for a capture or a kernel compile; return how many. progress: (done, in all).
        Without graphs, nothing to do.

        The prefills of wider prompts (sequential long-form's previous text, an initial prompt)
        are left to `capture_next`, which the worker calls while idle, or to their first use:
        captured here too, they had doubled a restart's capture (H200, tiny.en: 61 graphs in
        5.3 s, 41 in 2.0 s without them)."""
        if not self.graphs:
            return 0
        self._between_steps("capture")
        sizes = sorted(
            {
                bucket(n, ENCODER_BUCKETS, self.encoder_batch)
                for n in range(1, self.encoder_batch + 1)
            }
        )
        first, *wider = [*self._prompt_buckets, self.max_prompt]
        self._later = [(size, width) for width in wider for size in sizes]
        shapes = self.step_shapes()
        total, done = 2 * len(sizes) + len(shapes), 0
        self._unstage()
        for size in sizes:
            self._encoder_graph(size)
            self._prefill_graph(size, first)
            done += 2
            if progress:
                progress(done, total)
        for shape in shapes:
            self._step_graph(shape)
            done += 1
            if progress:
                progress(done, total)
        graphs = self._encoder_graphs, self._prefill_graphs, self._step_graphs, self._commit_graphs
        return sum(map(len, graphs))

    @torch.inference_mode()
    def capture_next(self) -> bool:
        """Capture one of the graphs `capture` left for later (between steps); False when none
        was left. One at a time, so that an input arriving meanwhile waits for one capture."""
        self._between_steps("capture")
        while self._later:
            key = self._later.pop(0)
            if key not in self._prefill_graphs:  # unless its first use came first
                self._unstage()
                self._prefill_graph(*key)
                return True
        return False

    def _unstage(self) -> None:
        """Stage no window, before a capture's warm-up runs a prefill for real: it then writes
        the spare slot alone, and reads no prompt staged earlier, whose length may pass the
        width being captured."""
        self.admit_at.zero_()
        self.admit_fields.zero_()

    def _step_graph(self, key: tuple[int, int, bool]) -> None:
        if key not in self._step_graphs:
            self._step_graphs[key] = self._graph(lambda: self._forward(*key, keep=True))
        b = key[0]
        if b not in self._commit_graphs:
            self._commit_graphs[b] = self._graph(lambda: self._commit(b))

    # --- admission ---------------------------------------------------------------------------

    def _encode_into(self, n: int) -> None:
        self.xa_out[:n] = self.m.model.encoder(self.mel_in[:n], self.triton)

    def _encoder_graph(self, size: int) -> torch.cuda.CUDAGraph:
        if size not in self._encoder_graphs:
            self._encoder_graphs[size] = self._graph(lambda: self._encode_into(size))
        return self._encoder_graphs[size]

    @torch.inference_mode()
    def encode(self, mels: torch.Tensor) -> slice:
        """Encode windows (n, n_mels, 3000) for the next free slots; return their range. Their
        first decoder pass (`detect_language` or `start`) projects their cross-attention K/V
        into those slots."""
        n, start = len(mels), self.slots.n_live
        if n > min(self.slots.free, self.encoder_batch):
            free = min(self.slots.free, self.encoder_batch)
            raise ValueError(f"{n} windows, but room for {free}")
        self.mel_in[:n] = mels
        size = bucket(n, ENCODER_BUCKETS, self.encoder_batch) if self.pad_to_buckets else n
        if self.graphs:
            self._encoder_graph(size).replay()
        else:
            self._encode_into(size)
        return slice(start, start + n)

    @torch.inference_mode()
    def detect_language(self, rows: slice) -> list[LanguageGuess]:
        """Each encoded window's most likely language, from the first step's logits."""
        codes = list(self.tok.language_ids)
        ids = torch.tensor(list(self.tok.language_ids.values()), device=self.m.device)
        tokens = torch.full((rows.stop - rows.start, 1), self.tok.sot, device=self.m.device)
        positions = torch.zeros_like(tokens)
        xa = self.xa_out[: rows.stop - rows.start]
        logits = self.m.model.decoder(
            tokens, positions, rows, self.slots.cache, 1, self.triton, xa=xa
        )
        probs = logits[:, 0, ids].float().softmax(dim=-1)
        best = probs.argmax(dim=-1)
        chosen = probs.gather(1, best[:, None])[:, 0].tolist()
        return [LanguageGuess(codes[i], p) for i, p in zip(best.tolist(), chosen, strict=True)]

    @torch.inference_mode()
    def start(self, rows: slice, sequences: list[Sequence]) -> None:
        """Prefill the prompts of encoded windows and make them live.

        The pass also projects and stores their cross-attention K/V. On CUDA it is padded to an
        encoder batch bucket and a prompt-width bucket (`PROMPT_BUCKETS`) and, with graphs,
        replayed from one captured per pair: a few graph launches instead of a decoder pass of
        a hundred eager kernels per admitted batch, which held tiny's GPU idle 29% of a
        batch-512 run (H200 profile). The padding rows write to the pool's spare slot."""
        n = len(sequences)
        if rows.start != self.slots.n_live or rows.stop - rows.start != n:
            raise ValueError("start the windows of the last encode, in order")
        width, lengths = self._stage(sequences)
        self.slots.occupy(sequences, [length - 1 for length in lengths])
        self.admit_at.copy_(self._pinned([rows.start, n]), non_blocking=True)
        size = n
        if self.pad_to_buckets:
            size = bucket(n, ENCODER_BUCKETS, self.encoder_batch)
            width = bucket(width, self._prompt_buckets, self.max_prompt)
        if self.graphs:
            self._prefill_graph(size, width).replay()
        else:
            self._prefill(size, width)

    @torch.inference_mode()
    def restart(self, slot: int, task: WindowTask, attempt: int) -> None:
        """Decode a finished window again (a hotter temperature), in the same slot."""
        sequence = self.slots.live[slot]
        sequence.task, sequence.attempt = task, attempt
        width, (length,) = self._stage([sequence])
        self.slots.next_position[slot] = length - 1
        self._prefill(1, width, slice(slot, slot + 1))

    def _pinned(self, values: list) -> torch.Tensor:
        """A host tensor that copies to the GPU without waiting for it."""
        return torch.tensor(values, pin_memory=self.m.device.type == "cuda")

    def _stage(self, sequences: list[Sequence]) -> tuple[int, list[int]]:
        """Copy the prompts and settings of windows about to start into `admit_fields` and
        `admit_temperature` (one copy each, queued behind the GPU's work); return the widest
        prompt and each one's length. A row of `admit_fields`: length, index of
        <|startoftranscript|>, timestamps, min_tokens, token limit, sampling key, then the
        prompt padded with end-of-text."""
        n_ctx, tok, text_ctx = self.m.dims.n_text_ctx, self.tok, self.slots.text_ctx
        prompts = [prompt_tokens(tok, s.task, n_ctx) for s in sequences]
        width = max(map(len, prompts))
        if width > self.max_prompt:
            raise ValueError(f"a prompt of {width} tokens; room for {self.max_prompt}")
        host = self._pinned(
            [
                [
                    len(p),
                    p.index(tok.sot),
                    s.task.timestamps,
                    s.task.min_tokens,
                    min(s.task.max_tokens or self.sample_len, self.sample_len, text_ctx - len(p)),
                    window_key(s.task.seed, s.task.seek, s.attempt),
                    *p,
                    *[tok.eot] * (self.max_prompt - len(p)),
                ]
                for p, s in zip(prompts, sequences, strict=True)
            ]
        )
        n = len(sequences)
        self.admit_fields[:n].copy_(host, non_blocking=True)
        # a padded pass reads the rows past these too: left as an earlier, wider admission
        # staged them, their lengths would index past this one's prompt width
        self.admit_fields[n:].zero_()
        temperature = self._pinned([s.task.temperature for s in sequences])
        self.admit_temperature[:n].copy_(temperature, non_blocking=True)
        return width, list(map(len, prompts))

    def _prefill(self, n: int, width: int, rows: slice | None = None) -> None:
        """Feed the first `width` tokens of the `n` staged prompts and make their rows ready to
        decode. rows None: the windows just encoded, into the slots `admit_at` names (first,
        count; rows past the count go to the spare slot), their cross-attention K/V projected
        from `xa_out`; else the range of slots to restart, whose cross K/V are in place."""
        device, tok = self.m.device, self.tok
        fields = self.admit_fields[:n]
        lengths, sot, timestamps, min_tokens, limit, sample_key = fields[:, :6].unbind(1)
        tokens = fields[:, 6 : 6 + width]
        batch = torch.arange(n, device=device)
        xa = None
        if rows is None:
            first, count = self.admit_at.unbind()
            rows = torch.where(batch < count, first + batch, self.slots.n_slots)
            xa = self.xa_out[:n]
        positions = torch.arange(width, device=device).expand(n, -1)
        # the last prompt token is fed again by the first step, which samples after it
        logits = self.m.model.decoder(
            tokens, positions, rows, self.slots.cache, width, self.triton, xa=xa
        )
        self.slots.state.start(
            rows,
            token=tokens[batch, lengths - 1],
            position=lengths - 1,
            timestamps=timestamps.bool(),
            temperature=self.admit_temperature[:n],
            sample_key=sample_key,
            min_tokens=min_tokens,
            limit=limit,
            no_speech=logits[batch, sot].float().softmax(-1)[:, tok.no_speech],
            eot=tok.eot,
        )

    def _prefill_graph(self, size: int, width: int) -> torch.cuda.CUDAGraph:
        if (size, width) not in self._prefill_graphs:
            graph = self._graph(lambda: self._prefill(size, width))
            self._prefill_graphs[size, width] = graph
        return self._prefill_graphs[size, width]

    # --- decoding ----------------------------------------------------------------------------

    def _forward(self, b: int, n_keys: int | None, timestamps: bool, keep: bool) -> None:
        """Each of rows [:b]'s greedy next token and its log-probability, under Whisper's rules;
        with `keep`, the rows that sample also keep the filtered logits they draw from."""
        state = self.slots.state
        logits = self.m.model.decoder(
            state.token[:b, None],
            state.position[:b, None],
            slice(0, b),
            self.slots.cache,
            n_keys,
            self.triton,
        )[:, -1]
        kept = (self.logits[:b], state.temperature[:b]) if keep else None
        chosen, logprob = self.rules.select(logits, state.view(b), timestamps, kept)
        self.chosen[:b], self.chosen_logprob[:b] = chosen, logprob

    def _draw(self, sampling_rows: list[int]) -> None:
        """Replace the greedy choice of the sampling rows with a draw at their temperature, from
        their own noise: the step's other rows change nothing, and cost nothing."""
        device = self.m.device
        rows = self._pinned(sampling_rows).to(device, non_blocking=True)
        state, logits = self.slots.state, self.logits[rows]
        keys, steps = state.sample_key[rows], state.n_sampled[rows]
        drawn = draw(logits, state.temperature[rows], keys, steps)
        self.chosen[rows] = drawn
        self.chosen_logprob[rows] = logits.log_softmax(dim=-1).gather(1, drawn[:, None])[:, 0]

    def _commit(self, b: int) -> None:
        self.slots.state.commit(
            b,
            self.chosen[:b],
            self.chosen_logprob[:b],
            self.tok.eot,
            self.tok.timestamp_begin,
            self.slots.text_ctx - 1,
        )

    @torch.inference_mode()
    def launch(self) -> None:
        """Queue decode steps (the horizon's, or one while a row samples) for every live
        sequence, without waiting for the GPU. Until `collect`, the caller may admit windows
        into free slots (`encode`, `start`): their work queues behind the steps, so the host
        prepares it while the GPU decodes."""
        self._between_steps("launch more")
        live = self.slots.live
        n = len(live)
        if n == 0:
            return
        self._launched = n
        # On CUDA every step applies the timestamp rules, each row by its own flag (the fused
        # kernel skips their pass for a row without), and keeps the filtered logits of the rows
        # that sample: one graph serves every kind of row, a quarter as many to capture before
        # the worker is ready. The CPU skips the rules when no row predicts timestamps.
        timestamps = self.pad_to_buckets or any(s.task.timestamps for s in live)
        sampling_rows = [i for i, s in enumerate(live) if s.task.temperature > 0]
        sampling = bool(sampling_rows)
        steps = 1 if sampling else self.horizon
        b, n_keys = n, None
        if self.pad_to_buckets:
            b = bucket(n, DECODE_BUCKETS, self.slots.n_slots)
            n_keys = self._keys(max(self.slots.next_position) + steps)  # the last step's
        key = (b, n_keys, timestamps)
        if self.graphs:
            self._step_graph(key)
        for _ in range(steps):
            if self.graphs:
                self._step_graphs[key].replay()
            else:
                self._forward(*key, keep=sampling)
            if sampling:
                self._draw(sampling_rows)
            if self.graphs:
                self._commit_graphs[b].replay()
            else:
                self._commit(b)
        last = self.slots.text_ctx - 1
        self.slots.next_position[:n] = [min(p + steps, last) for p in self.slots.next_position[:n]]

    @torch.inference_mode()
    def collect(self) -> list[DecodedWindow]:
        """Wait for the launched steps; return the windows among them that finished, and those
        ended here because their text so far already fails their compression check.

        That check bounds the work of a window caught repeating itself (issue 12: a prompt of
        "ha " * 333 made every try decode 223 tokens of "ha"). It runs only at this look, where
        the host waits anyway, and only for rows whose last tokens repeat (`repeating`, on the
        device): the text so far, not the tail alone, must fail the threshold, as the whole
        window's text does in openai-whisper's rule once a repetition has taken it over."""
        n, self._launched = self._launched, None
        if n is None:
            return []
        live, state = self.slots.live, self.slots.state
        checked = any(s.task.max_compression_ratio is not None for s in live[:n])
        decoded, ended = [], []
        for row in state.rows(n, self.tok.eot, state.repeating(n) if checked else None):
            sequence = live[row.slot]
            result = WindowResult.of(row, sequence.task.temperature, self.tok)
            if not row.finished:
                limit = sequence.task.max_compression_ratio
                if limit is None or result.compression_ratio <= limit:
                    continue  # repeating, not (yet) too much: it decodes on
                ended.append(row.slot)
            decoded.append(DecodedWindow(row.slot, sequence, result))
        if ended:  # like any finished row, it feeds end-of-text until it leaves its slot
            state.finished[torch.tensor(ended, device=state.finished.device)] = True
        return decoded
