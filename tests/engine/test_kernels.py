"""The Triton kernels against their torch reference, on fresh random inputs.

Without a GPU the kernels run in Triton's interpreter (`TRITON_INTERPRET=1`, set before the
kernels are first imported): slow, but the same source, indexing and masking.
"""

import copy
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # read when triton is imported
pytest.importorskip("triton")

from engine.decoding import DecodeState, build_filters, suppressed_tokens  # noqa: E402
from engine.kernels import ceil_div, greedy  # noqa: E402
from engine.kernels.attention import (  # noqa: E402
    torch_decode_attention,
    triton_decode_attention,
)
from engine.kernels.dense import (  # noqa: E402
    torch_bn_relu_linear,
    torch_gated_conv,
    triton_bn_relu_linear,
    triton_gated_conv,
)
from engine.kernels.dtw import dtw, search, walked_back  # noqa: E402
from engine.kernels.fp8 import torch_rowwise_fp8, triton_rowwise_fp8  # noqa: E402
from engine.kernels.greedy import GreedyRules  # noqa: E402
from engine.kernels.linear import (  # noqa: E402
    STREAM,
    Tile,
    scratch,
    torch_linear,
    triton_linear,
)
from engine.kernels.median import torch_median_filter, triton_median_filter  # noqa: E402
from engine.kernels.norm import torch_add_norm, triton_add_norm  # noqa: E402
from engine.kernels.rms import (  # noqa: E402
    add_rms_norm,
    norm_rope,
    silu_mul,
    triton_add_rms_norm,
    triton_norm_rope,
    triton_silu_mul,
)
from engine.kernels.store import torch_store_kv, triton_store_kv  # noqa: E402
from engine.loader import random_tokenizer  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.mark.parametrize(
    "shapes",
    [[(1, 1)], [(7, 1), (1, 7)], [(12, 40), (30, 90), (25, 25), (5, 60)], [(70, 500), (3, 499)]],
)
def test_the_dtw_kernel_finds_the_hosts_paths(shapes):
    """Every window of a pass searched at once, each of its own size, read in place from the
    pass's padded costs from a row of its own (what lies around it is never read: NaN here):
    the host's path, ties broken alike (random costs, and costs with many equal cells)."""
    rng = np.random.default_rng(len(shapes))
    firsts = rng.integers(0, 4, len(shapes))
    for draw in (rng.normal, lambda size: rng.integers(0, 3, size).astype(np.float32)):
        costs = [draw(size=s) for s in shapes]
        rows = max(f + n for f, (n, _) in zip(firsts, shapes, strict=True))
        padded = torch.full((len(shapes), rows, max(m for _, m in shapes)), float("nan"))
        for b, (f, c) in enumerate(zip(firsts, costs, strict=True)):
            padded[b, f : f + c.shape[0], : c.shape[1]] = torch.from_numpy(c)
        spans = torch.tensor([(f, *s) for f, s in zip(firsts, shapes, strict=True)])
        walked, lengths = search(padded.to(DEVICE), spans.to(DEVICE))
        found = walked_back(walked.cpu().numpy(), lengths.cpu().numpy())
        for cost, ours in zip(costs, found, strict=True):
            theirs = dtw(cost.astype(np.float64))
            assert np.array_equal(ours[0], theirs[0]) and np.array_equal(ours[1], theirs[1])


