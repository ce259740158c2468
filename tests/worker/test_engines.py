"""The worker's models: configured names only, loaded on first use, within a memory budget."""

import pytest

from worker.engines import Engines, UnknownModel
from worker.settings import Settings


def test_unknown_model_lists_the_served_ones():
    engines = Engines(Settings(models="tiny.en,base"))
    with pytest.raises(UnknownModel, match="'large-v9'; available: tiny.en, base"):
        engines.get("large-v9")


def test_least_recently_used_model_is_dropped_to_fit_the_budget():
    # tiny.en is ~150 MB and base ~290 MB in fp32: a 400 MB budget holds one of them
    engines = Engines(
        Settings(models="tiny.en,base", model_memory_bytes=400 * 1024**2, device="cpu")
    )
    engines.get("tiny.en")
    assert engines.loaded == ["tiny.en"]
    engines.get("base")
    assert engines.loaded == ["base"]
    roomy = Engines(Settings(models="tiny.en,base", model_memory_bytes=1024**3, device="cpu"))
    roomy.get("tiny.en"), roomy.get("base"), roomy.get("tiny.en")
    assert roomy.loaded == ["base", "tiny.en"]


def test_slot_pool_is_sized_from_the_memory_budget():
    from engine.scheduler import slot_bytes

    engines = Engines(Settings(models="tiny.en", device="cpu", slot_memory_bytes=100 * 1024**2))
    transcriber = engines.get("tiny.en")
    per_slot = slot_bytes(transcriber.loaded)  # tiny.en fp32: ~24 MB of cache a slot
    assert transcriber.n_slots == 100 * 1024**2 // per_slot == 4
    assert transcriber.encoder_batch <= transcriber.n_slots
