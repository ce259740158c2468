"""The fp8 encoder: its products against the same e4m3 values in fp32, and a model's text with
it (the CPU rounds as the GPU's fp8 tensor cores do, in fp32 arithmetic)."""

import pytest
import torch
import torch.nn.functional as F

from engine import Engine, EngineConfig
from engine.kernels.fp8 import FP8
from engine.quantize import Fp8Linear, fp8_encoder
from tests.conftest import transcribe
from tools.evaluate import GREEDY


def e4m3_rows(x: torch.Tensor) -> torch.Tensor:
    """x with each row rounded to e4m3 under a scale that maps its largest value to 448."""
    scale = x.abs().amax(-1, keepdim=True).float() / 448
    return (x / scale).to(FP8).float() * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_product_is_its_rounded_operands_product(dtype):
    torch.manual_seed(0)
    linear = torch.nn.Linear(384, 1536).to(dtype)
    x = (torch.randn(2, 50, 384) * torch.logspace(-2, 2, 384)).to(dtype)  # rows of any scale
    out = Fp8Linear(linear)(x)
    rounded = F.linear(e4m3_rows(x.float()), e4m3_rows(linear.weight.float()), linear.bias.float())
    assert out.dtype == dtype and out.shape == (2, 50, 1536)
    assert torch.allclose(out.float(), rounded, rtol=2e-3, atol=2e-3)
    exact = linear.float()(x.float())
    assert 0 < (out.float() - exact).norm() / exact.norm() < 0.05  # e4m3: 3 mantissa bits


def test_every_encoder_product_becomes_fp8_and_nothing_else():
    stream = Engine.open(EngineConfig(model="random:tiny", device="cpu"))
    model = stream.engine.loaded.model
    decoder_before = {n: p.clone() for n, p in model.decoder.named_parameters()}
    fp8_encoder(model.encoder)
    for block in model.encoder.blocks:
        for linear in (block.attn.qkv, block.attn.out, block.fc1, block.fc2):
            assert isinstance(linear, Fp8Linear) and linear.weight.dtype == FP8
    assert not any(isinstance(m, Fp8Linear) for m in model.decoder.modules())
    assert all(torch.equal(p, decoder_before[n]) for n, p in model.decoder.named_parameters())


def test_tiny_en_with_an_fp8_encoder_reads_speech_as_with_its_own(tiny_en, clips):
    fp8 = Engine.open(EngineConfig(model="tiny.en", device="cpu", encoder="fp8"))
    for name in ("en_jfk", "en_librispeech_1272-128104-0000"):
        ours = transcribe(fp8, clips[name].bytes, GREEDY).text
        assert ours == transcribe(tiny_en, clips[name].bytes, GREEDY).text, name