@pytest.mark.parametrize("shape", [(1, 4), (2, 3, 40), (6, 9, 1500), (1, 1, 2 * 1024 + 5)])
def test_the_median_kernel_keeps_the_same_values_as_the_sort(shape):
    """Each value the median of its seven, reflected at both ends: torch's values exactly,
    rows of four (the shortest reflected) to a whole window and past a program's block."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))).to(DEVICE)
    assert torch.equal(triton_median_filter(x), torch_median_filter(x, 7))
    repeated = torch.randint(0, 3, shape, generator=torch.Generator().manual_seed(1)).float()
    assert torch.equal(
        triton_median_filter(repeated.to(DEVICE)).cpu(), torch_median_filter(repeated, 7)
    )


def test_the_median_kernels_network_sorts_every_order_of_seven():
    """Every order of seven distinct values, one after another in a row: the middle one of
    each, whose seven are that order, is 3."""
    import itertools

    orders = torch.tensor(list(itertools.permutations(range(7))), dtype=torch.float32)
    middles = triton_median_filter(orders.view(1, -1).to(DEVICE)).view(-1, 7)[:, 3].cpu()
    assert torch.equal(middles, torch.full((len(orders),), 3.0))


def test_the_alignment_kernels_take_any_passs_sizes_without_a_new_compile():
    """Each alignment pass has sizes of its own (windows, tokens, frames): Triton specialises a
    kernel on its integer arguments (divisible by 16 or not, one or not), and each new
    combination was a compile of about 0.1 s in the stepping thread, in 8 of 60 random passes
    and most passes of a worker's first jobs (an H100, 2026-12-07). Every size of the path
    search, its walk back and the median filter is declared not to be specialised on;
    pointers and the lanes (a few powers of two) still are. Read from their source, which is
    the engine's own (tests/test_layers.py)."""
    import ast
    from pathlib import Path

    kernels = Path(__file__).parents[2] / "engine" / "kernels"
    checked = set()
    for source in ("_dtw.py", "_median.py"):
        for node in ast.parse((kernels / source).read_text()).body:
            if not (isinstance(node, ast.FunctionDef) and node.name.endswith("_kernel")):
                continue
            [jit] = [d for d in node.decorator_list if "triton.jit" in ast.unparse(d)]
            keywords = {k.arg: ast.literal_eval(k.value) for k in getattr(jit, "keywords", [])}
            sizes = {
                a.arg
                for a in node.args.args
                if not a.arg.endswith("_ptr")
                and not (a.annotation and "constexpr" in ast.unparse(a.annotation))
            }
            assert sizes and set(keywords.get("do_not_specialize", ())) == sizes, node.name
            checked.add(node.name)
    assert checked == {"dtw_kernel", "backtrace_kernel", "median7_kernel"}


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize(
    "batch, heads, keys, dtype, lengths, kv_heads",
    [
        (2, 3, 1500, torch.float16, False, 3),  # cross-attention, split over positions
        (1, 6, 1500, torch.float32, False, 6),
        (3, 2, 192, torch.float16, True, 2),  # self-attention: each row sees its own prefix
        (2, 2, 320, torch.bfloat16, True, 2),
        (2, 3, 1500, torch.float8_e4m3fn, False, 3),  # fp8 cache, fp16 query
        (3, 4, 600, torch.float16, True, 2),  # grouped query heads (Qwen3): two a key head
        (2, 6, 700, torch.float32, True, 3),
        (1, 8, 300, torch.bfloat16, True, 2),  # four a key head
        (2, 4, 700, torch.float8_e4m3fn, True, 2),
        (8, 16, 100, torch.float16, True, 8),  # one program a key head; no split (under 128)
    ],
)
def test_decode_attention_matches_float64_reference(batch, heads, keys, dtype, lengths, kv_heads):
    g = torch.Generator().manual_seed(batch * 1000 + keys)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(DEVICE)

    q_dtype = torch.float16 if dtype == torch.float8_e4m3fn else dtype
    q = rand(batch, heads, 64).to(q_dtype)
    # a cache holds more positions than are read, and rows beyond a length hold garbage
    k = rand(batch, kv_heads, keys + 64, 64).to(dtype)[:, :, :keys]
    v = rand(batch, kv_heads, keys + 64, 64).to(dtype)[:, :, :keys]
    n = torch.randint(1, keys + 1, (batch,), generator=g).to(DEVICE) if lengths else None
    ref = torch_decode_attention(q.double(), k.double(), v.double(), n)
    out = triton_decode_attention(q, k, v, n)
    assert out.dtype == q_dtype and out.shape == (batch, heads, 64)
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < (2e-3 if q_dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("kv_heads", [2, 1])  # one a query head; one for both
@pytest.mark.parametrize("lengths", [[1, 5], [1, 448], [129, 300]])
def test_self_attention_reads_each_rows_length_whatever_the_positions_allowed(lengths, kv_heads):
    """A decode step's graph allows every position of the context (448); rows read only their
    own: splits wholly past a row's length read nothing and weigh nothing in the merge, and
    positions past it may hold anything (here NaN)."""
    g = torch.Generator().manual_seed(sum(lengths))
    batch, heads, keys = len(lengths), 2, 448
    q = torch.randn(batch, heads, 64, generator=g).to(DEVICE, torch.float16)
    k = torch.randn(batch, kv_heads, keys, 64, generator=g).to(DEVICE, torch.float16)
    v = torch.randn(batch, kv_heads, keys, 64, generator=g).to(DEVICE, torch.float16)
    n = torch.tensor(lengths, device=DEVICE)
    ref = torch_decode_attention(q.double(), k.double(), v.double(), n)
    past = torch.arange(keys, device=DEVICE)[None, None, :, None] >= n[:, None, None, None]
    nan = torch.tensor(float("nan"), device=DEVICE, dtype=torch.float16)
    out = triton_decode_attention(q, k.where(~past, nan), v.where(~past, nan), n)
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < 1e-2


@pytest.mark.parametrize(
    "n, t, start, dtype",
    [
        (3, 1, True, torch.float16),  # a decode step: one key a row, at its own position
        (2, 70, False, torch.float16),  # a prompt, or a window's cross-attention K/V
        (2, 5, True, torch.bfloat16),
        (2, 70, False, torch.float8_e4m3fn),  # clamped to the fp8 range, then cast
        (1, 3, True, torch.float32),
    ],
)
def test_store_writes_each_rows_keys_and_values_where_torch_does(n, t, start, dtype):
    """The Triton kernel writes exactly what the indexed writes do, in the slots the rows name
    (in any order), at each row's positions, and nothing else."""
    g = torch.Generator().manual_seed(n * 100 + t)
    heads, d_head, n_slots, ctx = 3, 64, 6, 160
    c = heads * d_head
    qkv = torch.randn(n, t, 3 * c, generator=g)
    if dtype == torch.float8_e4m3fn:
        # values fp8 holds exactly, and some past its range: Triton's interpreter rounds to fp8
        # unlike the GPU (and torch) at ties, so only the GPU compares arbitrary values
        qkv = 600 * qkv.clamp(-1, 1)
        if not torch.cuda.is_available():
            qkv = qkv.to(torch.float8_e4m3fn).float().where(qkv.abs() <= 448, qkv)
    qkv = qkv.to(DEVICE, torch.float16 if dtype == torch.float8_e4m3fn else dtype)  # the model's
    k, v = qkv[..., c : 2 * c], qkv[..., 2 * c :]  # views of a fused projection
    rows = torch.randperm(n_slots, generator=g)[:n].to(DEVICE)
    first = torch.randint(0, ctx - t, (n,), generator=g).to(DEVICE) if start else None
    caches = [torch.randn(n_slots, heads, ctx, d_head, generator=g).to(DEVICE, dtype) for _ in "kv"]
    expected = [cache.clone() for cache in caches]
    torch_store_kv(k, v, *expected, rows, first)
    triton_store_kv(k, v, *caches, rows, first)
    for out, ref in zip(caches, expected, strict=True):
        assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))
    written = expected[1].float()[rows]
    assert (
        (written.abs() <= 448).all() if dtype == torch.float8_e4m3fn else written.isfinite().all()
    )


