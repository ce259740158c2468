"""Model names: packaged weights, directories, random weights for speed work."""

import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from engine import TranscriptionOptions
from engine.audio import decode_audio
from engine.loader import RANDOM_CONFIGS, load_model, random_tokenizer, tokenizer_dir
from tests.conftest import open_stream, transcribe

# the models people pick for speed: (encoder layers, decoder layers, mel bins, vocabulary) as
# their published configs give them
SPEED_SHAPES = {
    "large-v3-turbo": (32, 4, 128, 51866),
    "distil-large-v3": (32, 2, 128, 51866),
    "distil-small.en": (12, 4, 80, 51864),
}


def test_random_configs_have_whisper_shapes():
    large = RANDOM_CONFIGS["large-v3"]
    assert (large["d_model"], large["encoder_layers"], large["num_mel_bins"]) == (1280, 32, 128)
    assert large["vocab_size"] == 51866 and RANDOM_CONFIGS["tiny"]["vocab_size"] == 51865


@pytest.mark.parametrize("name", SPEED_SHAPES)
def test_speed_models_random_shapes_are_theirs(name):
    config = RANDOM_CONFIGS[name]
    layers = config["encoder_layers"], config["decoder_layers"]
    assert (*layers, config["num_mel_bins"], config["vocab_size"]) == SPEED_SHAPES[name]
    assert random_tokenizer(name).bpe.get_vocab_size() == config["vocab_size"]


@pytest.fixture(scope="module", params=list(SPEED_SHAPES))
def speed_model(request, tmp_path_factory):
    """A Hugging Face directory with a speed model's structure (its layer counts, mel bins,
    vocabulary and tokenizer) at a width the CPU decodes in seconds, random weights; and
    the same model in the other layouts the loader takes: sharded safetensors, and
    CTranslate2 as its converter writes it (vocabulary.json), with the tokenizer.json that
    faster-whisper's directories carry."""
    from ctranslate2.converters import TransformersConverter
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

    name, root = request.param, tmp_path_factory.mktemp(request.param)
    tok = random_tokenizer(name)
    narrow = dict(d_model=64, encoder_attention_heads=2, decoder_attention_heads=2)
    config = WhisperConfig(
        **{**RANDOM_CONFIGS[name], **narrow, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128},
        decoder_start_token_id=tok.sot,
        eos_token_id=tok.eot,
        pad_token_id=tok.eot,
        bos_token_id=tok.eot,
    )
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(config).eval()
    multilingual = {
        "lang_to_id": {f"<|{code}|>": i for code, i in tok.language_ids.items()},
        "task_to_id": {"transcribe": tok.transcribe, "translate": tok.translate},
    }
    model.generation_config = GenerationConfig(  # as the hub's directories carry it
        decoder_start_token_id=tok.sot,
        eos_token_id=tok.eot,
        pad_token_id=tok.eot,
        bos_token_id=tok.eot,
        no_timestamps_token_id=tok.no_timestamps,
        begin_suppress_tokens=[220, tok.eot],
        suppress_tokens=[],
        max_length=448,
        is_multilingual=tok.is_multilingual,
        **(multilingual if tok.is_multilingual else {}),
    )
    dirs = {"safetensors": root / "hf", "sharded": root / "sharded", "ctranslate2": root / "ct2"}
    tokenizer = tokenizer_dir(config.vocab_size)
    model.save_pretrained(dirs["safetensors"])
    model.save_pretrained(dirs["sharded"], max_shard_size="1MB")
    for d in dirs["safetensors"], dirs["sharded"]:
        shutil.copy(tokenizer / "tokenizer.json", d)
    TransformersConverter(str(dirs["safetensors"])).convert(str(dirs["ctranslate2"]))
    shutil.copy(tokenizer / "tokenizer.json", dirs["ctranslate2"])
    assert (dirs["ctranslate2"] / "vocabulary.json").exists()
    assert len(list(dirs["sharded"].glob("model-*.safetensors"))) > 1
    return name, dirs


def test_a_speed_models_directory_decodes_alike_in_every_layout(speed_model, clips):
    """Each layout of the same weights loads with the model's structure and gives the same
    greedy tokens on real speech, which are transformers' `generate` on its directory."""
    from transformers import WhisperFeatureExtractor, WhisperForConditionalGeneration

    name, dirs = speed_model
    n_enc, n_dec, n_mels, n_vocab = SPEED_SHAPES[name]
    extractor = WhisperFeatureExtractor(feature_size=n_mels)
    audio = decode_audio(clips["en_jfk"].bytes)
    mel = extractor(audio, sampling_rate=16000, return_tensors="np").input_features
    options = TranscriptionOptions(
        language="en", timestamps=False, temperature=(0.0,), sample_len=20
    )
    found = {}
    for layout, d in dirs.items():
        stream = open_stream(str(d))
        dims = stream.engine.loaded.dims
        assert (dims.n_audio_layer, dims.n_text_layer, dims.n_mels, dims.n_vocab) == (
            n_enc,
            n_dec,
            n_mels,
            n_vocab,
        )
        found[layout] = [t for s in transcribe(stream, mel, options).segments for t in s.tokens]
    assert found["sharded"] == found["safetensors"] == found["ctranslate2"]
    hf = WhisperForConditionalGeneration.from_pretrained(dirs["safetensors"], dtype=torch.float32)
    tok = stream.engine.loaded.tokenizer
    language = {"language": "en", "task": "transcribe"} if tok.is_multilingual else {}
    expected = hf.generate(torch.from_numpy(mel), max_new_tokens=20, **language)[0].tolist()
    assert found["safetensors"] == [t for t in expected if t < tok.eot]


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


def test_a_ctranslate2_directory_without_its_tokenizer_is_refused_in_words(speed_model, tmp_path):
    _, dirs = speed_model
    bare = tmp_path / "ct2"
    shutil.copytree(dirs["ctranslate2"], bare)
    (bare / "tokenizer.json").unlink()
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        load_model(str(bare), device="cpu", cache_dir=tmp_path / "cache")
