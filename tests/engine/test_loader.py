"""Model names: packaged weights, directories, random weights for speed work."""

import numpy as np
import pytest
import torch

from engine.loader import RANDOM_CONFIGS, load_model
from engine.longform import TranscriptionOptions
from engine.transcribe import Transcriber


def test_random_configs_have_whisper_shapes():
    large = RANDOM_CONFIGS["large-v3"]
    assert (large["d_model"], large["encoder_layers"], large["num_mel_bins"]) == (1280, 32, 128)
    assert large["vocab_size"] == 51866 and RANDOM_CONFIGS["tiny"]["vocab_size"] == 51865


def test_random_model_runs_end_to_end():
    t = Transcriber(load_model("random:tiny", device="cpu"))
    assert t.loaded.name == "random:tiny" and t.loaded.tokenizer.is_multilingual
    options = TranscriptionOptions(language="en", temperature=(0.0,), sample_len=8)
    result = t.transcribe(np.zeros(16000 * 3, np.float32), options)
    assert result.duration == 3.0  # random weights: the text means nothing


def test_large_v3_vocabulary_has_cantonese_and_shifted_specials(tmp_path):
    from engine.loader import _tokenizer_dir
    from engine.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(_tokenizer_dir(51866, tmp_path), 51866)
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
