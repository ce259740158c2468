"""Model names: packaged weights, directories, random weights for speed work."""

import subprocess
import sys

import numpy as np
import pytest
import torch

from engine import TranscriptionOptions
from engine.loader import RANDOM_CONFIGS, load_model, random_tokenizer
from tests.conftest import open_stream, transcribe


def test_random_configs_have_whisper_shapes():
    large = RANDOM_CONFIGS["large-v3"]
    assert (large["d_model"], large["encoder_layers"], large["num_mel_bins"]) == (1280, 32, 128)
    assert large["vocab_size"] == 51866 and RANDOM_CONFIGS["tiny"]["vocab_size"] == 51865


def test_random_model_runs_end_to_end():
    stream = open_stream("random:tiny")
    assert stream.engine.name == "random:tiny"
    options = TranscriptionOptions(language="en", temperature=(0.0,), sample_len=8)
    result = transcribe(stream, np.zeros(16000 * 3, np.float32), options)
    assert result.duration == 3.0  # random weights: the text means nothing
    assert len(result.segments[0].tokens) <= 8


def test_large_v3_vocabulary_has_cantonese_and_shifted_specials(tmp_path):
    tok = random_tokenizer("large-v3", tmp_path)
    assert tok.language_ids["yue"] == 50358
    assert (tok.translate, tok.transcribe, tok.no_timestamps, tok.timestamp_begin) == (
        50359,
        50360,
        50364,
        50365,
    )
    assert tok.bpe.get_vocab_size() == 51866


def test_unknown_random_size_is_refused():
    with pytest.raises(FileNotFoundError, match="tiny, base, small, medium, large-v3"):
        load_model("random:huge", device="cpu", dtype=torch.float32)


def test_opening_and_warming_a_model_imports_no_compiler():
    """A worker's start is its model's load and warm-up: nothing in them may pull in
    torch._dynamo (importing it took 5.4 s of a 15 s GPU worker start, through the embedding's
    default initialisation on the meta device)."""
    code = (
        "import sys\n"
        "from engine import Engine, EngineConfig\n"
        "Engine.open(EngineConfig(model='tiny.en', device='cpu')).warm()\n"
        "print(sorted(m for m in ('torch._dynamo', 'sympy') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