GPU_ONLY = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="Triton's interpreter multiplies bf16 wrongly"
)
GPU_SIZE = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="a real window's size: minutes in the interpreter"
)


@pytest.mark.parametrize(
    "rows, k, n, dtype",
    [
        (1, 384, 1152, torch.float16),  # batch 1: tiny's qkv
        (5, 384, 1536, torch.float16),  # the MLP's first layer
        (16, 1536, 384, torch.float16),  # its second, over several blocks of inputs
        (3, 200, 70, torch.float16),  # sizes no block divides
        (150, 96, 160, torch.float16),  # tiles of rows (the encoder), none dividing them
        pytest.param(4, 512, 256, torch.bfloat16, marks=GPU_ONLY),
        pytest.param(1500, 384, 1536, torch.float16, marks=GPU_SIZE),  # a tiny window's fc1
    ],
)
@pytest.mark.parametrize(
    "norm, gelu, residual",
    [(True, False, False), (False, False, True), (True, True, False), (True, True, True)],
)
def test_fused_linear_matches_float64_reference(rows, k, n, dtype, norm, gelu, residual):
    """`residual + gelu(linear(layer_norm(x)))` in one kernel, against the same in float64,
    as close as torch's own unfused fp16 path is (each rounds its intermediates once more)."""
    g = torch.Generator().manual_seed(rows * k + n)

    def rand(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g) * scale + shift).to(DEVICE, dtype)

    linear = torch.nn.Linear(k, n).to(DEVICE, dtype).requires_grad_(False)
    ln = torch.nn.LayerNorm(k).to(DEVICE, dtype).requires_grad_(False) if norm else None
    if ln is not None:  # a layer norm far from the identity, over rows far from normal
        ln.weight.copy_(rand(k, shift=1.0))
        ln.bias.copy_(rand(k))
    x = rand(rows, 1, k, scale=3.0, shift=1.0)
    r = rand(rows, 1, n) if residual else None
    wide = copy.deepcopy(ln).double() if ln is not None else None
    ref = torch_linear(
        x.double(),
        linear.weight.double(),
        linear.bias.double(),
        wide,
        gelu,
        None if r is None else r.double(),
    )
    # on the CPU (Triton's interpreter) a smaller tile, so that rows span several
    tile = Tile(64, 64, 32, 4, 2) if rows > 16 and not torch.cuda.is_available() else None
    out = triton_linear(x, linear.weight, linear.bias, ln, gelu, r, tile)
    plain = torch_linear(x, linear.weight, linear.bias, ln, gelu, r)
    assert out.dtype == dtype and out.shape == (rows, 1, n)
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < max(2 * relative_error(plain, ref), 1e-3)


