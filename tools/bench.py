"""`whisperfleet bench`: the engine against plain transformers on one GPU, same work.

Work: 30 s windows (random log-mel), exactly `tokens` new tokens each (end-of-text
suppressed until then), fp16, random weights of Whisper's shapes (`random:<size>`: speed does
not depend on the values). transformers runs Whisper's `generate` with SDPA, with its
default dynamic cache and with `cache_implementation="static"`, and ("plain") the generic
`GenerationMixin.generate` from the same prompt with the static cache, without Whisper's
logits processors: the leaner peer. The engine runs what a worker runs: a `Stream`
(`Engine.open`) with a pool of `batch` slots, fed `3 * batch` spectrogram inputs at once
(continuous batching, CUDA graphs), its cross-attention cache in the model's dtype ("engine")
or in fp8 ("engine fp8"), that and the encoder's products in fp8 ("engine fp8 encoder",
`engine.quantize`), or the whole model in bf16 ("engine bf16"). Reported: windows/s
(best of 2 runs after a warm-up), audio seconds per second (RTFx), latency of one window at
batch 1 (median of several runs, with their range), peak GPU memory, and the engine's
windows/s over transformers' static cache at the same batch. The second part, real weights
on real speech, is `tools.gpu_checks`.

Qwen3-ASR's shapes (`qwen3-asr-0.6B`, `qwen3-asr-1.7B`, and `qwen3-asr-tiny` for tests:
random weights made once into the cache by `tools.qwen3_asr`) run the same way on random 30 s
audio, a forced language, exactly `tokens` new tokens a window: the engine's own
implementation ("engine", fp16) against transformers' Qwen3-ASR `generate` over the same
requests (`engine.hf.Chat`), with its dynamic or static cache.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.decoding import DecodingRules
from engine.engine import Engine, EngineConfig
from engine.loader import RANDOM_CONFIGS, default_cache_dir, random_tokenizer
from engine.mel import N_FRAMES, SAMPLE_RATE
from engine.options import TranscriptionOptions
from engine.windows import WindowStream
from tools import qwen3_asr

WINDOW_SECONDS = 30.0
LATENCY_RUNS = 7  # batch 1: the median of this many runs, and their range
ENGINE_SYSTEMS = ("engine", "fp8", "fp8enc", "bf16")
# transformers: Whisper's generate with either cache, the generic one ("plain"); the engine's
SYSTEMS = ("dynamic", "static", "plain", *ENGINE_SYSTEMS)
# Qwen3-ASR's shapes beside RANDOM_CONFIGS': the released 0.6B and 1.7B, and a tiny one
QWEN3 = tuple(f"qwen3-asr-{size}" for size in qwen3_asr.SIZES)
SIZES = (*RANDOM_CONFIGS, *QWEN3)


def qwen3_dir(size: str) -> Path:
    """A Qwen3-ASR of `size` (qwen3-asr-0.6B, ...) with random weights, made once into the
    cache (in a folder of its own first, so that a half-made one is never found)."""
    path = default_cache_dir() / "models" / f"random-{size}"
    if not (path / "config.json").is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            made = qwen3_asr.make(Path(tmp) / "model", size.removeprefix("qwen3-asr-"))
            if not path.exists():
                made.rename(path)
    return path


@dataclass
class Row:
    model: str
    system: str  # "engine", "engine fp8", "engine fp8 encoder", "engine bf16", "transformers ..."
    batch: int
    windows_per_s: float
    latency_ms: float | None  # one window at batch 1: the median of LATENCY_RUNS
    peak_gib: float
    tokens: str = "100"  # new tokens per window ("10-200": uniform mixed lengths)
    latency_range_ms: tuple[float, float] | None = None  # fastest and slowest of the runs

    @property
    def rtfx(self) -> float:
        return self.windows_per_s * WINDOW_SECONDS


def _timed(fn: Callable[[], object], batch: int) -> tuple[float, list[float], float]:
    """(best seconds, every run's seconds, peak GiB allocated) of `fn` after one warm-up:
    2 runs, or LATENCY_RUNS at batch 1 (small and noisy)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    runs = []
    for _ in range(LATENCY_RUNS if batch == 1 else 2):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        runs.append(time.perf_counter() - start)
    return min(runs), runs, torch.cuda.max_memory_allocated() / 2**30


def _latency(runs: list[float]) -> tuple[float, tuple[float, float]]:
    return statistics.median(runs) * 1000, (min(runs) * 1000, max(runs) * 1000)


def engine_run(
    config: EngineConfig, n_windows: int, lengths: list[int]
) -> Callable[[], list[list[int]]]:
    """A function that pushes `n_windows` spectrogram inputs of one window each through a
    stream, the i-th exactly `lengths[i % len(lengths)]` tokens long, returning their tokens.
    The inputs are prepared once, as a worker's job threads prepare them before the engine."""
    config = EngineConfig(
        **{
            **config.__dict__,
            "rules": DecodingRules(sample_len=max(lengths), max_prompt=4),  # no previous text
        }
    )
    stream = Engine.open(config)
    if isinstance(stream, WindowStream):  # Qwen3-ASR makes its own features: audio
        shape: tuple[int, ...] = (int(WINDOW_SECONDS) * SAMPLE_RATE,)
    else:
        shape = (stream.engine.loaded.dims.n_mels, N_FRAMES)
    g = np.random.default_rng(0)
    inputs = [
        stream.prepare(g.standard_normal(shape, dtype=np.float32))
        for _ in range(min(n_windows, 64))
    ]
    options = {
        n: TranscriptionOptions(
            language="en",
            timestamps=False,
            temperature=(0.0,),
            condition_on_previous_text=False,
            no_speech_threshold=None,  # every window is decoded, none skipped as silence
            min_tokens=n,
            sample_len=n,
        )
        for n in set(lengths)
    }

    def run() -> list[list[int]]:
        for i in range(n_windows):
            stream.submit(i, inputs[i % len(inputs)], options[lengths[i % len(lengths)]])
        out: list[list[int]] = [[] for _ in range(n_windows)]
        while stream.busy:
            for f in stream.step():
                out[f.owner] = [t for s in f.transcription.segments for t in s.tokens]
        return out

    return run


def bench_engine(
    size: str, batch: int, tokens: int | tuple[int, int], system: str = "engine"
) -> Row:
    """system: engine, fp8 (cross-attention K/V in fp8), fp8enc (and the encoder's products in
    fp8) or bf16 (the whole model in bf16)."""
    if isinstance(tokens, tuple):  # uniform mixed lengths, same for every run
        g = torch.Generator().manual_seed(1)
        lengths = torch.randint(tokens[0], tokens[1] + 1, (3 * batch,), generator=g).tolist()
        label = f"{tokens[0]}-{tokens[1]}"
    else:
        lengths, label = [tokens], str(tokens)
    if size in QWEN3 and system != "engine":
        raise ValueError(f"{size}: the engine's Qwen3-ASR runs in fp16 only (system engine)")
    config = EngineConfig(
        model=str(qwen3_dir(size)) if size in QWEN3 else f"random:{size}",
        device="cuda",
        dtype="bf16" if system == "bf16" else "fp16",
        slots=batch,
        encoder_batch=min(batch, 32),
        cross_kv="fp8" if system in ("fp8", "fp8enc") else "model",
        encoder="fp8" if system == "fp8enc" else "model",
    )
    n = 3 * batch if batch > 1 else 1
    best, runs, peak = _timed(engine_run(config, n, lengths), batch)
    name = {
        "engine": "engine",
        "fp8": "engine fp8",
        "fp8enc": "engine fp8 encoder",
        "bf16": "engine bf16",
    }[system]
    row = Row(f"random:{size}", name, batch, n / best, None, peak, label)
    if batch == 1:
        row.latency_ms, row.latency_range_ms = _latency(runs)
        row.windows_per_s = 1000 / row.latency_ms
    return row


def hf_model(size: str, device: torch.device, dtype: torch.dtype = torch.float16):
    """transformers' Whisper of this size, random weights, SDPA."""
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

    tok = random_tokenizer(size)
    config = WhisperConfig(
        **RANDOM_CONFIGS[size],
        decoder_start_token_id=tok.sot,
        eos_token_id=tok.eot,
        pad_token_id=tok.eot,
        bos_token_id=tok.eot,
        attn_implementation="sdpa",
    )
    # seeded, as the engine's random weights are: Whisper's generate splits what it returns
    # at any timestamp tokens the weights happen to emit, so its output's width varies
    # with them (not its work)
    torch.manual_seed(0)
    with torch.device(device):
        model = WhisperForConditionalGeneration._from_config(config, dtype=dtype).eval()
    multilingual = {
        "lang_to_id": {f"<|{c}|>": i for c, i in tok.language_ids.items()},
        "task_to_id": {"transcribe": tok.transcribe, "translate": tok.translate},
    }
    model.generation_config = GenerationConfig(
        decoder_start_token_id=tok.sot,
        eos_token_id=tok.eot,
        pad_token_id=tok.eot,
        no_timestamps_token_id=tok.no_timestamps,
        is_multilingual=tok.is_multilingual,
        max_length=config.max_target_positions,
        **(multilingual if tok.is_multilingual else {}),
    )
    return model, config


def transformers_run(
    size: str, batch: int, cache: str, tokens: int, device: torch.device, dtype: torch.dtype
) -> Callable[[], torch.Tensor]:
    """A function that runs `batch` random windows through transformers, `tokens` new tokens
    each, returning the sequences. cache: "dynamic" or "static" (Whisper's `generate`), or
    "plain" (the generic `generate`, static cache, from Whisper's English prompt)."""
    from transformers import GenerationMixin

    model, config = hf_model(size, device, dtype)
    g = torch.Generator(device).manual_seed(0)
    shape = (batch, config.num_mel_bins, N_FRAMES)
    features = torch.randn(shape, generator=g, device=device, dtype=dtype)
    fixed = {"min_new_tokens": tokens, "max_new_tokens": tokens}
    tok = random_tokenizer(size)
    if cache == "plain":
        ids = torch.tensor([tok.sot_sequence("en", "transcribe")] * batch, device=device)
        fixed |= {"decoder_input_ids": ids, "cache_implementation": "static"}
        generate = GenerationMixin.generate  # not Whisper's override: no logits processors
    else:
        if tok.is_multilingual:  # an English-only model takes neither
            fixed |= {"language": "en", "task": "transcribe"}
        if cache == "static":
            fixed["cache_implementation"] = "static"
        generate = type(model).generate

    @torch.inference_mode()
    def run() -> torch.Tensor:
        return generate(model, features, **fixed)

    return run


def qwen3_transformers_run(
    size: str, batch: int, cache: str, tokens: int, device: torch.device, dtype: torch.dtype
) -> Callable[[], torch.Tensor]:
    """`batch` random 30 s windows' requests through transformers' Qwen3-ASR `generate`,
    `tokens` new tokens each. cache: "dynamic" or "static"."""
    from transformers import AutoProcessor, Qwen3ASRForConditionalGeneration

    from engine.hf import Chat

    if cache not in ("dynamic", "static"):
        raise ValueError(f"{size}: transformers runs Qwen3-ASR with the dynamic or static cache")
    path = qwen3_dir(size)
    model = Qwen3ASRForConditionalGeneration.from_pretrained(path, dtype=dtype).to(device)
    g = np.random.default_rng(0)
    windows = [g.standard_normal(int(WINDOW_SECONDS) * SAMPLE_RATE, dtype=np.float32)] * batch
    options = [TranscriptionOptions(language="en")] * batch
    inputs = Chat(AutoProcessor.from_pretrained(path)).requests(windows, options)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    inputs["input_features"] = inputs["input_features"].to(dtype)
    fixed = {"min_new_tokens": tokens, "max_new_tokens": tokens, "do_sample": False}
    if cache == "static":
        fixed["cache_implementation"] = "static"

    @torch.inference_mode()
    def run() -> torch.Tensor:
        return model.eval().generate(**inputs, **fixed)

    return run


def bench_transformers(size: str, batch: int, cache: str, tokens: int) -> Row:
    peer = qwen3_transformers_run if size in QWEN3 else transformers_run
    run = peer(size, batch, cache, tokens, torch.device("cuda"), torch.float16)
    best, runs, peak = _timed(run, batch)
    row = Row(f"random:{size}", f"transformers {cache}", batch, batch / best, None, peak)
    if batch == 1:
        row.latency_ms, row.latency_range_ms = _latency(runs)
        row.windows_per_s = 1000 / row.latency_ms
    return row


def run(
    sizes: list[str], batches: list[int], systems: list[str], tokens: int, mixed: bool
) -> list[Row]:
    """Every system at every batch for every size, printing each row as it comes; a
    transformers run that fails (out of memory, or one of its limits) is reported and left
    out."""
    rows: list[Row] = []
    for size in sizes:
        for system in systems:
            for b in batches:
                if system in ENGINE_SYSTEMS:
                    rows.append(bench_engine(size, b, tokens, system))
                    if mixed and b > 1:
                        rows.append(bench_engine(size, b, (10, 200), system))
                else:
                    try:
                        rows.append(bench_transformers(size, b, system, tokens))
                    except Exception as e:  # out of memory, or a transformers limit: say so
                        print(f"transformers {system} at batch {b}: {e!r}"[:300], file=sys.stderr)
                torch.cuda.empty_cache()
                print(table(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    return rows


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table; "vs static" and "vs plain": an engine row's windows/s
    over transformers' (Whisper's generate with the static cache; the generic generate) at the
    same model and batch (fixed-length work, same run)."""

    def peer(system: str) -> dict[tuple[str, int], float]:
        return {
            (r.model, r.batch): r.windows_per_s
            for r in rows
            if r.system == system and r.tokens == "100"
        }

    peers = [peer("transformers static"), peer("transformers plain")]
    lines = [
        "| model | system | batch | tokens | windows/s | RTFx | latency ms | peak GiB "
        "| vs static | vs plain |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        latency = f"{r.latency_ms:.1f}" if r.latency_ms is not None else ""
        if r.latency_range_ms:
            latency += " ({:.1f}-{:.1f})".format(*r.latency_range_ms)
        speed = f"{r.windows_per_s:.1f} | {r.rtfx:.0f}"
        ratios = []
        for windows in peers:
            base = windows.get((r.model, r.batch))
            like = r.system.startswith("engine") and r.tokens == "100" and base
            ratios.append(f"{r.windows_per_s / base:.2f}x" if like else "")
        lines.append(
            f"| {r.model} | {r.system} | {r.batch} | {r.tokens} | {speed} | {latency} "
            f"| {r.peak_gib:.1f} | {' | '.join(ratios)} |"
        )
    return "\n".join(lines)
