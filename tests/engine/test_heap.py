"""A warmed stream's objects are frozen (engine.heap): a full collection, which stops every
thread, walks only what was made after, not the process's torch, transformers and model."""

import gc
import weakref

from engine import Engine, EngineConfig


def test_after_warm_up_a_full_collection_walks_only_what_came_after(clips):
    gc.unfreeze()
    alive = {"made": "before the model was opened"}
    stream = Engine.open(EngineConfig(model="tiny.en", device="cpu"))
    stream.warm()
    walked = gc.get_objects()  # a full collection's: the permanent generation is not walked
    assert 50 * len(walked) < gc.get_freeze_count()
    assert not any(o is alive for o in walked)
    result = stream.transcribe([clips["en_jfk"].bytes])[0]
    assert "ask not what your country" in result.text.lower()


def test_a_slot_pool_given_up_is_freed_though_it_was_frozen(monkeypatch):
    """After running out of device memory a stream halves its pool of slots: the old pool's
    caches must go before the new one is allocated, even were its objects a frozen cycle."""
    pools = []

    def runner(engine):
        pool = make(engine)
        pool.itself = pool  # a cycle, frozen with the rest by the warm-up
        pools.append(weakref.ref(pool))
        return pool

    make = Engine.runner
    monkeypatch.setattr(Engine, "runner", runner)
    stream = Engine.open(EngineConfig(model="tiny.en", device="cpu", slots=4))
    stream.warm()
    assert len(pools) == 1 and gc.get_freeze_count() > 0
    assert stream.shrink() and stream.engine.n_slots == 2
    assert len(pools) == 2 and pools[0]() is None and pools[1]() is not None
