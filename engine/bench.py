"""`whisperfleet bench`: the engine against plain transformers on one GPU, same work.

Work: 30 s windows (random log-mel), exactly `tokens` new tokens each (end-of-text
suppressed until then), fp16, random weights of Whisper's shapes (`random:<size>`: speed does
not depend on the values). transformers runs `generate` with SDPA, with its default dynamic
cache and with `cache_implementation="static"`. The engine runs its scheduler over a pool of
`batch` slots fed `3 * batch` windows (continuous batching, CUDA graphs), its cross-attention
cache in the model's dtype ("engine") or in fp8 ("engine fp8"), or the whole model in bf16
("engine bf16"). Reported: windows/s,
audio seconds per second (RTFx), latency of one window at batch 1, peak GPU memory, and the
engine's windows/s over transformers' static cache at the same batch. The second part, real
weights on real speech, is `engine.gpu_checks`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.decoding import WindowTask, build_filters, suppressed_tokens
from engine.loader import RANDOM_CONFIGS, LoadedModel, random_tokenizer
from engine.mel import N_FRAMES
from engine.scheduler import Scheduler, Sequence

WINDOW_SECONDS = 30.0


@dataclass
class Row:
    model: str
    system: str  # "engine", "engine fp8", "engine bf16", "transformers dynamic", "... static"
    batch: int
    windows_per_s: float
    latency_ms: float | None  # one window at batch 1
    peak_gib: float
    tokens: str = "100"  # new tokens per window ("10-200": uniform mixed lengths)

    @property
    def rtfx(self) -> float:
        return self.windows_per_s * WINDOW_SECONDS


def _timed(fn: Callable[[], None], repeat: int = 2) -> tuple[float, float]:
    """(best seconds of `repeat` runs after one warm-up, peak GiB allocated)."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best, torch.cuda.max_memory_allocated() / 2**30


def engine_run(
    loaded: LoadedModel,
    batch: int,
    n_windows: int,
    lengths: list[int],
    graphs: bool = True,
    cross_dtype: torch.dtype | None = None,
) -> Callable[[], list[list[int]]]:
    """A function that pushes `n_windows` through a pool of `batch` slots, returning tokens."""
    d, tok = loaded.dims, loaded.tokenizer
    suppress = suppressed_tokens(tok, loaded.suppress_tokens, ())
    filters = build_filters(tok, d.n_vocab, suppress, True, 1.0, d.n_audio_ctx, loaded.device)
    sched = Scheduler(
        loaded,
        filters,
        batch,
        max(lengths),
        min(batch, 32),
        graphs=graphs,
        full_keys=True,
        max_prompt=4,
        cross_dtype=cross_dtype,
    )
    generator = torch.Generator(loaded.device).manual_seed(0)
    mels = torch.randn(
        min(n_windows, 64),
        d.n_mels,
        N_FRAMES,
        generator=generator,
        device=loaded.device,
        dtype=loaded.dtype,
    )
    task = WindowTask(language="en", timestamps=False)

    def run() -> list[list[int]]:
        out: list[list[int]] = [[] for _ in range(n_windows)]
        queued = list(range(n_windows))
        while queued or sched.n_live:
            sched.launch()
            room = sched.room(len(queued))
            if room:
                ids, queued = queued[:room], queued[room:]
                # views stacked on the GPU: indexing with a host list would copy the list
                # from pageable memory, which waits for the launched steps
                rows = sched.encode(torch.stack([mels[i % len(mels)] for i in ids]))
                sched.start(
                    rows,
                    [
                        Sequence(
                            i,
                            task,
                            min_tokens=lengths[i % len(lengths)],
                            max_tokens=lengths[i % len(lengths)],
                        )
                        for i in ids
                    ],
                )
            for index, sequence, result in sched.collect():
                out[sequence.owner] = result.tokens
                sched.release(index)
            sched.compact()
        return out

    return run


def bench_engine(
    loaded: LoadedModel,
    batch: int,
    tokens: int | tuple[int, int],
    cross_dtype: torch.dtype | None = None,
) -> Row:
    if isinstance(tokens, tuple):  # uniform mixed lengths, same for every run
        g = torch.Generator().manual_seed(1)
        lengths = torch.randint(tokens[0], tokens[1] + 1, (3 * batch,), generator=g).tolist()
        label = f"{tokens[0]}-{tokens[1]}"
    else:
        lengths, label = [tokens], str(tokens)
    n = 3 * batch if batch > 1 else 1
    seconds, peak = _timed(engine_run(loaded, batch, n, lengths, cross_dtype=cross_dtype))
    latency = seconds * 1000 if batch == 1 else None
    system = "engine"
    if cross_dtype == torch.float8_e4m3fn:
        system += " fp8"
    if loaded.dtype == torch.bfloat16:
        system += " bf16"
    return Row(loaded.name, system, batch, n / seconds, latency, peak, label)


def hf_model(size: str, device: torch.device):
    """transformers' Whisper of this size, random weights, fp16, SDPA."""
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
    with torch.device(device):
        model = WhisperForConditionalGeneration._from_config(config, dtype=torch.float16).eval()
    model.generation_config = GenerationConfig(
        decoder_start_token_id=tok.sot,
        eos_token_id=tok.eot,
        pad_token_id=tok.eot,
        no_timestamps_token_id=tok.no_timestamps,
        is_multilingual=True,
        lang_to_id={f"<|{c}|>": i for c, i in tok.language_ids.items()},
        task_to_id={"transcribe": tok.transcribe, "translate": tok.translate},
        max_length=config.max_target_positions,
    )
    return model, config


def bench_transformers(size: str, batch: int, cache: str, tokens: int) -> Row:
    device = torch.device("cuda")
    model, config = hf_model(size, device)
    features = torch.randn(batch, config.num_mel_bins, N_FRAMES, device=device, dtype=torch.float16)
    kwargs = {"cache_implementation": "static"} if cache == "static" else {}

    @torch.inference_mode()
    def run() -> None:
        model.generate(
            features,
            language="en",
            task="transcribe",
            min_new_tokens=tokens,
            max_new_tokens=tokens,
            **kwargs,
        )

    seconds, peak = _timed(run)
    latency = seconds * 1000 if batch == 1 else None
    return Row(f"random:{size}", f"transformers {cache}", batch, batch / seconds, latency, peak)


def table(rows: list[Row]) -> str:
    """The rows as a Markdown table; "vs static": an engine row's windows/s over transformers'
    static cache at the same model and batch (fixed-length work, same run)."""
    static = {
        (r.model, r.batch): r.windows_per_s
        for r in rows
        if r.system == "transformers static" and r.tokens == "100"
    }
    lines = [
        "| model | system | batch | tokens | windows/s | RTFx | latency ms | peak GiB "
        "| vs static |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        latency = f"{r.latency_ms:.1f}" if r.latency_ms is not None else ""
        speed = f"{r.windows_per_s:.1f} | {r.rtfx:.0f}"
        base = static.get((r.model, r.batch))
        ratio = ""
        if r.system.startswith("engine") and r.tokens == "100" and base:
            ratio = f"{r.windows_per_s / base:.2f}x"
        lines.append(
            f"| {r.model} | {r.system} | {r.batch} | {r.tokens} | {speed} | {latency} "
            f"| {r.peak_gib:.1f} | {ratio} |"
        )
    return "\n".join(lines)
