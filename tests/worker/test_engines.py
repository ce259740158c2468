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


def test_fp8_cross_attention_cache_holds_more_slots_and_still_transcribes(clips):
    import torch

    from engine.scheduler import slot_bytes

    budget = 100 * 1024**2
    engines = Engines(
        Settings(models="tiny.en", device="cpu", slot_memory_bytes=budget, cross_kv="fp8")
    )
    transcriber = engines.get("tiny.en")
    # fp32 self-attention, fp8 cross-attention: ~10 MB a slot, against ~24 MB (4 slots)
    assert transcriber.n_slots == budget // slot_bytes(transcriber.loaded, torch.float8_e4m3fn)
    assert transcriber.n_slots == 10
    text = transcriber.transcribe(clips["en_jfk"].bytes).text
    cache = next(iter(transcriber._schedulers.values())).cache
    assert cache.cross_k.dtype == torch.float8_e4m3fn
    assert "ask not what your country can do for you" in text.lower()
    with pytest.raises(ValueError, match="cross_kv"):
        Settings(cross_kv="int4")
