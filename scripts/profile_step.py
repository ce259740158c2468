"""Where the engine's time goes on the GPU, through the stream the workers run.

1. The bench's work (`tools.bench.engine_run`: 3 x batch windows of 100 tokens) with the
   host time of each runner phase; the GPU is synchronised at each phase's end, so a phase's
   time includes the GPU work it queued (and admission no longer overlaps the launched steps);
2. the steady state: every slot live, milliseconds per `Stream.step` (a horizon of decode
   steps and the look at which rows finished), timed with CUDA events;
3. the whole bench run under the profiler: the share of its span the GPU is busy (the rest it
   waits for the host), and its kernel time by kind and by kernel (inside CUDA graphs too).

    python scripts/profile_step.py --model tiny --batch 512 [--cross-kv fp8] [--compile]

--compile: the encoder's and the decoder's forward through `torch.compile` (Inductor's fused
kernels, no CUDA graphs of its own), compiled in each graph's warm-up run and captured in the
engine's graphs as they are: issue #16's "torch.compile where it wins and keeps graphs".
"""

import argparse
import re
import time
from collections import defaultdict

import numpy as np
import torch

from engine import DecodingRules, Engine, EngineConfig, TranscriptionOptions
from engine.runner import Runner
from tools.bench import engine_run

PHASES = ("launch", "encode", "start", "collect", "compact")


def phase_times(config: EngineConfig, batch: int) -> None:
    spent: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    originals = {name: getattr(Runner, name) for name in PHASES}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            torch.cuda.synchronize()
            spent[name] += time.perf_counter() - start
            calls[name] += 1
            return out

        return wrapper

    run = engine_run(config, 3 * batch, [100])
    run()  # capture the graphs
    for name, fn in originals.items():
        setattr(Runner, name, timed(name, fn))
    try:
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        total = time.perf_counter() - start
    finally:
        for name, fn in originals.items():
            setattr(Runner, name, fn)
    print(f"{config.model} batch {batch}: {3 * batch} windows in {total * 1000:.0f} ms")
    for name in PHASES:
        ms, n = spent[name] * 1000, calls[name]
        print(f"  {name:8s} {n:5d} calls {ms:8.1f} ms  {ms / max(n, 1):7.3f} ms/call")
    rest = (total - sum(spent.values())) * 1000
    print(f"  stream and results {rest:.1f} ms")


def steady_state(config: EngineConfig, batch: int, steps: int = 20) -> None:
    """Milliseconds per step with every slot live (windows long enough to outlast the timing)."""
    config = EngineConfig(**{**config.__dict__, "rules": DecodingRules(max_prompt=4)})
    stream = Engine.open(config)
    n_mels = stream.engine.loaded.dims.n_mels
    mel = stream.prepare(np.random.default_rng(0).standard_normal((n_mels, 3000), np.float32))
    options = TranscriptionOptions(
        language="en",
        timestamps=False,
        temperature=(0.0,),
        condition_on_previous_text=False,
        no_speech_threshold=None,
        min_tokens=stream.engine.sample_len,
    )
    for warm in (True, False):  # the first round captures the graphs
        for i in range(batch):
            stream.submit(i, mel, options)
        while stream.stats.windows < batch * (1 if warm else 2):
            stream.step()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        stream.step()
        start.record()
        for _ in range(steps):
            stream.step()
        end.record()
        torch.cuda.synchronize()
        for i in range(batch):
            stream.abort(i)
    print(
        f"{config.model} batch {batch}, every slot live: {start.elapsed_time(end) / steps:.2f} ms"
    )
    print("  per Stream.step (a horizon of decode steps on CUDA, then the look)")


# kernels by kind, first match wins (names as the profiler gives them, inside CUDA graphs too)
KINDS = (
    ("attention, Triton", r"split_kernel|combine_kernel"),
    ("attention, cuDNN/flash", r"cudnn|fmha|flash|sdpa"),
    ("greedy choice", r"greedy"),
    ("cache writes", r"store_kernel"),
    ("matrix products", r"gemm|nvjet|cutlass|cublas|xmma|wgmma|linear_kernel"),
    ("convolution", r"conv|implicit"),
    ("layer norm", r"layer_norm"),
    ("index, gather, copy", r"index|gather|scatter|copy|Copy|cat|Memcpy|Memset"),
    ("element-wise", r"elementwise|vectorized|reduce|Reduce|unrolled"),
)


def gpu_time(config: EngineConfig, batch: int) -> None:
    """The bench's run under the profiler: how much of its span the GPU is busy (the rest it
    waits for the host), and its kernel time by kind and by kernel."""
    run = engine_run(config, 3 * batch if batch > 1 else 1, [100])
    run()  # capture the graphs
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        run()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy, start, end = 0.0, *spans[0]
    for s, e in spans[1:]:  # the union of the kernels' intervals
        if s > end:
            busy, start = busy + end - start, s
        end = max(end, e)
    busy += end - start
    span = end - spans[0][0]
    by_kind: dict[str, float] = defaultdict(float)
    by_name: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        us = e.time_range.end - e.time_range.start
        by_kind[next((k for k, pattern in KINDS if re.search(pattern, e.name)), "other")] += us
        by_name[e.name][0] += 1
        by_name[e.name][1] += us
    windows = 3 * batch if batch > 1 else 1
    total = sum(by_kind.values())
    print(
        f"GPU busy {busy / 1000:.1f} ms of a {span / 1000:.1f} ms span ({100 * busy / span:.0f}%); "
        f"{len(kernels)} kernels, {total / 1000 / windows:.3f} ms of kernel time a window"
    )
    for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {kind:24s} {us / 1000:9.1f} ms {100 * us / total:5.1f}%")
    for name, (n, us) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:12]:
        print(f"  {n:7d} x {us / n:8.1f} us = {us / 1000:8.1f} ms  {name[:90]}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--cross-kv", default="model", choices=("model", "fp8"))
    parser.add_argument("--compile", action="store_true", help="the model via torch.compile")
    args = parser.parse_args()
    if args.compile:
        import torch._dynamo

        from engine.model import AudioEncoder, TextDecoder

        torch._dynamo.config.cache_size_limit = 1024  # a compile per captured shape
        AudioEncoder.forward = torch.compile(AudioEncoder.forward, dynamic=False)
        TextDecoder.forward = torch.compile(TextDecoder.forward, dynamic=False)
    config = EngineConfig(
        model=f"random:{args.model}",
        device="cuda",
        dtype="fp16",
        slots=args.batch,
        encoder_batch=min(args.batch, 32),
        cross_kv=args.cross_kv,
    )
    phase_times(config, args.batch)
    steady_state(config, args.batch)
    gpu_time(config, args.batch)


if __name__ == "__main__":
    main()
