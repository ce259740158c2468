"""Transcribe audio or spectrograms of any length with a loaded Whisper model.

Every input becomes a request (`engine.longform`) that hands out 30 s windows; windows of all
requests are batched together through the encoder (cross-attention K/V projected once per
window into cache slots) and decoded together, each row with its own prompt and temperature.
Temperature fallback re-decodes only the rows that need it, from the same slots.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from engine.audio import Audio
from engine.decoding import (
    WindowResult,
    build_filters,
    decode,
    detect_language,
    suppressed_tokens,
)
from engine.inputs import (
    MAX_SPECTROGRAM_FRAMES,
    MelSource,
    SpectrogramError,
    audio_source,
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
from engine.model import KVCache
from engine.result import Transcription

# bytes (an audio file or a .npy spectrogram), decoded 16 kHz samples (1-D), or a
# spectrogram array (2-D or 3-D)
Input = bytes | np.ndarray | Audio
Progress = Callable[[int, float, float], None]  # (input index, seconds done, seconds in all)


class Transcriber:
    """One model on one device."""

    def __init__(self, loaded: LoadedModel, max_batch: int = 16):
        self.loaded = loaded
        self.max_batch = max_batch  # windows per encoder batch
        self.max_spectrogram_frames = MAX_SPECTROGRAM_FRAMES

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

    def source(self, item: Input) -> MelSource:
        """Validate and open one input; raises AudioError or SpectrogramError."""
        m = self.loaded
        if isinstance(item, bytes) and item[:6] == b"\x93NUMPY":
            try:
                item = np.load(io.BytesIO(item), allow_pickle=False)
            except ValueError as e:
                raise SpectrogramError(f"not a readable .npy array ({e})") from e
        if isinstance(item, np.ndarray) and item.ndim >= 2:
            return spectrogram_source(item, m.dims.n_mels, m.device, self.max_spectrogram_frames)
        if isinstance(item, bytes):
            item = Audio(item)
        return audio_source(item, m.dims.n_mels, m.device)

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
        requests = [kind(self.source(item), options, m.tokenizer) for item in items]
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
        generator = torch.Generator(m.device).manual_seed(options.seed)
        sample_len = options.sample_len or m.dims.n_text_ctx // 2

        while not all(r.done for r in requests):
            batch: list[tuple[Request, Window]] = []
            for r in requests:
                for window in r.ready():
                    batch.append((r, window))
                    if len(batch) == self.max_batch:
                        break
                if len(batch) == self.max_batch:
                    break
            results = self._decode(batch, options, filters, sample_len, generator)
            for (r, window), result in zip(batch, results, strict=True):
                r.accept(window, result)
            if progress:
                for i, r in enumerate(requests):
                    progress(i, r.done_seconds, r.source.duration)
        return [self._result(r, options) for r in requests]

    def _decode(self, batch, options, filters, sample_len, generator) -> list[WindowResult]:
        m = self.loaded
        mel = torch.stack([w.mel for _, w in batch]).to(m.dtype)
        cache = KVCache.allocate(m.dims, len(batch), m.device, m.dtype)
        slots = torch.arange(len(batch), device=m.device)
        m.model.project_cross_kv(m.model.encoder(mel), slots, cache)

        undetected = [i for i, (r, _) in enumerate(batch) if r.language is None]
        if undetected:
            codes, probs = detect_language(m.model, cache, slots[undetected], m.tokenizer)
            for i, code, prob in zip(undetected, codes, probs, strict=True):
                r = batch[i][0]
                if r.language is None:  # a request's first window decides
                    r.language, r.language_probability = code, prob

        results: list[WindowResult | None] = [None] * len(batch)
        pending = list(range(len(batch)))
        for temperature in options.temperature:
            tasks = [batch[i][0].task(batch[i][1], temperature) for i in pending]
            out = decode(
                m.model, cache, slots[pending], tasks, m.tokenizer, filters, sample_len, generator
            )
            for i, result in zip(pending, out, strict=True):
                results[i] = result
            pending = [
                i for i, result in zip(pending, out, strict=True) if options.needs_fallback(result)
            ]
            if not pending:
                break
        return results

    def _result(self, r: Request, options: TranscriptionOptions) -> Transcription:
        tokens = [t for s in r.segments for t in s.tokens]
        return Transcription(
            text=self.loaded.tokenizer.decode(tokens).strip(),
            language=r.language or "en",
            language_probability=r.language_probability,
            duration=round(r.source.duration, 3),
            segments=r.segments,
            model=self.loaded.name,
            options={k: v for k, v in options.__dict__.items()},
        )
