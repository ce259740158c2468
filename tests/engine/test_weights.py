"""Weight loading fails loudly: missing, unconsumed and malformed tensors are named."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.convert import read_ctranslate2
from engine.loader import PACKAGED, model_dir, package_file
from engine.weights import load_whisper


@pytest.fixture(scope="module")
def hf_dir(tiny_en):
    return tiny_en.engine.loaded.path


def _copy_with(hf_dir, tmp_path, edit):
    for f in hf_dir.iterdir():
        shutil.copy(f, tmp_path / f.name)
    state = load_file(str(hf_dir / "model.safetensors"))
    edit(state)
    save_file(state, str(tmp_path / "model.safetensors"))
    return tmp_path


def test_missing_tensor_is_named(hf_dir, tmp_path):
    path = _copy_with(hf_dir, tmp_path, lambda s: s.pop("model.decoder.layers.1.fc2.bias"))
    with pytest.raises(KeyError, match="model.decoder.layers.1.fc2.bias"):
        load_whisper(path, "cpu", torch.float32)


def test_unconsumed_tensor_is_named(hf_dir, tmp_path):
    path = _copy_with(hf_dir, tmp_path, lambda s: s.update(extra=torch.zeros(1)))
    with pytest.raises(KeyError, match="extra"):
        load_whisper(path, "cpu", torch.float32)


def test_fused_projections_equal_their_parts(hf_dir, tiny_en):
    state = load_file(str(hf_dir / "model.safetensors"))
    block = tiny_en.engine.loaded.model.decoder.blocks[2]
    prefix = "model.decoder.layers.2"
    q, k, v = block.attn.qkv.weight.chunk(3)
    assert torch.equal(k, state[f"{prefix}.self_attn.k_proj.weight"].float())
    assert not block.attn.qkv.bias.chunk(3)[1].any()
    k, v = block.cross_attn.kv.weight.chunk(2)
    assert torch.equal(v, state[f"{prefix}.encoder_attn.v_proj.weight"].float())


def test_converted_directory_is_complete_for_transformers(hf_dir):
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["vocab_size"] == 51864 and config["d_model"] == 384
    tokenizer = json.loads((hf_dir / "tokenizer.json").read_text())
    contents = {t["content"] for t in tokenizer["added_tokens"]}
    assert {"<|0.00|>", "<|30.00|>"} <= contents  # the timestamps the package lacked
    ids = {*tokenizer["model"]["vocab"].values(), *(t["id"] for t in tokenizer["added_tokens"])}
    assert ids == set(range(51864))


def test_ctranslate2_reader_refuses_other_formats(tmp_path):
    bad = tmp_path / "model.bin"
    bad.write_bytes(b"\x05\x00\x00\x00")
    with pytest.raises(ValueError, match="version 5"):
        read_ctranslate2([bad])
    original = package_file(*PACKAGED["tiny.en"][0])
    assert len(read_ctranslate2([original])) > 100


def test_unknown_model_lists_the_packaged_ones(tmp_path):
    with pytest.raises(FileNotFoundError, match="tiny.en, base"):
        model_dir("no-such-model", tmp_path)


def test_special_token_ids_differ_between_vocabularies(tiny_en, base):
    en, multi = tiny_en.engine.loaded.tokenizer, base.engine.loaded.tokenizer
    assert (en.eot, en.sot, en.no_timestamps, en.timestamp_begin) == (50256, 50257, 50362, 50363)
    assert (multi.eot, multi.sot, multi.no_timestamps, multi.timestamp_begin) == (
        50257,
        50258,
        50363,
        50364,
    )
    assert not en.is_multilingual and multi.language_ids["fr"] == 50265
