"""CUDA graphs: what the warm-up leaves for later (the wider prompts' prefills) is captured
while idle or on first use, and a graph decodes the same tokens as the same steps run eagerly."""

from dataclasses import replace

import pytest

from engine import Engine, EngineConfig, TranscriptionOptions

pytestmark = pytest.mark.requires_cuda

PROMPTED = TranscriptionOptions(initial_prompt="Kennedy, Lee Harvey Oswald, the Warren report.")


def tokens(stream, clips, options):
    results = stream.transcribe([c.bytes for c in clips], options)
    return [[s.tokens for s in r.segments] for r in results]


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
