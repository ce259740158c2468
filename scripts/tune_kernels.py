"""Time the decode-attention kernel's settings, the fused linear's, the encoder and the
log-mel on the GPU.

    python scripts/tune_kernels.py [--linear | --tiled | --encoder [--no-compile] | --compile
        | --mel | --qwen]

Default: for each shape, the bytes the cross-attention must read, the time of PyTorch's SDPA
(whatever backend it picks) and of the Triton kernel under each setting (checked against SDPA
first), as achieved bandwidth.

--linear: the fused linear (`engine.kernels.linear`) at 1 to 16 rows, each decoder projection
of large-v3 and the logits of tiny and large-v3 (the larger weights also split over their
inputs): torch's unfused path (layer norm, product, GELU, residual add, as the engine ran
them before) against the Triton kernel under each setting, as the weights' bandwidth.

--tiled: the same kernel over tiles of rows, for the encoder's four projections of tiny and
large-v3 (16 windows, and one), against torch's unfused path, as the matrix rate.

--encoder: the whole encoder from a CUDA graph: torch's kernels, the engine's Triton path
(`triton=True`: each residual add and layer norm fused), and torch.compile (Inductor's
fusion; not with --no-compile), with the kernels of one run.

--qwen: the same for Qwen3-ASR's decoder (16 query heads reading 8 key heads of 128, rows of
400 to 500 keys in slots of 1126).

--compile: a decode step, eager and through torch.compile, with torch's kernels and Triton's.
"""

import copy
import itertools
import sys
import time

import torch
import torch.nn.functional as F
from triton.runtime.errors import OutOfResources

from engine.inputs import audio_sources
from engine.kernels.attention import torch_decode_attention, triton_decode_attention
from engine.kernels.linear import MAX_ROWS, SPLIT_FROM, Tile, torch_linear, triton_linear
from engine.loader import load_model
from engine.mel import N_FRAMES
from engine.model import KVCache


def bench(fn, repeat: int = 20) -> float:
    """Median milliseconds of `fn` (events around each call, after warm-up)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def graphed(fn, calls: int = 10) -> float:
    """Milliseconds per call of `fn` replayed from a CUDA graph (no launch overhead): the
    time it takes inside the engine's captured steps."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return bench(graph.replay) / calls


def copy_bandwidth() -> float:
    x = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    ms = bench(lambda: y.copy_(x))
    return 2 * x.numel() / ms / 1e9  # TB/s


def attention(
    batch: int,
    heads: int,
    dtype,
    n: int = 1500,
    lengths: bool | tuple[int, int] = False,
    d: int = 64,
    kv_heads: int | None = None,
) -> None:
    """lengths: each row's keys drawn from (low, high), or n - 30 to n if True."""
    q = torch.randn(batch, heads, d, device="cuda", dtype=torch.float16)
    k = torch.randn(batch, kv_heads or heads, n, d, device="cuda").to(dtype)
    v = torch.randn(batch, kv_heads or heads, n, d, device="cuda").to(dtype)
    low, high = lengths if isinstance(lengths, tuple) else (n - 30, n)
    seen = torch.randint(low, high + 1, (batch,), device="cuda") if lengths else None
    kept = (seen.sum().item() / n / batch) if lengths else 1.0  # the keys read
    gbytes = 2 * k.numel() * k.element_size() * kept / 1e9
    ref = torch_decode_attention(q.float(), k.float(), v.float(), seen)
    rows = []
    if dtype == torch.float16:
        rows.append(("sdpa", graphed(lambda: torch_decode_attention(q, k, v, seen))))
    for block_n, target, warps, stages in itertools.product(
        (16, 32, 64, 128, 256), (1024, 8192), (4, 8), (None, 2, 4)
    ):

        def fn(b=block_n, t=target, w=warps, s=stages):
            return triton_decode_attention(q, k, v, seen, b, t, 128, w, s)

        err = float((fn().float() - ref).norm() / ref.norm())
        if err > 1e-2:
            print(f"  WRONG block_n={block_n} target={target} warps={warps}: {err:.1e}")
            continue
        name = f"triton block_n={block_n} target={target} warps={warps} stages={stages}"
        rows.append((name, graphed(fn)))
    what = "self" if lengths else "cross"
    shape = f"b={batch} h={heads}/{kv_heads or heads} d={d} n={n}"
    print(f"{what}-attention {shape} {str(dtype)[6:]}: {gbytes * 1000:.0f} MB")
    for name, ms in sorted(rows, key=lambda r: r[1])[:5] + [r for r in rows if r[0] == "sdpa"]:
        print(f"  {ms * 1000:8.1f} us  {gbytes / ms:5.2f} TB/s  {name}")


