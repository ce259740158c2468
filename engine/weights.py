"""Load Hugging Face Whisper weights into the engine's network (`engine.model.Whisper`).

Source layout (`WhisperForConditionalGeneration` state dict):

    model.encoder.conv{1,2}.{weight,bias}          model.encoder.embed_positions.weight
    model.encoder.layers.N.self_attn.{q,k,v,out}_proj        (k_proj has no bias)
    model.encoder.layers.N.{self_attn_layer_norm,final_layer_norm,fc1,fc2}
    model.encoder.layer_norm
    model.decoder.embed_tokens.weight              model.decoder.embed_positions.weight
    model.decoder.layers.N.self_attn.{q,k,v,out}_proj
    model.decoder.layers.N.encoder_attn.{q,k,v,out}_proj
    model.decoder.layers.N.{self_attn_layer_norm,encoder_attn_layer_norm,final_layer_norm,fc1,fc2}
    model.decoder.layer_norm                       proj_out.weight (tied to embed_tokens; optional)

q/k/v are fused into `attn.qkv` and cross-attention k/v into `cross_attn.kv`, with zeros for
the missing key bias. A missing key or a key nothing consumed raises, naming it. Tensors are
cast one at a time, so the host never holds a second full copy in another dtype.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import Tensor

from engine.model import ModelDimensions, Whisper, padded_vocab

# Keys a checkpoint may carry that the engine derives instead.
_IGNORED = {"proj_out.weight"}


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / shard for shard in shards]
    if (path / "model.safetensors").exists():
        return [path / "model.safetensors"]
    raise FileNotFoundError(f"{path} holds no model.safetensors (a Hugging Face model directory)")


def tensors(path: Path) -> dict[str, Callable[[], Tensor]]:
    """Lazy getters for every tensor in the checkpoint, by Hugging Face name."""
    getters: dict[str, Callable[[], Tensor]] = {}
    for file in _checkpoint_files(path):
        handle = safe_open(str(file), framework="pt")
        for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
            getters[name] = lambda h=handle, n=name: h.get_tensor(n)
    return getters


def _mapping(dims: ModelDimensions) -> dict[str, list[str | None]]:
    """Engine parameter name -> Hugging Face names concatenated along axis 0 (None = zeros)."""
    m: dict[str, list[str | None]] = {}

    def same(ours: str, theirs: str, bias: bool = True) -> None:
        m[f"{ours}.weight"] = [f"{theirs}.weight"]
        if bias:
            m[f"{ours}.bias"] = [f"{theirs}.bias"]

    def fused(ours: str, theirs: str, parts: tuple[str, ...]) -> None:
        m[f"{ours}.weight"] = [f"{theirs}.{p}_proj.weight" for p in parts]
        m[f"{ours}.bias"] = [None if p == "k" else f"{theirs}.{p}_proj.bias" for p in parts]

    for side, n_layer in (("encoder", dims.n_audio_layer), ("decoder", dims.n_text_layer)):
        for i in range(n_layer):
            ours, theirs = f"{side}.blocks.{i}", f"model.{side}.layers.{i}"
            same(f"{ours}.attn_ln", f"{theirs}.self_attn_layer_norm")
            fused(f"{ours}.attn.qkv", f"{theirs}.self_attn", ("q", "k", "v"))
            same(f"{ours}.attn.out", f"{theirs}.self_attn.out_proj")
            if side == "decoder":
                same(f"{ours}.cross_attn_ln", f"{theirs}.encoder_attn_layer_norm")
                same(f"{ours}.cross_attn.q", f"{theirs}.encoder_attn.q_proj")
                fused(f"{ours}.cross_attn.kv", f"{theirs}.encoder_attn", ("k", "v"))
                same(f"{ours}.cross_attn.out", f"{theirs}.encoder_attn.out_proj")
            same(f"{ours}.mlp_ln", f"{theirs}.final_layer_norm")
            same(f"{ours}.fc1", f"{theirs}.fc1")
            same(f"{ours}.fc2", f"{theirs}.fc2")
    same("encoder.conv1", "model.encoder.conv1")
    same("encoder.conv2", "model.encoder.conv2")
    same("encoder.ln_post", "model.encoder.layer_norm")
    m["encoder.positional_embedding"] = ["model.encoder.embed_positions.weight"]
    same("decoder.token_embedding", "model.decoder.embed_tokens", bias=False)
    m["decoder.positional_embedding"] = ["model.decoder.embed_positions.weight"]
    same("decoder.ln", "model.decoder.layer_norm")
    return m


def read_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def load_whisper(path: Path, device: torch.device | str, dtype: torch.dtype) -> Whisper:
    """Build the engine network from a Hugging Face Whisper directory."""
    dims = ModelDimensions.from_hf_config(read_config(path))
    getters = tensors(path)
    mapping = _mapping(dims)
    missing = sorted({n for names in mapping.values() for n in names if n and n not in getters})
    if missing:
        raise KeyError(f"{path}: checkpoint lacks {len(missing)} tensors: {missing[:8]}")
    consumed = {n for names in mapping.values() for n in names if n} | _IGNORED
    unconsumed = sorted(set(getters) - consumed)
    if unconsumed:
        raise KeyError(f"{path}: checkpoint tensors the engine does not use: {unconsumed[:8]}")

    with torch.device("meta"):
        model = Whisper(dims)
    state: dict[str, Tensor] = {}
    for ours, names in mapping.items():
        parts = [getters[n]().to(device=device, dtype=dtype) for n in names if n]
        if None in names:  # the key projection's bias, absent by design
            zeros = torch.zeros_like(parts[0])
            parts.insert(names.index(None), zeros)
        state[ours] = torch.cat(parts) if len(parts) > 1 else parts[0]
    embedding = state["decoder.token_embedding.weight"]
    padding = padded_vocab(dims.n_vocab) - dims.n_vocab
    state["decoder.token_embedding.weight"] = F.pad(embedding, (0, 0, 0, padding))
    model.load_state_dict(state, assign=True, strict=True)
    return model.eval().requires_grad_(False)