@pytest.mark.parametrize("split", [2, 3, 5])
def test_a_product_split_over_its_inputs_sums_the_shares_alike_every_call(split):
    """Programs that each take a share of the inputs write partial sums; the last of each
    block to arrive adds them in a fixed order and finishes it (bias, GELU, residual), then
    resets its arrival count: every call starts clean and gives the same bits."""
    g = torch.Generator().manual_seed(split)
    rows, k, n = 3, 1200, 80
    linear = torch.nn.Linear(k, n).to(DEVICE, torch.float16).requires_grad_(False)
    ln = torch.nn.LayerNorm(k).to(DEVICE, torch.float16).requires_grad_(False)
    x = torch.randn(rows, 1, k, generator=g).to(DEVICE, torch.float16)
    r = torch.randn(rows, 1, n, generator=g).to(DEVICE, torch.float16)
    wide = copy.deepcopy(ln).double()
    ref = torch_linear(
        x.double(), linear.weight.double(), linear.bias.double(), wide, True, r.double()
    )
    whole = triton_linear(x, linear.weight, linear.bias, ln, True, r, split=1)
    shares = [triton_linear(x, linear.weight, linear.bias, ln, True, r, split=split) for _ in "ab"]
    assert relative_error(shares[0], ref) < 1e-3
    assert torch.allclose(shares[0], whole, rtol=2e-3, atol=2e-3)
    assert torch.equal(shares[0], shares[1])
    assert not scratch(x.device, n, ceil_div(n, STREAM.block_n))[1].any()


@pytest.mark.parametrize(
    "rows, d, dtype",
    [(7, 384, torch.float16), (3, 1280, torch.float16), (5, 200, torch.float32)],
)
def test_add_norm_matches_torchs_add_then_layer_norm(rows, d, dtype):
    """The sum as torch's add writes it (rounded to the dtype), bit for bit; its layer norm as
    close to float64's as torch's own, over rows far from normal (a large mean, widths no
    block divides)."""
    g = torch.Generator().manual_seed(rows * d)

    def rand(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g) * scale + shift).to(DEVICE, dtype)

    norm = torch.nn.LayerNorm(d).to(DEVICE, dtype).requires_grad_(False)
    norm.weight.copy_(rand(d, shift=1.0))
    norm.bias.copy_(rand(d))
    x, y = rand(2, rows, d, scale=3.0, shift=5.0), rand(2, rows, d, scale=2.0)
    s, h = triton_add_norm(x, y, norm)
    plain_s, plain_h = torch_add_norm(x, y, norm)
    _, ref = torch_add_norm(x.double(), y.double(), copy.deepcopy(norm).double())
    assert s.dtype == h.dtype == dtype and h.shape == x.shape
    assert torch.equal(s, plain_s)
    assert relative_error(h, ref) < max(2 * relative_error(plain_h, ref), 1e-6)


