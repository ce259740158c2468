"""Transcribe audio or spectrograms of any length with a loaded Whisper model.

Every input becomes a request (`engine.longform`) that hands out 30 s windows. The driver here
feeds the windows of all requests to one continuous-batching scheduler (`engine.scheduler`):
whenever slots are free, ready windows join the running batch; whenever a window finishes, its
request takes the result and may hand out its next window at once. Temperature fallback
re-decodes only the window that needs it, in its slot, from the K/V already projected.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from engine.audio import Audio
from engine.decoding import build_filters, suppressed_tokens
from engine.inputs import (
    MAX_SPECTROGRAM_FRAMES,
    MelSource,
    SpectrogramError,
    audio_sources,
    spectrogram_source,
)
from engine.loader import LoadedModel, load_model
from engine.longform import (
    ChunkedRequest,
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

    def sources(self, items: Sequence[Input]) -> list[MelSource]:
        """Validate and open inputs; raises AudioError or SpectrogramError. Clips of up to
        30 s get their log-mel together."""
        m = self.loaded
        sources: list[MelSource | None] = [None] * len(items)
        audio: list[tuple[int, Audio | np.ndarray]] = []
        for i, item in enumerate(items):
            if isinstance(item, bytes) and item[:6] == b"\x93NUMPY":
                try:
                    item = np.load(io.BytesIO(item), allow_pickle=False)
                except ValueError as e:
                    raise SpectrogramError(f"not a readable .npy array ({e})") from e
            if isinstance(item, np.ndarray) and item.ndim >= 2:
                n_mels, frames = m.dims.n_mels, self.max_spectrogram_frames
                sources[i] = spectrogram_source(item, n_mels, m.device, frames)
            else:
                audio.append((i, Audio(item) if isinstance(item, bytes) else item))
        opened = audio_sources([a for _, a in audio], m.dims.n_mels, m.device)
        for (i, _), source in zip(audio, opened, strict=True):
            sources[i] = source
        return sources  # type: ignore[return-value]  # every entry is set above

    def scheduler(self, options: TranscriptionOptions) -> Scheduler:
        """The scheduler for these options' decoding rules (kept: its CUDA graphs are too)."""
        m = self.loaded
        # a prompt of previous text (up to half the context) needs a longer self-attention
        # cache than the start-of-transcript tokens alone
        context = options.initial_prompt or (
            options.mode == "sequential" and options.condition_on_previous_text
        )
        max_prompt = m.dims.n_text_ctx // 2 + 4 if context else 4
        key = (
            options.suppress_blank,
            options.suppress_tokens,
            options.max_initial_timestamp,
            options.sample_len,
            max_prompt,
        )
        if key not in self._schedulers:
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
            self._schedulers[key] = Scheduler(
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
        return self._schedulers[key]

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
        kind = SequentialRequest if options.mode == "sequential" else ChunkedRequest
        requests = [kind(source, options, m.tokenizer) for source in self.sources(items)]
        sched = self.scheduler(options)
        sched.generator.manual_seed(options.seed)
        try:
            self._decode(sched, requests, options, progress)
        except BaseException:
            sched.reset()  # the next transcription starts with a free pool
            raise
        return [self._result(r, options) for r in requests]

    def _decode(
        self,
        sched: Scheduler,
        requests: list[Request],
        options: TranscriptionOptions,
        progress: Progress | None,
    ) -> None:
        waiting: list[tuple[Request, Window]] = []
        while True:
            sched.launch()  # the GPU decodes while the host admits ready windows
            self._admit(sched, requests, waiting, options)
            if sched.n_live == 0:
                if all(r.done for r in requests):
                    break
                raise RuntimeError("no window is ready, yet some inputs are not done")
            for index, sequence, result in sched.collect():
                r, window = sequence.owner
                retry = sequence.attempt + 1
                if options.needs_fallback(result) and retry < len(options.temperature):
                    sched.restart(index, r.task(window, options.temperature[retry]), retry)
                    continue
                sched.release(index)
                r.accept(window, result)
                if progress:
                    progress(requests.index(r), r.done_seconds, r.source.duration)
            sched.compact()

    def _admit(self, sched: Scheduler, requests: list[Request], waiting: list, options) -> None:
        """Admit ready windows (kept in `waiting` until they fit) as one encoder batch."""
        for r in requests:
            for window in r.ready() if len(waiting) < sched.encoder_batch else ():
                waiting.append((r, window))
                if len(waiting) == sched.encoder_batch:
                    break
        room = sched.room(len(waiting))
        if not room:
            return
        batch, waiting[:] = waiting[:room], waiting[room:]
        rows = sched.encode(torch.stack([w.mel for _, w in batch]).to(self.loaded.dtype))
        if any(r.language is None for r, _ in batch):
            codes, probs = sched.detect_language(rows)
            for (r, _), code, prob in zip(batch, codes, probs, strict=True):
                if r.language is None:  # a request's first window decides
                    r.language, r.language_probability = code, prob
        first = options.temperature[0]
        sched.start(rows, [SchedSequence((r, w), r.task(w, first)) for r, w in batch])

    def _result(self, r: Request, options: TranscriptionOptions) -> Transcription:
        tokens = [t for s in r.segments for t in s.tokens]
        return Transcription(
            text=self.loaded.tokenizer.decode(tokens).strip(),
            language=r.language or "en",
            language_probability=r.language_probability,
            duration=round(r.source.duration, 3),
            segments=r.segments,
            model=self.loaded.name,
            options=dict(options.__dict__),
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
