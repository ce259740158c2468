"""Time the decode-attention kernel's settings, the small-batch fused linear's, the encoder's
attention backends and the log-mel on the GPU.

For each shape: the bytes the cross-attention must read, the time of PyTorch's SDPA (whatever
backend it picks) and of the Triton kernel under each setting (checked against SDPA first),
as achieved bandwidth. Then the encoder under each SDPA backend.

    python scripts/tune_kernels.py [--encoder | --mel | --linear]

The fused linear (`engine.kernels.linear`): each decoder projection of large-v3 and the
logits of tiny and large-v3 at 1 to 16 rows (the larger weights also split over their
inputs): torch's unfused path (layer norm, product, GELU, residual add, as the engine ran
them before) against the Triton kernel under each setting, as the weights' bandwidth.
"""

import itertools
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.runtime.errors import OutOfResources

from engine.inputs import audio_sources
from engine.kernels.attention import torch_decode_attention, triton_decode_attention
from engine.kernels.linear import SPLIT_FROM, torch_linear, triton_linear
from engine.loader import load_model
from engine.mel import N_FRAMES
from engine.model import EncoderBlock, merge_heads, split_heads


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


def attention(batch: int, heads: int, dtype, n: int = 1500, lengths: bool = False) -> None:
    d = 64
    q = torch.randn(batch, heads, d, device="cuda", dtype=torch.float16)
    k = torch.randn(batch, heads, n, d, device="cuda").to(dtype)
    v = torch.randn(batch, heads, n, d, device="cuda").to(dtype)
    seen = torch.randint(n - 30, n + 1, (batch,), device="cuda") if lengths else None
    gbytes = 2 * k.numel() * k.element_size() / 1e9
    ref = torch_decode_attention(q.float(), k.float(), v.float(), seen)
    rows = []
    if dtype == torch.float16:
        rows.append(("sdpa", graphed(lambda: torch_decode_attention(q, k, v, seen))))
    for block_n, target, warps, stages in itertools.product(
        (64, 128, 256), (1024, 8192), (4, 8), (None, 2, 4)
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
    print(f"{what}-attention b={batch} h={heads} n={n} {str(dtype)[6:]}: {gbytes * 1000:.0f} MB")
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
                return triton_linear(x, w, b, ln, gelu, r, bn, bk, wa, st, sp)

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


def split_qkv_forward(self, x):
    """EncoderBlock.forward with q, k and v from three products, each contiguous."""
    h, d = self.attn.n_head, x.shape[-1]
    y = self.attn_ln(x)
    w, b = self.attn.qkv.weight, self.attn.qkv.bias
    q, k, v = (F.linear(y, w[i * d : (i + 1) * d], b[i * d : (i + 1) * d]) for i in range(3))
    a = F.scaled_dot_product_attention(split_heads(q, h), split_heads(k, h), split_heads(v, h))
    x = x + self.attn.out(merge_heads(a))
    return x + self.fc2(F.gelu(self.fc1(self.mlp_ln(x))))


def encoder(size: str, batch: int) -> None:
    m = load_model(f"random:{size}", device="cuda", dtype=torch.float16)
    mel = torch.randn(batch, m.dims.n_mels, N_FRAMES, device="cuda", dtype=torch.float16)
    fused_forward = EncoderBlock.forward
    with torch.inference_mode():
        ref = m.model.encoder(mel).float()
        for variant, backend in itertools.product(
            ("fused qkv", "split qkv"),
            (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION),
        ):
            EncoderBlock.forward = split_qkv_forward if variant == "split qkv" else fused_forward
            try:
                with sdpa_kernel(backend):
                    out = m.model.encoder(mel).float()
                    err = float((out - ref).norm() / ref.norm())
                    ms = graphed(lambda: m.model.encoder(mel), calls=2)
            except RuntimeError as e:
                print(f"encoder {size} {variant} {backend.name}: {e}"[:200])
                continue
            finally:
                EncoderBlock.forward = fused_forward
            print(
                f"encoder {size} b={batch} {variant} {backend.name}: {ms:.2f} ms "
                f"({ms / batch:.3f} ms/window, rel. diff {err:.1e})"
            )
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            m.model.encoder(mel)
            torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)
    print("\n".join(line[:60] + line[-75:] for line in table.splitlines()))


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
    if "--encoder" in sys.argv:
        encoder("tiny", 32)
        encoder("large-v3", 8)
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