@pytest.mark.parametrize(
    "rows, d, dtype, residual",
    [
        (7, 1024, torch.float16, True),
        (3, 2048, torch.float16, False),
        (5, 200, torch.float32, True),
    ],
)
def test_add_rms_norm_matches_torchs_add_then_qwen3s_rms_norm(rows, d, dtype, residual):
    """The sum bit for bit; the norm as close to float64's as torch's own ops (Qwen3's
    RMSNorm: normalised in fp32, rounded, scaled in the dtype)."""
    g = torch.Generator().manual_seed(rows * d)
    x = (torch.randn(rows, d, generator=g) * 3 + 2).to(DEVICE, dtype)
    y = (torch.randn(rows, d, generator=g) * 2).to(DEVICE, dtype) if residual else None
    w = (torch.randn(d, generator=g) + 1).to(DEVICE, dtype)
    s, h = triton_add_rms_norm(x, y, w, 1e-6)
    plain_s, plain_h = add_rms_norm(x, y, w, 1e-6)
    _, ref = add_rms_norm(x.double(), None if y is None else y.double(), w.double(), 1e-6)
    assert s.dtype == h.dtype == dtype and h.shape == x.shape
    assert torch.equal(s, plain_s)
    assert relative_error(h, ref) < max(2 * relative_error(plain_h, ref), 1e-6)


