"""Where the engine's time goes on the GPU.

1. A bench run (`engine_run`: 3 x batch windows of 100 tokens) with the host time of each
   scheduler phase (the GPU is synchronised at each phase's end, so a phase's time includes
   the GPU work it queued, and admission no longer overlaps the launched steps);
2. one decode step's graph replays, timed with CUDA events;
3. the kernels of the encoder and of one decode step, from the profiler.

    python scripts/profile_step.py --model tiny --batch 512
"""

import argparse
import time
from collections import defaultdict

import torch

from engine.bench import engine_run
from engine.loader import load_model
from engine.scheduler import Scheduler


def phase_times(loaded, batch: int) -> None:
    spent: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    phases = ("launch", "encode", "start", "collect", "compact")
    originals = {name: getattr(Scheduler, name) for name in phases}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            torch.cuda.synchronize()
            spent[name] += time.perf_counter() - start
            calls[name] += 1
            return out

        return wrapper

    run = engine_run(loaded, batch, 3 * batch, [100])
    run()  # capture the graphs
    for name, fn in originals.items():
        setattr(Scheduler, name, timed(name, fn))
    try:
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        total = time.perf_counter() - start
    finally:
        for name, fn in originals.items():
            setattr(Scheduler, name, fn)
    print(f"{loaded.name} batch {batch}: {3 * batch} windows in {total * 1000:.0f} ms")
    for name in originals:
        ms, n = spent[name] * 1000, calls[name]
        print(f"  {name:8s} {n:5d} calls {ms:8.1f} ms  {ms / max(n, 1):7.3f} ms/call")
    rest = (total - sum(spent.values())) * 1000
    print(f"  driver and results {rest:.1f} ms")


def replay_times(sched: Scheduler, name: str) -> None:
    key = max(sched._step_graphs)  # (batch bucket, key bucket, timestamps, sampling)
    forward, commit = sched._step_graphs[key]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for what, fn in (("forward graph", forward.replay), ("commit graph", commit.replay)):
        torch.cuda.synchronize()
        start.record()
        for _ in range(50):
            fn()
        end.record()
        torch.cuda.synchronize()
        print(f"{name} b={key[0]} keys={key[1]} {what}: {start.elapsed_time(end) * 20:.0f} us")
    return key


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch", type=int, default=512)
    args = parser.parse_args()
    loaded = load_model(f"random:{args.model}", device="cuda", dtype=torch.float16)
    phase_times(loaded, args.batch)

    # a scheduler with every slot live, mid-way through its windows
    holder = {}
    original = Scheduler.launch

    def keep(self):
        holder["sched"] = self
        return original(self)

    Scheduler.launch = keep
    try:
        engine_run(loaded, args.batch, args.batch, [100])()
    finally:
        Scheduler.launch = original
    sched = holder["sched"]
    key = replay_times(sched, loaded.name)
    enc = max(sched._encoder_graphs)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        sched._encoder_graphs[enc].replay()
    end.record()
    torch.cuda.synchronize()
    print(f"{loaded.name} encoder graph, {enc} windows: {start.elapsed_time(end) / 10:.2f} ms")
    for what, fn in (
        ("encoder", lambda: sched._encode_into(enc)),
        ("decode step", lambda: (sched._forward(*key), sched._commit(key[0]))),
    ):
        with (
            torch.inference_mode(),
            torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof,
        ):
            fn()
            torch.cuda.synchronize()
        print(f"--- {what}")
        table = prof.key_averages().table(
            sort_by="cuda_time_total", row_limit=18, max_name_column_width=70
        )
        print(table)


if __name__ == "__main__":
    main()
