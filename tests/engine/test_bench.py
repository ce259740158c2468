"""The bench's table: an engine row's ratios are over transformers' at its batch; the peers'
work is what the engine's is."""

import torch

from tools.bench import Row, engine_run, qwen3_dir, qwen3_transformers_run, table, transformers_run


def test_table_gives_engine_rows_their_ratios_over_transformers_at_the_same_batch():
    rows = [
        Row("random:tiny", "engine", 512, 1500.0, None, 5.8),
        Row("random:tiny", "engine", 512, 1200.0, None, 6.6, tokens="10-200"),
        Row("random:tiny", "engine fp8", 256, 900.0, None, 3.0),
        Row("random:tiny", "transformers static", 512, 1000.0, None, 7.2),
        Row("random:tiny", "transformers plain", 512, 1200.0, None, 7.0),
        Row("random:tiny", "transformers static", 1, 5.0, 190.0, 0.1),
    ]
    lines = table(rows).splitlines()
    assert lines[0].endswith("| peak GiB | vs static | vs plain |")
    engine = "| random:tiny | engine | 512 | 100 | 1500.0 | 45000 |  | 5.8 | 1.50x | 1.25x |"
    assert lines[2] == engine
    assert lines[3].endswith("| 6.6 |  |  |")  # mixed lengths: no like-for-like row
    assert lines[4].endswith("| 3.0 |  |  |")  # no transformers row at batch 256
    static_b1 = "| random:tiny | transformers static | 1 | 100 | 5.0 | 150 | 190.0 | 0.1 |  |  |"
    assert lines[7] == static_b1


def test_every_transformers_peer_decodes_exactly_the_tokens_asked_from_whispers_prompt():
    """Whisper's generate (either cache) and the generic one without Whisper's logits
    processors do the same work: the English transcription prompt, then `tokens` new tokens."""
    from engine.loader import random_tokenizer

    tok = random_tokenizer("tiny")
    prompt = [tok.sot, tok.language_ids["en"], tok.transcribe, tok.no_timestamps]
    for cache in ("dynamic", "static"):  # Whisper's generate returns the new tokens alone
        out = transformers_run("tiny", 2, cache, 3, torch.device("cpu"), torch.float32)()
        assert out.shape == (2, 3), cache
    out = transformers_run("tiny", 2, "plain", 3, torch.device("cpu"), torch.float32)()
    assert out.shape == (2, 4 + 3) and out[:, :4].tolist() == [prompt, prompt]


def test_the_engine_runs_its_work_through_a_stream_each_window_exactly_its_length():
    from engine import EngineConfig

    config = EngineConfig(model="random:tiny", device="cpu", slots=4, encoder_batch=2)
    lengths = [3, 9, 5]
    run = engine_run(config, 7, lengths)
    tokens = run()
    assert [len(t) for t in tokens] == [3, 9, 5, 3, 9, 5, 3]
    assert run() == tokens  # greedy, the same work again
    first = tokens[0]
    assert all(t[:3] == first for t in tokens[::3])  # the same input (an input every 3)


def test_qwen3_asr_runs_the_same_work_in_the_engine_and_in_transformers():
    """Qwen3-ASR's shape: each window exactly its tokens through the engine's stream, and
    transformers' generate over the same requests, the prompt then `tokens` new tokens."""
    from engine import EngineConfig

    path = qwen3_dir("qwen3-asr-tiny")
    assert qwen3_dir("qwen3-asr-tiny") == path and (path / "config.json").is_file()  # made once
    config = EngineConfig(model=str(path), device="cpu", slots=2)
    tokens = engine_run(config, 3, [4, 7])()
    assert [len(t) for t in tokens] == [4, 7, 4]
    run = qwen3_transformers_run(
        "qwen3-asr-tiny", 2, "static", 5, torch.device("cpu"), torch.float32
    )
    out = run()
    assert out.shape[0] == 2 and (out.shape[1] - 5) > 390  # 30 s of audio tokens, the request
