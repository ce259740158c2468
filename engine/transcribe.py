"""Transcribe audio or spectrograms of any length with a loaded Whisper model.

Every input becomes a request (`engine.longform`) that hands out 30 s windows. A `Stream`
feeds the windows of all its requests to one continuous-batching scheduler
(`engine.scheduler`): whenever slots are free, ready windows join the running batch; whenever
a window finishes, its request takes the result and may hand out its next window at once.
`transcribe_batch` runs a stream over a fixed list of inputs; a server keeps one open and adds
inputs as they arrive (`worker.batching`).
"""

from __future__ import annotations

import functools
import io
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.audio import Audio
from engine.decoding import build_filters, suppressed_tokens
from engine.inputs import (
    MAX_SPECTROGRAM_FRAMES,
    Prepared,
    SpectrogramError,
    open_audio,
    sources,
    spectrogram_source,
)
from engine.loader import LoadedModel, load_model
from engine.longform import (
    ChunkedRequest,
    OptionsError,
    Request,
    SequentialRequest,
    TranscriptionOptions,
    Window,
)
from engine.result import Transcription
from engine.scheduler import Scheduler, slot_bytes
from engine.scheduler import Sequence as SchedSequence

# bytes (an audio file or a .npy spectrogram), decoded 16 kHz samples (1-D), or a
# spectrogram array (2-D or 3-D)
Input = bytes | np.ndarray | Audio
Progress = Callable[[int, float, float], None]  # (input index, seconds done, seconds in all)


