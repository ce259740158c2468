"""The worker's models: configured names only, loaded on first use, within a memory budget."""

import pytest

from worker.contract.settings import Settings
from worker.engines import Engines, UnknownModel


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


def test_out_of_memory_halves_the_slot_pool_and_the_job_still_succeeds(clips, monkeypatch):
    import torch

    from engine.scheduler import Scheduler
    from worker.batching import EngineFailed
    from worker.contract.jobs import JobOptions

    engines = Engines(Settings(models="tiny.en", device="cpu", slot_memory_bytes=200 * 1024**2))
    transcriber = engines.get("tiny.en")
    before = transcriber.n_slots
    launch, failures = Scheduler.launch, []

    def launch_that_runs_out(self):
        if len(failures) < 2 and self.n_live:  # the first two attempts run out mid-decode
            failures.append(self.n_slots)
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return launch(self)

    monkeypatch.setattr(Scheduler, "launch", launch_that_runs_out)
    result = engines.transcribe("tiny.en", clips["en_jfk"].bytes, JobOptions())
    assert "ask not what your country can do for you" in result.text.lower()
    assert failures == [before, before // 2]
    assert transcriber.n_slots == before // 4

    # at one slot there is nothing left to give up: the error reaches the job
    while transcriber.n_slots > 1:
        transcriber.shrink()
    failures.clear()
    with pytest.raises(EngineFailed, match="out of memory") as failed:
        engines.transcribe("tiny.en", clips["en_jfk"].bytes, JobOptions())
    assert not failed.value.retry and isinstance(failed.value.__cause__, torch.OutOfMemoryError)
