"""Convert a CTranslate2 (faster-whisper) Whisper directory to the Hugging Face layout.

Source layout (CTranslate2 `WhisperSpec`, binary format version 6, `model.bin`):

    encoder/conv{1,2}/{weight,bias}                 encoder/position_encodings/encodings
    encoder/layer_N/self_attention/linear_0         q, k, v fused along the output axis
    encoder/layer_N/self_attention/linear_1         output projection
    encoder/layer_N/{self_attention,ffn}/layer_norm/{gamma,beta}
    encoder/layer_N/ffn/linear_{0,1}                fc1, fc2
    decoder/embeddings/weight                       decoder/position_encodings/encodings
    decoder/layer_N/self_attention/linear_{0,1}     fused q, k, v; output projection
    decoder/layer_N/attention/linear_0              cross-attention q
    decoder/layer_N/attention/linear_1              cross-attention k, v fused
    decoder/layer_N/attention/linear_2              cross-attention output projection
    decoder/layer_N/{self_attention,attention,ffn}/layer_norm/{gamma,beta}
    decoder/layer_N/ffn/linear_{0,1}
    {encoder,decoder}/layer_norm/{gamma,beta}       plus scalars (num_heads, activation, ...)

The fused key biases are zeros (Whisper's k projections have none) and are checked, not kept.
Tensors keep their stored dtype (float16 for the packaged models). The directory's
`tokenizer.json` may lack the 1501 timestamp tokens; they are added from the vocabulary file so
the vocabulary matches the model's embedding.
"""

from __future__ import annotations

import io
import json
import re
import struct
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

_CT2_DTYPES = (np.float32, np.int8, np.int16, np.int32, np.float16, "bfloat16")
_CT2_VERSION = 6
# Part of the cache key of converted directories: bump when the output changes.
CONVERTER_VERSION = 2

# Every scalar or array the converter reads as configuration rather than as a weight.
_CT2_SETTINGS = {
    "encoder/num_heads",
    "decoder/num_heads",
    "decoder/activation",
    "decoder/alibi",
    "decoder/alibi_use_positive_positions",
    "decoder/scale_alibi",
    "decoder/alignment_heads",
    "decoder/alignment_layer",
    "decoder/pre_norm",
    "decoder/scale_embeddings",
    "decoder/start_from_zero_embedding",
}


def read_ctranslate2(parts: Iterable[Path]) -> dict[str, np.ndarray]:
    """Read a CTranslate2 `model.bin` (given as one file or as parts to join in order)."""
    data = b"".join(Path(p).read_bytes() for p in parts)
    f = io.BytesIO(data)

    def unpack(fmt: str):
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

    def string() -> str:
        return f.read(unpack("H"))[:-1].decode()

    version = unpack("I")
    if version != _CT2_VERSION:
        raise ValueError(f"CTranslate2 model.bin version {version}; expected {_CT2_VERSION}")
    spec, _revision = string(), unpack("I")
    if spec != "WhisperSpec":
        raise ValueError(f"CTranslate2 model is a {spec}; expected a WhisperSpec")
    variables: dict[str, np.ndarray] = {}
    for _ in range(unpack("I")):
        name = string()
        shape = tuple(unpack("I") for _ in range(unpack("B")))
        dtype = _CT2_DTYPES[unpack("B")]
        raw = f.read(unpack("I"))
        if dtype == "bfloat16":
            raise ValueError(f"{name} is bfloat16; convert the CTranslate2 model to float16")
        variables[name] = np.frombuffer(raw, dtype=dtype).reshape(shape)
    # aliases: a variable stored once for several names (the tied output projection; and
    # any variables equal to the bit, which CTranslate2's converter now stores once)
    aliases = [(string(), string()) for _ in range(unpack("I"))]
    for alias, name in aliases:
        variables[alias] = variables[name]
    if any(name.endswith("weight_scale") for name in variables):
        raise ValueError("quantized CTranslate2 models (int8) are not supported; use float16")
    return variables


def _split(array: np.ndarray, n: int) -> list[np.ndarray]:
    return np.split(array, n, axis=0)