class Transcriber:
    """One model on one device, with its pool of cache slots."""

    def __init__(
        self,
        loaded: LoadedModel,
        n_slots: int | None = None,
        encoder_batch: int | None = None,
        graphs: bool | None = None,
        cross_dtype: torch.dtype | None = None,
    ):
        """graphs: capture CUDA graphs (default: on CUDA); False runs the same steps eagerly.
        cross_dtype: of the cross-attention cache (default: the model's; or torch.float8_e4m3fn)
        """
        self.loaded = loaded
        self.graphs, self.cross_dtype = graphs, cross_dtype
        self.n_slots = n_slots or slots_for(loaded, cross_dtype=cross_dtype)
        self.encoder_batch = min(encoder_batch or 16, self.n_slots)
        self.max_spectrogram_frames = MAX_SPECTROGRAM_FRAMES
        self._schedulers: dict[tuple, Scheduler] = {}

    @classmethod
    def load(
        cls,
        source: str,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        cache_dir: Path | None = None,
        name: str | None = None,
    ) -> Transcriber:
        return cls(load_model(source, device, dtype, cache_dir, name))

    def shrink(self) -> None:
        """Halve the slot pool (after running out of device memory); the next transcription
        allocates the smaller pool and captures its graphs again."""
        self.n_slots = max(1, self.n_slots // 2)
        self.encoder_batch = min(self.encoder_batch, self.n_slots)
        self._schedulers.clear()
        if self.loaded.device.type == "cuda":
            torch.cuda.empty_cache()

    def prepare(self, item: Input) -> Prepared:
        """Validate and decode one input, on the calling thread (CPU work: run many at once);
        raises AudioError or SpectrogramError. Clips of up to 30 s come back as samples, to get
        their log-mel together when they join a stream."""
        m = self.loaded
        if isinstance(item, bytes) and item[:6] == b"\x93NUMPY":
            try:
                item = np.load(io.BytesIO(item), allow_pickle=False)
            except ValueError as e:
                raise SpectrogramError(f"not a readable .npy array ({e})") from e
        if isinstance(item, np.ndarray) and item.ndim >= 2:
            n_mels, frames = m.dims.n_mels, self.max_spectrogram_frames
            return spectrogram_source(item, n_mels, m.device, frames)
        return open_audio(Audio(item) if isinstance(item, bytes) else item, m.dims.n_mels, m.device)

    def _key(self, options: TranscriptionOptions) -> tuple[tuple, int]:
        """(the decoding rules a scheduler is built for, the prompt length it needs)"""
        m = self.loaded
        # a prompt of previous text (up to half the context) needs a longer self-attention
        # cache than the start-of-transcript tokens alone
        context = options.initial_prompt or (
            options.mode == "sequential" and options.condition_on_previous_text
        )
        rules = (
            options.suppress_blank,
            options.suppress_tokens,
            options.max_initial_timestamp,
            options.sample_len,
        )
        return rules, m.dims.n_text_ctx // 2 + 4 if context else 4

    def scheduler(self, options: TranscriptionOptions, any_prompt: bool = False) -> Scheduler:
        """The scheduler for these options' decoding rules (kept: its CUDA graphs are too);
        any_prompt: room for a prompt of previous text whatever the options say."""
        m = self.loaded
        rules, max_prompt = self._key(options)
        max_prompt = m.dims.n_text_ctx // 2 + 4 if any_prompt else max_prompt
        if (rules, max_prompt) not in self._schedulers:
            self._schedulers.clear()  # one pool of slots at a time
            suppress = suppressed_tokens(m.tokenizer, m.suppress_tokens, options.suppress_tokens)
            filters = build_filters(
                m.tokenizer,
                m.dims.n_vocab,
                suppress,
                options.suppress_blank,
                options.max_initial_timestamp,
                m.dims.n_audio_ctx,
                m.device,
            )
            self._schedulers[rules, max_prompt] = Scheduler(
                m,
                filters,
                self.n_slots,
                options.sample_len or m.dims.n_text_ctx // 2,
                self.encoder_batch,
                graphs=self.graphs,
                generator=torch.Generator(m.device),
                full_keys=m.device.type == "cuda",
                max_prompt=max_prompt,
                cross_dtype=self.cross_dtype,
            )
        return self._schedulers[rules, max_prompt]

    def stream(self, rules: TranscriptionOptions | None = None) -> Stream:
        """A stream of inputs that join and leave one running batch, each with its own options
        (these decoding rules, any task, language, mode or prompt): what a server runs."""
        rules = (rules or TranscriptionOptions()).verified(self.loaded.tokenizer)
        sched = self.scheduler(rules, any_prompt=True)
        sched.generator.manual_seed(rules.seed)
        return Stream(self, sched, self._key(rules)[0])

    def transcribe(
        self,
        item: Input,
        options: TranscriptionOptions | None = None,
        progress: Progress | None = None,
    ) -> Transcription:
        return self.transcribe_batch([item], options, progress)[0]

    @torch.inference_mode()
    def transcribe_batch(
        self,
        items: Sequence[Input],
        options: TranscriptionOptions | None = None,
        progress: Progress | None = None,
    ) -> list[Transcription]:
        m = self.loaded
        options = (options or TranscriptionOptions()).verified(m.tokenizer)
        prepared = [self.prepare(item) for item in items]
        sched = self.scheduler(options)
        sched.generator.manual_seed(options.seed)
        stream = Stream(self, sched, self._key(options)[0])
        stream.add(
            [
                Submission(i, p, options, progress=progress and functools.partial(progress, i))
                for i, p in enumerate(prepared)
            ]
        )
        results: dict[int, Transcription] = {}
        try:
            while stream.busy:
                results.update(stream.step())
        except BaseException:
            sched.reset()  # the next transcription starts with a free pool
            raise
        return [results[i] for i in range(len(items))]


@dataclass(eq=False)
class Submission:
    """One input for a stream: `owner` comes back with its transcription."""

    owner: Hashable
    item: Prepared  # from Transcriber.prepare
    options: TranscriptionOptions
    urgent: bool = False  # admitted ahead of the others (interactive work before bulk)
    progress: Callable[[float, float], None] | None = None  # (seconds done, seconds in all)
    request: Request | None = None


class Stream:
    """Continuous batching across inputs: `add` them as they come, call `step` while `busy`;
    each step launches decode steps, admits ready windows (urgent inputs first) while the GPU
    runs them, and hands back the inputs whose last window it decoded. Temperature fallback
    re-decodes only the window that needs it, in its slot, from the K/V already projected."""

    def __init__(self, transcriber: Transcriber, sched: Scheduler, rules: tuple):
        self.transcriber, self.sched, self.rules = transcriber, sched, rules
        self.live: list[Submission] = []  # not done: urgent ones first, then by arrival
        self._done: list[Submission] = []  # done without a window to decode (empty input)
        self._waiting: list[tuple[Submission, Window]] = []
        # host seconds spent admitting windows (log-mel, encoder, prefill) and in decode steps,
        # and windows encoded; on CUDA the work is asynchronous and shows where the host waits
        # for it (mostly in decode steps, which read their tokens back)
        self.stats = {"encode_s": 0.0, "decode_s": 0.0, "windows": 0}

    @property
    def busy(self) -> bool:
        return bool(self.live or self._done)

    @torch.inference_mode()
    def add(self, submissions: Sequence[Submission]) -> None:
        """Start these inputs; clips of up to 30 s get their log-mel in one pass."""
        t = self.transcriber
        for s in submissions:
            rules, max_prompt = t._key(s.options)
            if rules != self.rules or max_prompt > self.sched.max_prompt:
                raise OptionsError("these options need other decoding rules than the stream's")
        opened = sources([s.item for s in submissions], t.loaded.dims.n_mels, t.loaded.device)
        for s, source in zip(submissions, opened, strict=True):
            kind = SequentialRequest if s.options.mode == "sequential" else ChunkedRequest
            s.request = kind(source, s.options, t.loaded.tokenizer)
            if s.request.done:
                self._done.append(s)
            elif s.urgent:
                self.live.insert(sum(x.urgent for x in self.live), s)
            else:
                self.live.append(s)

    @torch.inference_mode()
    def step(self) -> list[tuple[Hashable, Transcription]]:
        sched = self.sched
        finished, self._done = self._done, []
        start = time.perf_counter()
        sched.launch()  # the GPU decodes while the host admits ready windows
        launched = time.perf_counter()
        self._admit()
        admitted = time.perf_counter()
        if sched.n_live == 0 and self.live:
            raise RuntimeError("no window is ready, yet some inputs are not done")
        collected = sched.collect()
        self.stats["encode_s"] += admitted - launched
        self.stats["decode_s"] += launched - start + time.perf_counter() - admitted
        for index, sequence, result in collected:
            s, window = sequence.owner
            r, options = s.request, s.options
            retry = sequence.attempt + 1
            if options.needs_fallback(result) and retry < len(options.temperature):
                sched.restart(index, r.task(window, options.temperature[retry]), retry)
                continue
            sched.release(index)
            r.accept(window, result)
            if s.progress:
                s.progress(r.done_seconds, r.source.duration)
            if r.done:
                self.live.remove(s)
                finished.append(s)
        sched.compact()
        return [(s.owner, self._result(s)) for s in finished]

    def _admit(self) -> None:
        """Admit ready windows (kept in `_waiting` until they fit) as one encoder batch."""
        sched, waiting = self.sched, self._waiting
        for s in self.live:
            for window in s.request.ready() if len(waiting) < sched.encoder_batch else ():
                waiting.append((s, window))
                if len(waiting) == sched.encoder_batch:
                    break
        room = sched.room(len(waiting))
        if not room:
            return
        batch, waiting[:] = waiting[:room], waiting[room:]
        mels = torch.stack([w.mel for _, w in batch]).to(self.transcriber.loaded.dtype)
        rows = sched.encode(mels)
        self.stats["windows"] += len(batch)
        if any(s.request.language is None for s, _ in batch):
            codes, probs = sched.detect_language(rows)
            for (s, _), code, prob in zip(batch, codes, probs, strict=True):
                if s.request.language is None:  # a request's first window decides
                    s.request.language, s.request.language_probability = code, prob
        sequences = [
            SchedSequence((s, w), s.request.task(w, s.options.temperature[0])) for s, w in batch
        ]
        sched.start(rows, sequences)

    def _result(self, s: Submission) -> Transcription:
        r, loaded = s.request, self.transcriber.loaded
        tokens = [t for seg in r.segments for t in seg.tokens]
        return Transcription(
            text=loaded.tokenizer.decode(tokens).strip(),
            language=r.language or "en",
            language_probability=r.language_probability,
            duration=round(r.source.duration, 3),
            segments=r.segments,
            model=loaded.name,
            options=dict(s.options.__dict__),
        )


def slots_for(
    loaded: LoadedModel, memory_bytes: int | None = None, cross_dtype: torch.dtype | None = None
) -> int:
    """Slots for the pool: as many as `memory_bytes` of cache holds (at most 512). Default
    budget: on CUDA half the free device memory, on the CPU 16 slots."""
    if memory_bytes is None:
        if loaded.device.type != "cuda":
            return 16
        memory_bytes = torch.cuda.mem_get_info(loaded.device)[0] // 2
    return max(1, min(512, memory_bytes // slot_bytes(loaded, cross_dtype)))
