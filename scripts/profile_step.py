"""Where the engine's time goes on the GPU, through the stream the workers run.

1. The bench's work (`engine.tools.bench.engine_run`: 3 x batch windows of 100 tokens) with the
   host time of each runner phase; the GPU is synchronised at each phase's end, so a phase's
   time includes the GPU work it queued (and admission no longer overlaps the launched steps);
2. the steady state: every slot live, milliseconds per `Stream.step` (a horizon of decode
   steps and the look at which rows finished), timed with CUDA events;
3. the kernels of the whole bench run, from the profiler (inside CUDA graphs too).

    python scripts/profile_step.py --model tiny --batch 512
"""

import argparse
import time
from collections import defaultdict

import numpy as np
import torch

from engine import DecodingRules, Engine, EngineConfig, TranscriptionOptions
from engine.runner import Runner
from engine.tools.bench import engine_run

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


def kernels(config: EngineConfig, batch: int) -> None:
    run = engine_run(config, 3 * batch, [100])
    run()  # capture the graphs
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        run()
        torch.cuda.synchronize()
    table = prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=25, max_name_column_width=70
    )
    print(table)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch", type=int, default=512)
    args = parser.parse_args()
    config = EngineConfig(
        model=f"random:{args.model}",
        device="cuda",
        dtype="fp16",
        slots=args.batch,
        encoder_batch=min(args.batch, 32),
    )
    phase_times(config, args.batch)
    steady_state(config, args.batch)
    kernels(config, args.batch)


if __name__ == "__main__":
    main()
