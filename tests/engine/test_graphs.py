"""CUDA graphs: what the warm-up leaves for later (the wider prompts' prefills) is captured
while idle or on first use, and a graph decodes the same tokens as the same steps run eagerly;
the padded passes graphs run read nothing an earlier admission left."""

from dataclasses import replace

import pytest
import torch

from engine import Engine, EngineConfig, TranscriptionOptions
from engine.decoding import WindowTask
from engine.mel import N_FRAMES
from engine.slots import Sequence

PROMPTED = TranscriptionOptions(initial_prompt="Kennedy, Lee Harvey Oswald, the Warren report.")


def tokens(stream, clips, options):
    results = stream.transcribe([c.bytes for c in clips], options)
    return [[s.tokens for s in r.segments] for r in results]


@pytest.mark.requires_cuda
def test_a_warm_stream_captures_the_wider_prompts_later_and_decodes_as_eagerly(english_clips):
    config = EngineConfig(model="tiny.en", device="cuda", slots=16)
    eager = Engine.open(replace(config, graphs=False))
    expected = {o: tokens(eager, english_clips, o) for o in (PROMPTED, TranscriptionOptions())}

    first_use = Engine.open(config)
    first_use.warm()  # the wider prefills are left: a prompted input captures its own
    assert tokens(first_use, english_clips, PROMPTED) == expected[PROMPTED]

    idle = Engine.open(config)
    warmed = idle.warm()
    later = 0
    while idle.warm_next():
        later += 1
    sizes = len({1, 2, 4, 8, 16})  # encoder batch buckets up to the default 16
    assert warmed > 0 and later == sizes * 3  # prompt widths 16, 64 and the widest
    assert not idle.warm_next()
    for options, want in expected.items():
        assert tokens(idle, english_clips, options) == want


def test_a_padded_admission_reads_nothing_an_earlier_wider_one_staged(tiny_en):
    """On CUDA an admission's prefill is padded to an encoder batch bucket and a prompt width
    bucket, and its padding rows read the staging rows past its windows. Left as an earlier,
    wider admission staged them (long-form windows' previous text), their lengths indexed past
    the narrower width: a device-side assert on an H100 (2026-12-07) once a worker admitted new
    inputs' first windows after long-form ones. Here CUDA's padding runs on the CPU, where such
    an index raises."""
    engine = tiny_en.engine
    runner = engine.runner()
    runner.pad_to_buckets = True
    mels = torch.zeros(4, engine.loaded.dims.n_mels, N_FRAMES)
    wide = WindowTask("en", prompt=tuple(engine.loaded.tokenizer.encode(" and so on" * 10)))
    runner.start(runner.encode(mels), [Sequence(i, wide) for i in range(4)])
    runner.start(runner.encode(mels[:3]), [Sequence(i, WindowTask("en")) for i in range(4, 7)])
    assert runner.n_live == 7


@pytest.mark.requires_cuda
def test_graphs_captured_while_idle_after_prompted_work_decode_as_eagerly(english_clips):
    """A worker captures what its warm-up left while idle, after it has served jobs. Each
    capture's warm-up prefill runs for real, and it once read what the last admission had
    staged: prompts wider than the width being captured (a device-side assert on an H100,
    2026-12-07), bound for that admission's slots."""
    config = EngineConfig(model="tiny.en", device="cuda", slots=16)
    eager = Engine.open(replace(config, graphs=False))
    expected = {o: tokens(eager, english_clips, o) for o in (PROMPTED, TranscriptionOptions())}
    stream = Engine.open(config)
    stream.warm()
    assert tokens(stream, english_clips, PROMPTED) == expected[PROMPTED]
    while stream.warm_next():
        pass
    for options, want in expected.items():
        assert tokens(stream, english_clips, options) == want
