"""The engine's own Qwen3-ASR (engine.qwen3_asr), with random weights of its shape: the token
ids transformers' Qwen3-ASR gives for the same requests, whatever else shares its slots, and
the same contract as every stream."""

import numpy as np
import pytest

from engine import Engine, EngineConfig, OptionsError, TranscriptionOptions
from engine.audio import decode_audio
from engine.qwen3_asr import CONTEXT, MAX_PROMPT_TOKENS, Qwen3ASREngine, audio_tokens
from engine.windows import WindowStream
from tests.conftest import long_speech


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    from tools.qwen3_asr import make

    return make(tmp_path_factory.mktemp("qwen3") / "qwen3-asr")


@pytest.fixture(scope="module")
def native(made):
    return Engine.open(EngineConfig(model=str(made), name="qwen3-asr", device="cpu", slots=3))


@pytest.fixture(scope="module")
def inputs(clips):
    """Every test clip (2.7 to 11 s, English and French) and a 44 s recording of two windows,
    the last of 14 s (attention windows of 8 s and a partial one in each); as samples."""
    data = [c.bytes for c in clips.values()] + [long_speech(44)]
    return [decode_audio(d) for d in data]


def tokens(results):
    return [[t for s in r.segments for t in s.tokens] for r in results]


def test_a_qwen3_asr_directory_runs_natively_and_hf_runs_it_through_transformers(native, made):
    assert isinstance(native, WindowStream) and isinstance(native.engine, Qwen3ASREngine)
    through = Engine.open(EngineConfig(model=f"hf:{made}", device="cpu", slots=1))
    assert type(through.engine).__name__ == "TransformersEngine"


def test_native_gives_transformers_token_ids_whatever_shares_its_slots(native, made, inputs):
    """Each window alone through transformers' `generate`, and all of them through three
    slots, where windows join and leave between decode steps and a window's neighbours
    differ from run to run: the same ids, window for window (fp32, CPU)."""
    through = Engine.open(EngineConfig(model=f"hf:{made}", device="cpu", slots=1))
    expected = tokens(through.transcribe(inputs))
    assert tokens(native.transcribe(inputs)) == expected
    assert tokens(native.transcribe(inputs[::-1])) == expected[::-1]
    assert sum(map(len, expected)) > 100 * len(inputs)  # decoded far past the prompts


def test_a_window_decodes_the_tokens_it_is_told_to(native, made, inputs):
    """min_tokens and sample_len (the benchmarks' fixed work): no end of turn before the
    first, none past the second, as transformers' `generate` with min_new_tokens and
    max_new_tokens gives them."""
    import torch

    through = Engine.open(EngineConfig(model=f"hf:{made}", device="cpu", slots=1)).engine
    for n in (5, 60):
        fixed = TranscriptionOptions(language="en", min_tokens=n, sample_len=n)
        ours = tokens(native.transcribe(inputs[:3], fixed))
        for x, mine in zip(inputs[:3], ours, strict=True):
            request = through.chat.requests([x], [fixed])
            with torch.inference_mode():
                ids = through.model.generate(
                    **request, do_sample=False, min_new_tokens=n, max_new_tokens=n
                )[0, request["input_ids"].shape[1] :]
            assert len(ids) == n
            assert mine == through.chat.answer(ids.tolist(), "en")[0]


def test_a_row_held_back_never_chooses_an_end_of_turn(native):
    """The states whose best token is an end of turn: free, they choose it; held back (fewer
    tokens than min_tokens), the best of the rest."""
    import torch

    model, stops = native.engine.model, sorted(native.engine.stops)
    with torch.inference_mode():
        x = model.lm_head.weight[stops]  # a state that points at its own token
        logits = model.language_model.norm(x) @ model.lm_head.weight.T
        free = model.next_tokens(x, torch.tensor(stops), torch.zeros(len(stops), dtype=bool))
        held = model.next_tokens(x, torch.tensor(stops), torch.ones(len(stops), dtype=bool))
    assert free.tolist() == stops
    logits = logits.clone()
    logits[:, stops] = -torch.inf
    assert held.tolist() == logits.argmax(-1).tolist()
    assert not set(held.tolist()) & set(stops)


def test_windows_join_a_running_pool(native, inputs):
    """An input submitted while others decode shares the steps and gives what it gives
    alone; an input aborted mid-decode frees its slots."""
    alone = [tokens(native.transcribe([x]))[0] for x in inputs[:3]]
    native.submit("a", inputs[0])
    native.submit("gone", inputs[-1])
    native.step()
    assert native.engine.decoder.free == 0
    native.submit("b", inputs[1])
    native.submit("c", inputs[2])
    native.step()
    assert native.abort("gone")
    done = {}
    while native.busy:
        done.update({f.owner: f.transcription for f in native.step()})
    assert [tokens([done[k]])[0] for k in "abc"] == alone
    assert native.engine.decoder.free == 3 and not native.engine.decoder.live


def test_the_encoder_gives_each_window_its_tokens(native, inputs):
    """As many audio positions as the request holds audio tokens, for whole and partial
    chunks of one second (the processor's own count)."""
    engine = native.engine
    for x in (inputs[0], inputs[0][:12345], np.zeros(160, np.float32)):
        request = engine.chat.requests([x], [TranscriptionOptions()])
        frames = int(request["input_features_mask"].sum())
        held = int((request["input_ids"] == engine.model.audio_token).sum())
        assert audio_tokens(frames) == held
    assert CONTEXT >= 30 * 13 + MAX_PROMPT_TOKENS + 448


