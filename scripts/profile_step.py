"""Where a decode step's time goes: graph replays timed with CUDA events, and the kernels of
one eager step from the profiler.

    python scripts/profile_step.py --model tiny --batch 512
"""

import argparse

import torch

from engine.decoding import WindowTask, build_filters, suppressed_tokens
from engine.loader import load_model
from engine.mel import N_FRAMES
from engine.scheduler import Scheduler, Sequence


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--batch", type=int, default=512)
    args = parser.parse_args()
    m = load_model(f"random:{args.model}", device="cuda", dtype=torch.float16)
    d, tok, b = m.dims, m.tokenizer, args.batch
    filters = build_filters(
        tok, d.n_vocab, suppressed_tokens(tok, [], ()), True, 1.0, d.n_audio_ctx, m.device
    )
    sched = Scheduler(m, filters, b, 224, min(b, 32))
    task = WindowTask(language="en", timestamps=True)
    mel = torch.randn(min(b, 32), d.n_mels, N_FRAMES, device="cuda", dtype=torch.float16)
    while sched.free:
        n = min(sched.free, 32)
        rows = sched.encode(mel[:n])
        sched.start(rows, [Sequence(i, task, min_tokens=224, max_tokens=224) for i in range(n)])
    for _ in range(3):
        sched.step()
    key = list(sched._step_graphs)[-1]  # (batch bucket, key bucket, timestamps)
    forward, commit = sched._step_graphs[key]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for name, fn in (
        ("forward graph", forward.replay),
        ("commit graph", commit.replay),
        ("step() with sync", sched.step),
    ):
        torch.cuda.synchronize()
        start.record()
        for _ in range(50):
            fn()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 50
        print(f"{args.model} b={b} keys={key[1]} {name}: {ms * 1000:.0f} us")
    # encoder and admission
    enc = sched._encoder_graphs[min(32, b)]
    start.record()
    for _ in range(10):
        enc.replay()
    end.record()
    torch.cuda.synchronize()
    print(
        f"{args.model} encoder graph, {min(32, b)} windows: {start.elapsed_time(end) / 10:.2f} ms"
    )
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        sched._forward(*key)
        sched._commit(b)
        torch.cuda.synchronize()
    print(
        prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60)
    )


if __name__ == "__main__":
    main()