@pytest.mark.parametrize("d, dtype", [(128, torch.float16), (64, torch.float32)])
def test_norm_rope_writes_torchs_rotated_norms_into_a_fused_projection(d, dtype):
    """Queries and keys normed and rotated in place, as views of one q|k|v projection (the
    decode step's), as close to float64's as torch's ops; the values beside them untouched."""
    g = torch.Generator().manual_seed(d)
    rows, heads, kv = 5, 4, 2
    fused = (torch.randn(rows, heads + 2 * kv, d, generator=g) * 4).to(DEVICE, dtype)
    angles = torch.rand(rows, d // 2, generator=g).repeat(1, 2) * 100
    cos, sin = angles.cos().to(DEVICE, dtype), angles.sin().to(DEVICE, dtype)
    w = (torch.randn(d, generator=g) + 1).to(DEVICE, dtype)
    before = fused.clone()
    for part in fused.split([heads, kv, kv], dim=1)[:2]:
        plain = norm_rope(part.clone(), w, 1e-6, cos, sin, out=torch.empty_like(part))
        ref = norm_rope(part.double(), w.double(), 1e-6, cos.double(), sin.double(),
                        out=torch.empty_like(part, dtype=torch.float64))  # fmt: skip
        assert triton_norm_rope(part, w, 1e-6, cos, sin, out=part) is part
        assert relative_error(part, ref) < max(2 * relative_error(plain, ref), 1e-6)
    assert torch.equal(fused[:, heads + kv :], before[:, heads + kv :])


@pytest.mark.parametrize("n, dtype", [(3072, torch.float16), (100, torch.float32)])
def test_silu_mul_matches_torchs_silu_times_up(n, dtype):
    g = torch.Generator().manual_seed(n)
    x = (torch.randn(3, 2 * n, generator=g) * 3).to(DEVICE, dtype)
    out, plain = triton_silu_mul(x), silu_mul(x)
    ref = silu_mul(x.double())
    assert out.shape == (3, n) and out.dtype == dtype
    assert relative_error(out, ref) < max(2 * relative_error(plain, ref), 1e-6)


@GPU_SIZE
def test_the_encoder_through_its_fused_kernels_is_as_close_to_fp32_as_torchs_fp16():
    """The encoder with each residual add and layer norm fused (the engine on CUDA), against
    the same random weights in fp32: no further from it than torch's fp16."""
    from engine.loader import load_model
    from engine.mel import N_FRAMES

    loaded = load_model("random:tiny", device=DEVICE, dtype=torch.float16)
    torch.manual_seed(0)
    mel = torch.randn(2, loaded.dims.n_mels, N_FRAMES, device=DEVICE)
    encoder = loaded.model.encoder
    with torch.inference_mode():
        fused, plain = encoder(mel.half(), triton=True), encoder(mel.half())
        ref = copy.deepcopy(encoder).float()(mel).double()
    assert torch.isfinite(fused).all()
    assert relative_error(fused, ref) < max(2 * relative_error(plain, ref), 1e-3)


@pytest.fixture(scope="module")
def rules():
    tok, n_vocab = random_tokenizer("tiny"), 51865  # Whisper's multilingual vocabulary
    suppress = suppressed_tokens(tok, [1, 2, 7, 8, 9, 10, 14, 25, 26, 27, 28, 29, 31], ())
    filters = build_filters(tok, n_vocab, suppress, True, 1.0, 1500, DEVICE)
    return GreedyRules(filters, n_vocab, DEVICE, triton=True), tok


def random_state(tok, rows: int, g: torch.Generator) -> DecodeState:
    """Histories of text and timestamp tokens of random lengths, as the decode state keeps them."""
    begin = tok.timestamp_begin
    n_sampled, last, penultimate, last_ts = [], [], [], []
    for _ in range(rows):
        n = int(torch.randint(0, 6, (), generator=g))
        history = []
        for _ in range(n):
            stamp = bool(torch.rand((), generator=g) < 0.4)
            high = 1500 if stamp else 50000
            history.append((begin if stamp else 0) + int(torch.randint(0, high, (), generator=g)))
        stamps = [t for t in history if t >= begin]
        n_sampled.append(n)
        last.append(history[-1] if n >= 1 else -1)
        penultimate.append(history[-2] if n >= 2 else -1)
        last_ts.append(stamps[-1] if stamps else -1)

    def t(x):
        return torch.tensor(x, device=DEVICE)

    return DecodeState(
        n_sampled=t(n_sampled),
        last=t(last),
        penultimate=t(penultimate),
        last_timestamp=t(last_ts),
        timestamps=(torch.rand(rows, generator=g) < 0.7).to(DEVICE),
        min_tokens=torch.randint(0, 3, (rows,), generator=g).to(DEVICE),
    )


@pytest.mark.parametrize("timestamps", [True, False])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_greedy_kernel_matches_torch_filters(rules, timestamps, dtype):
    rules, tok = rules
    g = torch.Generator().manual_seed(7 + timestamps)
    rows, n_vocab = 16, rules.n_vocab
    # a padded logits buffer, as the decoder's head writes it, read through a view
    logits = torch.randn(rows, n_vocab + 39, generator=g) * 3
    # on about half the rows, timestamps together outweigh the best text token
    boost = (torch.rand(rows, 1, generator=g) < 0.5) * 4.0
    logits[:, tok.timestamp_begin : n_vocab] += boost
    logits = logits.to(dtype).to(DEVICE)[:, :n_vocab]
    state = random_state(tok, rows, g)

    ref_token, ref_logprob = rules.torch_select(logits, state, timestamps)
    token, logprob = rules.triton_select(logits, state, timestamps)
    assert torch.equal(token, ref_token)
    torch.testing.assert_close(logprob, ref_logprob, rtol=1e-5, atol=1e-4)
    if timestamps:  # the inputs reach the timestamp rules' branches
        assert ((ref_token >= tok.timestamp_begin) & state.timestamps).any()
        assert ((ref_token < tok.eot) & state.timestamps).any()


def test_a_row_without_timestamps_chooses_alike_in_a_step_that_applies_them(rules):
    """On CUDA every decode step applies the timestamp rules, each row by its own flag (one
    graph for both kinds of row): a row that does not predict timestamps must choose what a
    step without the rules chooses."""
    rules, tok = rules
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(12, rules.n_vocab, generator=g) * 3
    logits[:, tok.timestamp_begin :] += 4.0  # timestamps would win where the rules apply
    logits = logits.to(torch.float16).to(DEVICE)
    state = random_state(tok, 12, g)
    plain = ~state.timestamps
    assert plain.any() and state.timestamps.any()
    token, logprob = rules.triton_select(logits, state, True)
    ref_token, ref_logprob = rules.torch_select(logits, state, False)
    assert torch.equal(token[plain], ref_token[plain])
    torch.testing.assert_close(logprob[plain], ref_logprob[plain], rtol=1e-5, atol=1e-4)
    assert (token[state.timestamps] >= tok.timestamp_begin).any()  # the others did apply them


def test_the_rows_that_sample_keep_their_filtered_logits_and_the_others_write_none(rules):
    """One graph serves steps with and without sampling rows: the fused kernel writes the
    filtered logits of the rows whose temperature is above 0 (they draw from them), exactly as
    the filters in torch make them, and leaves the other rows' buffer alone."""
    rules, tok = rules
    g = torch.Generator().manual_seed(13)
    rows = 12
    logits = torch.randn(rows, rules.n_vocab, generator=g) * 3
    logits[: rows // 2, tok.timestamp_begin :] += 4.0
    logits = logits.to(torch.float16).to(DEVICE)
    state = random_state(tok, rows, g)
    temperature = torch.where(torch.rand(rows, generator=g) < 0.5, 0.6, 0.0).to(DEVICE)
    sampling = temperature > 0
    assert sampling.any() and (~sampling).any()
    filtered = torch.full((rows, rules.n_vocab), float("nan"), device=DEVICE)

    token, logprob = rules.triton_select(logits, state, True, (filtered, temperature))
    ref_token, ref_logprob = rules.torch_select(logits, state, True)
    assert torch.equal(token, ref_token)  # keeping changes no choice
    torch.testing.assert_close(logprob, ref_logprob, rtol=1e-5, atol=1e-4)
    assert torch.equal(filtered[sampling], rules.apply(logits, state, True)[sampling])
    assert filtered[~sampling].isnan().all()


@pytest.mark.parametrize("timestamps", [True, False])
def test_a_rows_choice_is_the_same_however_its_vocabulary_is_shared_out(
    rules, timestamps, monkeypatch
):
    """A few rows' vocabularies are shared out over programs (26 a row here, at batch 3),
    many rows' are not: a row's token and kept logits must not depend on which, nor its
    log-probability (the same bits in Triton's interpreter; on a GPU the compiler may fuse
    the merge's multiply-adds differently)."""
    rules, tok = rules
    g = torch.Generator().manual_seed(17 + timestamps)
    rows = 3
    logits = torch.randn(rows, rules.n_vocab, generator=g) * 3
    logits[:2, tok.timestamp_begin :] += 4.0
    logits = logits.to(torch.float16).to(DEVICE)
    state = random_state(tok, rows, g)
    state.timestamps[:] = torch.tensor([True, True, False])
    temperature = torch.tensor([0.0, 0.7, 0.7], device=DEVICE)

    def select(target):
        monkeypatch.setattr(greedy, "TARGET_PROGRAMS", target)
        filtered = torch.full((rows, rules.n_vocab), float("nan"), device=DEVICE)
        token, logprob = rules.triton_select(logits, state, timestamps, (filtered, temperature))
        return token, logprob, filtered

    shared, alone = select(greedy.TARGET_PROGRAMS), select(1)  # 26 programs a row, and one
    assert torch.equal(shared[0], alone[0])
    assert torch.equal(shared[2].nan_to_num(), alone[2].nan_to_num())
    if DEVICE.type == "cpu":
        assert torch.equal(shared[1], alone[1])
    else:
        torch.testing.assert_close(shared[1], alone[1], rtol=1e-6, atol=0)
    ref_token, ref_logprob = rules.torch_select(logits, state, timestamps)
    assert torch.equal(shared[0], ref_token)
    torch.testing.assert_close(shared[1], ref_logprob, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(
    "k, n, bias, relu", [(96, 128, True, True), (160, 48, False, False), (200, 70, True, False)]
)
def test_bn_relu_linear_reads_its_slice_of_the_block_as_torch_does(k, n, bias, relu, dtype):
    """act(relu(x * scale + shift) @ w.T + b) in one kernel, its input a slice of a wider
    buffer (as a dense layer reads its block), as close to float64 as torch's own path; rows
    and widths no tile divides, shifts that the ReLU cuts."""
    g = torch.Generator().manual_seed(k * n)

    def rand(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g) * scale + shift).to(DEVICE, dtype)

    block = rand(3, 37, 224, scale=2.0)
    x = block[..., :k]
    scale, shift = rand(k, scale=0.5, shift=1.0), rand(k)
    w, b = rand(n, k, scale=k**-0.5), rand(n) if bias else None
    wide = [t.double() if t is not None else None for t in (x, scale, shift, w, b)]
    ref = torch_bn_relu_linear(*wide, relu)
    out = triton_bn_relu_linear(x, scale, shift, w, b, relu)
    plain = torch_bn_relu_linear(x, scale, shift, w, b, relu)
    assert out.dtype == dtype and out.shape == (3, 37, n)
    assert relative_error(out, ref) < max(2 * relative_error(plain, ref), 1e-5)
    if relu:
        assert (out >= 0).all()


@pytest.mark.parametrize(
    "frames, dilation, segment", [(75, 1, 100), (150, 2, 100), (37, 2, 16), (5, 2, 100)]
)
def test_gated_conv_writes_its_slice_as_torch_does(frames, dilation, segment):
    """A CAM layer's dilated convolution times its segments' gates, written in place into its
    32 channels of a wider block: as close to float64 as torch's path, each window's ends
    padded with zeros (a window shorter than the convolution's reach too), every other channel
    of the block untouched."""
    g = torch.Generator().manual_seed(frames * dilation)
    n, k = 3, 128
    rand = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g) * scale).to(DEVICE)  # noqa: E731
    h = rand(n, frames, k).half()
    w = rand(32, 3 * k, scale=(3 * k) ** -0.5).half()
    gate = torch.rand(n, -(-frames // segment), 32, generator=g).to(DEVICE).half()
    block = torch.full((n, frames, 200), 7.0, device=DEVICE, dtype=torch.float16)
    triton_gated_conv(h, w, dilation, gate, segment, block[..., 40:72])
    ref = torch.zeros(n, frames, 32, device=DEVICE, dtype=torch.float64)
    torch_gated_conv(h.double(), w.double(), dilation, gate.double(), segment, ref)
    plain = torch.zeros(n, frames, 32, device=DEVICE, dtype=torch.float16)
    torch_gated_conv(h, w, dilation, gate, segment, plain)
    assert relative_error(block[..., 40:72], ref) < max(2 * relative_error(plain, ref), 1e-5)
    assert (block[..., :40] == 7).all() and (block[..., 72:] == 7).all()


@pytest.mark.parametrize("k", [384, 1280, 5120, 200])
def test_rowwise_fp8_casts_each_row_as_torch_does(k):
    """Each row's scale (its largest magnitude over 448) and its e4m3 values as torch's
    passes make them, over rows of very different magnitudes, a width no power of two; enough
    rows that an approximate division shows (it moved 2 values in 100,000 on an H100)."""
    g = torch.Generator().manual_seed(k)
    rows = 512
    x = torch.randn(rows, k, generator=g) * torch.logspace(-3, 3, rows)[:, None]
    x = x.to(DEVICE, torch.float16)
    q, scale = triton_rowwise_fp8(x)
    plain_q, plain_scale = torch_rowwise_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (rows, 1)
    assert torch.allclose(scale, plain_scale, rtol=1e-6)
    q, plain_q = q.float(), plain_q.float()
    if torch.cuda.is_available():
        assert torch.equal(q, plain_q)
    else:  # Triton's interpreter rounds ties away from zero (84 to 88; GPUs to even, 80),
        # drops the carry of a mantissa rounded up into the next power of two (-31.09 to -16,
        # not -32) and rounds into e4m3's subnormals (below 2**-6) its own way: every value it
        # casts otherwise, as torch does
        scaled = x.float() / scale
        tie = (scaled - plain_q).abs() * 2 == (q - plain_q).abs()
        carry = (q * 2 == plain_q) & (plain_q.abs().log2() % 1 == 0)
        subnormal = scaled.abs() < 2**-6
        assert (tie | carry | subnormal)[q != plain_q].all()