def linear(rows: int, k: int, n: int, norm: bool, gelu: bool, residual: bool, bias=True) -> None:
    dev, dtype = "cuda", torch.float16
    w = torch.randn(n, k, device=dev, dtype=dtype) / k**0.5
    b = torch.randn(n, device=dev, dtype=dtype) if bias else None
    ln = torch.nn.LayerNorm(k).to(dev, dtype) if norm else None
    x = torch.randn(rows, 1, k, device=dev, dtype=dtype)
    r = torch.randn(rows, 1, n, device=dev, dtype=dtype) if residual else None
    gbytes = w.numel() * w.element_size() / 1e9
    splits = (1, 2, 4, 8) if n * k > SPLIT_FROM else (1,)
    with torch.inference_mode():
        wide = [None if t is None else t.float() for t in (b, r)]
        ref = torch_linear(x.float(), w.float(), wide[0], ln and ln.float(), gelu, wide[1])
        ln = ln and ln.half()
        timed = [("torch", graphed(lambda: torch_linear(x, w, b, ln, gelu, r)))]
        for block_n, block_k, (warps, stages), split in itertools.product(
            (16, 32, 64), (128, 256), ((4, 3), (8, 3)), splits
        ):

            def fn(bn=block_n, bk=block_k, wa=warps, st=stages, sp=split):
                return triton_linear(x, w, b, ln, gelu, r, Tile(MAX_ROWS, bn, bk, wa, st), sp)

            try:
                err = float((fn().float() - ref).norm() / ref.norm())
            except OutOfResources:  # more shared memory than the GPU has: not a setting
                continue
            name = f"triton block_n={block_n} block_k={block_k} warps={warps} stages={stages}"
            name += f" split={split}"
            if err > 1e-2:
                print(f"  WRONG {name}: {err:.1e}")
                continue
            timed.append((name, graphed(fn)))
    parts = [p for p, on in (("norm", norm), ("gelu", gelu), ("residual", residual)) if on]
    print(f"linear rows={rows} {k}->{n} {'+'.join(parts)}: {gbytes * 1000:.1f} MB of weights")
    for name, ms in sorted(timed, key=lambda t: t[1])[:3] + [t for t in timed if t[0] == "torch"]:
        print(f"  {ms * 1000:8.1f} us  {gbytes / ms:5.2f} TB/s  {name}")


# settings of the tiled kernel to try: rows, outputs, inputs an iteration, warps, stages
TILES = [
    Tile(*t)
    for t in (
        (128, 128, 64, 8, 3),
        (128, 128, 64, 4, 3),
        (128, 128, 64, 8, 4),
        (128, 256, 64, 8, 3),
        (64, 128, 64, 4, 4),
        (128, 64, 64, 4, 4),
        (128, 128, 32, 4, 4),
        (256, 128, 64, 8, 3),
        (64, 256, 64, 8, 3),
        (128, 256, 32, 8, 4),
    )
]


