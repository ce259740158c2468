"""Transcribe audio with a loaded Whisper model: the engine's entry point.

A batch of clips (each at most one 30 s window) is encoded together, its cross-attention K/V
projected once into cache slots, and greedy-decoded together.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import torch

from engine.audio import SAMPLE_RATE, AudioError, decode_audio
from engine.decoding import (
    DecodingOptions,
    SuppressBlank,
    SuppressTokens,
    compression_ratio,
    detect_language,
    greedy_decode,
    suppressed_tokens,
)
from engine.loader import LoadedModel, load_model
from engine.mel import CHUNK_LENGTH, N_SAMPLES, log_mel_spectrogram
from engine.model import KVCache
from engine.result import Segment, Transcription


class Transcriber:
    """One model on one device; `transcribe` takes audio bytes or 16 kHz float32 samples."""

    def __init__(self, loaded: LoadedModel):
        self.loaded = loaded

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

    def transcribe(
        self, audio: bytes | np.ndarray, options: DecodingOptions | None = None
    ) -> Transcription:
        return self.transcribe_batch([audio], options)[0]

    @torch.inference_mode()
    def transcribe_batch(
        self, audios: list[bytes | np.ndarray], options: DecodingOptions | None = None
    ) -> list[Transcription]:
        m = self.loaded
        options = (options or DecodingOptions()).verified(m.tokenizer)
        samples = [decode_audio(a) if isinstance(a, bytes) else a for a in audios]
        for s in samples:
            if len(s) > N_SAMPLES:
                raise AudioError(
                    f"the audio is {len(s) / SAMPLE_RATE:.1f} s long; this engine transcribes "
                    f"at most {CHUNK_LENGTH} s per clip (long-form audio is not supported yet)"
                )
        mel = torch.stack(
            [log_mel_spectrogram(torch.from_numpy(s).to(m.device), m.dims.n_mels) for s in samples]
        )
        return self.decode_windows(mel, [len(s) / SAMPLE_RATE for s in samples], options)

    @torch.inference_mode()
    def decode_windows(
        self, mel: torch.Tensor, durations: list[float], options: DecodingOptions | None = None
    ) -> list[Transcription]:
        """Transcribe one 30 s window per row.

        mel: shape = (batch, n_mels, 3000), log-mel features as `WhisperFeatureExtractor` gives
        durations: seconds of audio in each window
        """
        m = self.loaded
        options = (options or DecodingOptions()).verified(m.tokenizer)
        device, batch = m.device, len(durations)
        cache = KVCache.allocate(m.dims, batch, device, m.dtype)
        slots = torch.arange(batch, device=device)
        xa = m.model.encoder(mel.to(device=device, dtype=m.dtype))
        m.model.project_cross_kv(xa, slots, cache)

        tokenizer = m.tokenizer
        if not tokenizer.is_multilingual:
            languages, language_probs = ["en"] * batch, [None] * batch
        elif options.language is None:
            languages, language_probs = detect_language(m.model, cache, slots, tokenizer)
        else:
            languages, language_probs = [options.language] * batch, [None] * batch
        prompts = [tokenizer.sot_sequence(lang, options.task) for lang in languages]
        filters = [
            SuppressTokens(
                suppressed_tokens(tokenizer, m.suppress_tokens, options.suppress_tokens),
                m.dims.n_vocab,
                device,
            )
        ]
        if options.suppress_blank:
            filters.insert(0, SuppressBlank(tokenizer.encode(" ") + [tokenizer.eot], device))
        sample_len = options.sample_len or m.dims.n_text_ctx // 2
        tokens, sum_logprobs, no_speech = greedy_decode(
            m.model, cache, slots, prompts, tokenizer, filters, sample_len
        )

        results = []
        for i, duration in enumerate(durations):
            text = tokenizer.decode(tokens[i])
            segment = Segment(
                id=0,
                start=0.0,
                end=round(duration, 3),
                text=text,
                tokens=tokens[i],
                avg_logprob=sum_logprobs[i] / (len(tokens[i]) + 1),
                compression_ratio=compression_ratio(text),
                no_speech_prob=no_speech[i],
                temperature=0.0,
            )
            results.append(
                Transcription(
                    text=text.strip(),
                    language=languages[i],
                    language_probability=language_probs[i],
                    duration=round(duration, 3),
                    segments=[segment],
                    model=m.name,
                    options=dataclasses.asdict(options),
                )
            )
        return results