def _hf_weights(ct2: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Map CTranslate2 variables to Hugging Face names; raise on missing or unread ones."""
    unread = set(ct2) - _CT2_SETTINGS
    out: dict[str, np.ndarray] = {}

    def take(name: str) -> np.ndarray:
        if name not in ct2:
            raise KeyError(f"CTranslate2 model lacks {name!r}")
        unread.discard(name)
        return ct2[name]

    def linear(src: str, dst: str) -> None:
        out[f"{dst}.weight"] = take(f"{src}/weight")
        out[f"{dst}.bias"] = take(f"{src}/bias")

    def norm(src: str, dst: str) -> None:
        out[f"{dst}.weight"] = take(f"{src}/gamma")
        out[f"{dst}.bias"] = take(f"{src}/beta")

    def fused(src: str, dst: str, names: tuple[str, ...]) -> None:
        weights = _split(take(f"{src}/weight"), len(names))
        biases = _split(take(f"{src}/bias"), len(names))
        for name, w, b in zip(names, weights, biases, strict=True):
            out[f"{dst}.{name}.weight"] = w
            if name == "k_proj":
                if np.any(b != 0):
                    raise ValueError(f"{src}: the key bias is not zero; not a Whisper model")
            else:
                out[f"{dst}.{name}.bias"] = b

    for side in ("encoder", "decoder"):
        hf = f"model.{side}"
        norm(f"{side}/layer_norm", f"{hf}.layer_norm")
        n_layers = 1 + max(int(m[1]) for k in ct2 if (m := re.match(rf"{side}/layer_(\d+)/", k)))
        for i in range(n_layers):
            src, dst = f"{side}/layer_{i}", f"{hf}.layers.{i}"
            norm(f"{src}/self_attention/layer_norm", f"{dst}.self_attn_layer_norm")
            fused(
                f"{src}/self_attention/linear_0", f"{dst}.self_attn", ("q_proj", "k_proj", "v_proj")
            )
            linear(f"{src}/self_attention/linear_1", f"{dst}.self_attn.out_proj")
            if side == "decoder":
                norm(f"{src}/attention/layer_norm", f"{dst}.encoder_attn_layer_norm")
                linear(f"{src}/attention/linear_0", f"{dst}.encoder_attn.q_proj")
                fused(f"{src}/attention/linear_1", f"{dst}.encoder_attn", ("k_proj", "v_proj"))
                linear(f"{src}/attention/linear_2", f"{dst}.encoder_attn.out_proj")
            norm(f"{src}/ffn/layer_norm", f"{dst}.final_layer_norm")
            linear(f"{src}/ffn/linear_0", f"{dst}.fc1")
            linear(f"{src}/ffn/linear_1", f"{dst}.fc2")
    linear("encoder/conv1", "model.encoder.conv1")
    linear("encoder/conv2", "model.encoder.conv2")
    out["model.encoder.embed_positions.weight"] = take("encoder/position_encodings/encodings")
    out["model.decoder.embed_positions.weight"] = take("decoder/position_encodings/encodings")
    out["model.decoder.embed_tokens.weight"] = take("decoder/embeddings/weight")
    if "decoder/projection/weight" in ct2:  # Whisper's output projection is the embedding
        if not np.array_equal(take("decoder/projection/weight"), ct2["decoder/embeddings/weight"]):
            raise ValueError("the output projection is not the token embedding; not Whisper")
    if unread:
        raise ValueError(f"CTranslate2 variables not converted: {sorted(unread)}")
    return out


def _special_ids(tokenizer: dict) -> dict[str, int]:
    return {t["content"]: t["id"] for t in tokenizer["added_tokens"]}


def complete_tokenizer(tokenizer: dict, vocabulary: list[str], n_vocab: int) -> dict:
    """Add the tokens the vocabulary has beyond `tokenizer.json` (the timestamps)."""
    ids = [*tokenizer["model"]["vocab"].values(), *(t["id"] for t in tokenizer["added_tokens"])]
    known = max(ids) + 1
    if len(vocabulary) != n_vocab:
        raise ValueError(f"the vocabulary has {len(vocabulary)} tokens; the model has {n_vocab}")
    for token_id in range(known, n_vocab):
        tokenizer["added_tokens"].append(
            {
                "id": token_id,
                "content": vocabulary[token_id],
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": False,
            }
        )
    return tokenizer


def _vocabulary(src: Path) -> list[str]:
    """A CTranslate2 directory's tokens, in id order."""
    if (src / "vocabulary.json").exists():
        return json.loads((src / "vocabulary.json").read_text(encoding="utf-8"))
    if (src / "vocabulary.txt").exists():
        return (src / "vocabulary.txt").read_text(encoding="utf-8").splitlines()
    raise FileNotFoundError(f"{src} has neither vocabulary.json nor vocabulary.txt")


def convert_ctranslate2(parts: list[Path], dst: Path) -> None:
    """Write a Hugging Face Whisper directory to `dst` from a CTranslate2 directory.

    parts: the `model.bin` file, or its parts in order; the other files are read from the
    directory of the first part (`config.json`, `tokenizer.json`, and the vocabulary:
    `vocabulary.json` as CTranslate2's converter writes it today, large-v3-turbo's faster-whisper
    directories among them, or `vocabulary.txt` as older ones did).
    """
    src = parts[0].parent
    ct2 = read_ctranslate2(parts)
    ct2_config = json.loads((src / "config.json").read_text())
    weights = _hf_weights(ct2)
    n_vocab, d_model = weights["model.decoder.embed_tokens.weight"].shape
    if not (src / "tokenizer.json").exists():
        raise FileNotFoundError(
            f"{src} has no tokenizer.json: a CTranslate2 Whisper directory needs its model's "
            "(ct2-transformers-converter --copy_files tokenizer.json)"
        )
    tokenizer = complete_tokenizer(
        json.loads((src / "tokenizer.json").read_text(encoding="utf-8")), _vocabulary(src), n_vocab
    )
    ids = _special_ids(tokenizer)
    eot, sot = ids["<|endoftext|>"], ids["<|startoftranscript|>"]
    multilingual = n_vocab >= 51865
    languages = {t: i for t, i in ids.items() if sot < i < ids["<|translate|>"]}

    config = {
        "architectures": ["WhisperForConditionalGeneration"],
        "model_type": "whisper",
        "vocab_size": n_vocab,
        "num_mel_bins": weights["model.encoder.conv1.weight"].shape[1],
        "d_model": d_model,
        "encoder_layers": 1 + max(int(k.split(".")[3]) for k in weights if ".encoder.layers." in k),
        "decoder_layers": 1 + max(int(k.split(".")[3]) for k in weights if ".decoder.layers." in k),
        "encoder_attention_heads": int(ct2["encoder/num_heads"]),
        "decoder_attention_heads": int(ct2["decoder/num_heads"]),
        "encoder_ffn_dim": weights["model.encoder.layers.0.fc1.weight"].shape[0],
        "decoder_ffn_dim": weights["model.decoder.layers.0.fc1.weight"].shape[0],
        "max_source_positions": weights["model.encoder.embed_positions.weight"].shape[0],
        "max_target_positions": weights["model.decoder.embed_positions.weight"].shape[0],
        "activation_function": "gelu",
        "scale_embedding": False,
        "tie_word_embeddings": True,
        "bos_token_id": eot,
        "eos_token_id": eot,
        "pad_token_id": eot,
        "decoder_start_token_id": sot,
        "suppress_tokens": ct2_config["suppress_ids"],
        "begin_suppress_tokens": ct2_config["suppress_ids_begin"],
        "torch_dtype": "float16",
    }
    generation = {
        "alignment_heads": ct2_config.get("alignment_heads", []),
        "begin_suppress_tokens": ct2_config["suppress_ids_begin"],
        "suppress_tokens": ct2_config["suppress_ids"],
        "bos_token_id": eot,
        "eos_token_id": eot,
        "pad_token_id": eot,
        "decoder_start_token_id": sot,
        "is_multilingual": multilingual,
        "max_initial_timestamp_index": 50,
        "max_length": config["max_target_positions"],
        "no_timestamps_token_id": ids["<|notimestamps|>"],
        "prev_sot_token_id": ids["<|startofprev|>"],
        "return_timestamps": False,
    }
    if multilingual:
        generation["lang_to_id"] = languages
        generation["task_to_id"] = {
            "transcribe": ids["<|transcribe|>"],
            "translate": ids["<|translate|>"],
        }
        # As on the hub: transformers reads the default task from here when none is given.
        generation["forced_decoder_ids"] = [[1, None], [2, ids["<|transcribe|>"]]]
    tokenizer_config = {
        "tokenizer_class": "WhisperTokenizer",
        "model_max_length": 1024,
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "add_prefix_space": False,
        "errors": "replace",
    }
    preprocessor = {
        "feature_extractor_type": "WhisperFeatureExtractor",
        "processor_class": "WhisperProcessor",
        "feature_size": config["num_mel_bins"],
        "sampling_rate": 16000,
        "hop_length": 160,
        "n_fft": 400,
        "chunk_length": 30,
        "n_samples": 480000,
        "nb_max_frames": 3000,
        "padding_side": "right",
        "padding_value": 0.0,
        "return_attention_mask": False,
    }

    dst.mkdir(parents=True, exist_ok=True)
    tensors = {name: torch.from_numpy(array.copy()) for name, array in weights.items()}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    for name, content in (
        ("config.json", config),
        ("generation_config.json", generation),
        ("tokenizer.json", tokenizer),
        ("tokenizer_config.json", tokenizer_config),
        ("preprocessor_config.json", preprocessor),
    ):
        (dst / name).write_text(json.dumps(content, indent=1, ensure_ascii=False), encoding="utf-8")