def tiled(rows: int, k: int, n: int, norm: bool, gelu: bool, residual: bool, tiles) -> None:
    """An encoder projection over `rows` rows: torch's unfused kernels (as the encoder ran
    them) against the tiled kernel with its neighbours fused, under each setting; and the
    layer norm left to torch before the kernel, to see what normalising in its loop costs."""
    dev, dtype = "cuda", torch.float16
    w = torch.randn(n, k, device=dev, dtype=dtype) / k**0.5
    b = torch.randn(n, device=dev, dtype=dtype)
    ln = torch.nn.LayerNorm(k).to(dev, dtype) if norm else None
    x = torch.randn(rows, k, device=dev, dtype=dtype)
    r = torch.randn(rows, n, device=dev, dtype=dtype) if residual else None
    tflop = 2 * rows * n * k / 1e12
    with torch.inference_mode():
        wide = None if r is None else r.float()
        ref = torch_linear(x.float(), w.float(), b.float(), ln and ln.float(), gelu, wide)
        ln = ln and ln.half()
        timed = [("torch", graphed(lambda: torch_linear(x, w, b, ln, gelu, r)))]
        for tile in tiles:

            def fn(t=tile, norm_first=False):
                if norm_first:
                    y = F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)
                    return triton_linear(y, w, b, None, gelu, r, t)
                return triton_linear(x, w, b, ln, gelu, r, t)

            try:
                err = float((fn().float() - ref).norm() / ref.norm())
            except OutOfResources:
                continue
            if err > 1e-2:
                print(f"  WRONG {tile}: {err:.1e}")
                continue
            timed.append((f"triton {tile}", graphed(fn)))
            if norm and tile == tiles[0]:
                timed.append((f"torch norm, triton {tile}", graphed(lambda: fn(norm_first=True))))
    parts = [p for p, on in (("norm", norm), ("gelu", gelu), ("residual", residual)) if on]
    print(f"tiled rows={rows} {k}->{n} {'+'.join(parts)}: {tflop * 1000:.1f} GFLOP")
    best = sorted(timed, key=lambda t: t[1])[:4]
    for name, ms in best + [t for t in timed if t not in best and "torch" in t[0]]:
        print(f"  {ms * 1000:8.1f} us  {tflop / ms * 1000:6.1f} TFLOP/s  {name}")


def encoder(size: str, batch: int, modes=()) -> None:
    """The whole encoder, replayed from a CUDA graph as the engine runs it: torch's kernels,
    the engine's Triton path (`triton=True`), and torch.compile in each of `modes` (Inductor's
    own fusion, no CUDA graphs of its own), each against fp32 on the same weights."""
    m = load_model(f"random:{size}", device="cuda", dtype=torch.float16)
    mel = torch.randn(batch, m.dims.n_mels, N_FRAMES, device="cuda", dtype=torch.float16)
    enc = m.model.encoder
    with torch.inference_mode():
        ref = copy.deepcopy(enc).float()(mel.float()).double()
        runs = [("torch", lambda: enc(mel)), ("triton", lambda: enc(mel, True))]
        for mode in modes:
            torch._dynamo.reset()
            compiled = torch.compile(enc, mode=mode, dynamic=False)
            start = time.perf_counter()
            compiled(mel)
            torch.cuda.synchronize()
            secs = time.perf_counter() - start
            runs.append(
                (f"torch.compile {mode}, {secs:.0f} s to compile", lambda c=compiled: c(mel))
            )
        for name, fn in runs:
            err = float((fn().double() - ref).norm() / ref.norm())
            ms = graphed(fn, calls=2)
            print(
                f"encoder {size} b={batch} {name}: {ms:.2f} ms "
                f"({ms / batch:.3f} ms/window, rel. diff from fp32 {err:.1e})"
            )
        for name, fn in runs[:2]:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
                fn()
                torch.cuda.synchronize()
            print(f"  {name}: the kernels of one run")
            table = p.key_averages().table(sort_by="cuda_time_total", row_limit=10)
            print("\n".join("  " + line[:50] + line[-75:] for line in table.splitlines()))