def test_options_it_cannot_honour_are_refused_before_any_work(native):
    too_long = " ".join(["Paris"] * (MAX_PROMPT_TOKENS + 1))
    for options, words in [
        (TranscriptionOptions(task="translate"), "task 'translate'"),
        (TranscriptionOptions(temperature=(0.4,)), "sampling"),
        (TranscriptionOptions(word_timestamps=True), "word timestamps"),
        (TranscriptionOptions(vad=True), "voice activity"),
        (TranscriptionOptions(language="xx"), "language 'xx'"),
        (TranscriptionOptions(initial_prompt=too_long), f"at most {MAX_PROMPT_TOKENS}"),
        (TranscriptionOptions(sample_len=449), "sample_len 449"),
        (TranscriptionOptions(min_tokens=9, sample_len=8), "min_tokens 9"),
        (TranscriptionOptions(hallucination_silence_threshold=2.0), "hallucination_silence"),
    ]:
        with pytest.raises(OptionsError, match=words):
            native.check(options)
    forced = native.transcribe([np.zeros(16000, np.float32)], TranscriptionOptions(language="fr"))
    assert forced[0].language == "fr"


def test_a_windows_request_does_not_depend_on_its_neighbours(native, inputs):
    """The processor floors a batch's log-mel at 8 below its loudest member's peak: requests
    are built one window at a time, so a quiet window next to a loud one keeps its features
    (both backends build them so)."""
    import torch

    chat, greedy = native.engine.chat, TranscriptionOptions()
    quiet, loud = inputs[0] * 0.01, inputs[-1]
    alone = chat.requests([quiet], [greedy])
    together = chat.requests([loud, quiet], [greedy, greedy])
    width = alone["input_features"].shape[-1]
    assert together["input_features"].shape[-1] > width
    assert torch.equal(together["input_features"][1, :, :width], alone["input_features"][0])
    assert not together["input_features_mask"][1, width:].any()
    mask = together["attention_mask"][1].bool()
    assert torch.equal(together["input_ids"][1][mask], alone["input_ids"][0])


def test_the_engines_requests_are_the_processors(native, inputs):
    """Each window's request built by the engine (log-mel on the device, the chat's text
    tokenized once) holds the processor's tokens, real frames and features: windows shorter
    than the extractor's minimum, of odd lengths, whole, quiet, of one length together, with
    and without a language and a prompt."""
    import torch

    from engine.options import TranscriptionOptions as O

    rng = np.random.default_rng(0)
    noise = (rng.standard_normal(480000) * 0.1).astype(np.float32)
    windows = [np.zeros(100, np.float32), inputs[0][:12345], inputs[1], noise, inputs[2] * 0.01]
    windows += [inputs[0][:12345], inputs[-1][:480000]]
    options = [O(), O(language="en"), O(initial_prompt="Kennedy, Apollo"), O(language="fr")]
    options += [O(initial_prompt="bonjour", language="fr"), O(language="en"), O()]
    engine = native.engine
    features, frames, ids = engine.requests(list(zip(range(7), windows, options, strict=True)))
    expected = engine.chat.requests(windows, options)
    assert torch.equal(frames, expected["input_features_mask"].sum(-1))
    assert torch.equal(features, expected["input_features"])
    for mine, row, mask in zip(ids, expected["input_ids"], expected["attention_mask"], strict=True):
        assert mine == row[mask.bool()].tolist()


def test_a_directory_whose_extractor_the_engine_does_not_compute_is_sent_to_transformers(
    made, tmp_path
):
    import json
    import shutil

    other = tmp_path / "other"
    shutil.copytree(made, other)
    config = json.loads((other / "processor_config.json").read_text())
    config["feature_extractor"]["hop_length"] = 200
    (other / "processor_config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="run it through transformers with model 'hf:"):
        Engine.open(EngineConfig(model=str(other), device="cpu", slots=1))


@pytest.mark.requires_cuda
def test_on_cuda_graphs_give_the_eager_steps_tokens_and_fp32_gives_transformers(made, inputs):
    """fp16: the decode step captured per (rows, keys) bucket and replayed gives what the
    same steps give run eagerly; fp32: transformers' ids, as on the CPU."""
    runs = {}
    for graphs in (False, True):
        config = EngineConfig(model=str(made), device="cuda", slots=3, graphs=graphs)
        runs[graphs] = tokens(Engine.open(config).transcribe(inputs))
    assert runs[True] == runs[False]
    fp32 = {"device": "cuda", "dtype": "fp32", "slots": 3}
    native = Engine.open(EngineConfig(model=str(made), **fp32))
    through = Engine.open(EngineConfig(model=f"hf:{made}", **{**fp32, "slots": 1}))
    assert tokens(native.transcribe(inputs)) == tokens(through.transcribe(inputs))


def test_settings_that_need_cuda_are_refused_on_the_cpu_by_either_engine(made):
    """One rule for the Whisper engine and this one (EngineConfig.speedups)."""
    for setting, words in (
        ({"graphs": True}, "CUDA graphs need"),
        ({"kernels": "triton"}, "'triton'"),
    ):
        for model in (str(made), "random:tiny"):
            with pytest.raises(ValueError, match=words):
                Engine.open(EngineConfig(model=model, device="cpu", **setting))