def decode_step(size: str, batch: int) -> None:
    """One decode step (every row one token, 100 keys) from a CUDA graph: eager with torch's
    kernels and with the Triton ones, and each through torch.compile (default mode)."""
    m = load_model(f"random:{size}", device="cuda", dtype=torch.float16)
    cache = KVCache.allocate(m.dims, batch, "cuda", torch.float16, text_ctx=128)
    tokens = torch.randint(0, 50000, (batch, 1), device="cuda")
    positions = torch.full((batch, 1), 99, device="cuda")
    decoder = m.model.decoder
    with torch.inference_mode():
        for triton in (False, True):

            def step(fn=decoder, t=triton):
                return fn(tokens, positions, slice(0, batch), cache, 128, t)

            print(f"decode step {size} b={batch} triton={triton}: {graphed(step):.3f} ms eager")
            torch._dynamo.reset()
            compiled = torch.compile(decoder, dynamic=False)
            start = time.perf_counter()
            try:
                step(compiled)
            except Exception as e:  # noqa: BLE001 - a measurement: say what failed, go on
                print(f"  torch.compile failed: {type(e).__name__}: {str(e)[:300]}")
                continue
            secs = time.perf_counter() - start
            ms = graphed(lambda c=compiled: step(c))
            print(f"  torch.compile: {ms:.3f} ms ({secs:.0f} s to compile)")


def log_mel(seconds: float, clips: int, n: int = 20) -> None:
    """Wall time of turning decoded samples into windows' log-mel, as the engine does for
    clips of up to 30 s opened together (copy to the GPU, STFT, mel filters, silence floors)."""
    samples = [(0.1 * torch.randn(int(seconds * 16000))).numpy() for _ in range(clips)]
    audio_sources(samples, 128, torch.device("cuda"))
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n):
        audio_sources(samples, 128, torch.device("cuda"))
    torch.cuda.synchronize()
    ms = (time.perf_counter() - start) * 1000 / n / clips
    print(f"log-mel of {clips} clips of {seconds:.0f} s on the GPU: {ms:.3f} ms a clip")


def main() -> None:
    if "--mel" in sys.argv:
        for seconds, clips in itertools.product((5, 30), (1, 16, 64)):
            log_mel(seconds, clips)
        return
    if "--linear" in sys.argv:
        print(f"copy bandwidth: {copy_bandwidth():.2f} TB/s")
        for d, rows in itertools.product((1280, 384), (1, 4, 16)):
            if d == 1280:
                linear(rows, d, 3 * d, True, False, False)  # qkv
                linear(rows, d, d, False, False, True)  # an output projection
                linear(rows, d, 4 * d, True, True, False)  # fc1
                linear(rows, 4 * d, d, False, False, True)  # fc2
            linear(rows, d, 51904, True, False, False, bias=False)  # the logits (padded vocab)
        return
    if "--tiled" in sys.argv:
        for d in (384, 1280):
            for rows, tiles in ((1500 * 16, TILES), (1500, TILES[:1])):
                tiled(rows, d, 3 * d, True, False, False, tiles)  # qkv
                tiled(rows, d, d, False, False, True, tiles)  # the output projection
                tiled(rows, d, 4 * d, True, True, False, tiles)  # fc1
                tiled(rows, 4 * d, d, False, False, True, tiles)  # fc2
        return
    if "--encoder" in sys.argv:
        compiled = () if "--no-compile" in sys.argv else ("default",)
        encoder("tiny", 16, compiled)
        encoder("large-v3", 16, compiled)
        encoder("tiny", 1, compiled)
        encoder("large-v3", 1)
        if compiled:
            encoder("tiny", 16, ("max-autotune-no-cudagraphs",))  # minutes of tuning
        return
    if "--qwen" in sys.argv:  # Qwen3-ASR's decoder: 16 query heads on 8 key heads of 128
        for batch in (1, 32, 128):
            attention(batch, 16, torch.float16, n=1126, lengths=(400, 500), d=128, kv_heads=8)
        return
    if "--compile" in sys.argv:
        for size, batch in (("tiny", 1), ("tiny", 512), ("large-v3", 1)):
            decode_step(size, batch)
        return
    print(f"copy bandwidth: {copy_bandwidth():.2f} TB/s")
    for batch, heads, dtype in (
        (512, 6, torch.float16),
        (1, 6, torch.float16),
        (1, 20, torch.float16),
        (128, 20, torch.float16),
        (128, 20, torch.float8_e4m3fn),
        (1, 20, torch.float8_e4m3fn),
    ):
        attention(batch, heads, dtype)
    attention(512, 6, torch.float16, n=128, lengths=True)
    attention(128, 20, torch.float16, n=128, lengths=True)


if __name__ == "__main__":
    main()
