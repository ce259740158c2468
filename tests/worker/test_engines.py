"""The worker's models: configured names only, loaded on first use, within a memory budget;
warmed before use; run in the engine core."""

import gc
import time
import weakref

import pytest
import torch

from worker.contract.jobs import JobOptions
from worker.contract.settings import Settings
from worker.core.calls import UnknownModel
from worker.core.engines import Engines
from worker.core.process import InProcess
from worker.core.transcripts import job_seed


def test_unknown_model_lists_the_served_ones():
    engines = Engines(Settings(models="tiny.en,base"))
    with pytest.raises(UnknownModel, match="'large-v9'; available: tiny.en, base"):
        engines.get("large-v9")


def test_a_jobs_seed_is_its_own_or_derived_from_its_input_and_options():
    data, options = b"RIFF and some audio", JobOptions()
    derived = job_seed(data, options)
    assert derived == job_seed(bytes(data), JobOptions())  # whichever job carries them
    assert derived == 0x384C7886E28B8627  # and whichever version runs them
    for other_data, other_options in [
        (data + b"\0", options),
        (data[:-1], options),
        (data, JobOptions(mode="chunked")),
        (data, JobOptions(prompt="Kennedy")),
        (data, JobOptions(timestamps=False)),
    ]:
        assert job_seed(other_data, other_options) not in (derived, None)
    assert job_seed(data, JobOptions(seed=0)) == 0 and job_seed(data, JobOptions(seed=5)) == 5
    assert all(0 <= job_seed(bytes([i]), options) < 2**63 for i in range(256))


def test_the_result_carries_the_seed_it_was_sampled_with(clips, core):
    engines = core(Settings(models="tiny.en", device="cpu"))
    data = clips["en_jfk"].bytes
    derived = engines.transcribe("tiny.en", data, JobOptions())
    assert derived.seed == job_seed(data, JobOptions()) and derived.options.seed is None
    given = engines.transcribe("tiny.en", data, JobOptions(seed=5))
    assert given.seed == 5 and given.options.seed == 5


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


def test_a_dropped_models_objects_are_freed_though_a_warmed_models_were_frozen():
    """Warming freezes what is alive (engine.heap); a frozen cycle is never collected, so a
    dropped model's objects go back to the collector, and its weights are freed."""
    engines = Engines(
        Settings(models="tiny.en,base", model_memory_bytes=400 * 1024**2, device="cpu")
    )
    tiny = weakref.ref(engines.get("tiny.en").engine)
    assert gc.get_freeze_count() > 10_000
    engines.get("base")
    assert engines.loaded == ["base"] and gc.get_freeze_count() == 0
    deadline = time.monotonic() + 30  # its batcher's thread ends, then it is garbage
    while tiny() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.1)
    assert tiny() is None


def test_slot_pool_is_sized_from_the_memory_budget():
    from engine.slots import slot_bytes

    engines = Engines(Settings(models="tiny.en", device="cpu", slot_memory_bytes=100 * 1024**2))
    engine = engines.get("tiny.en").engine
    per_slot = slot_bytes(engine.loaded.dims, torch.float32, torch.float32)  # ~24 MB a slot
    assert engine.n_slots == 100 * 1024**2 // per_slot == 4
    assert engine.encoder_batch <= engine.n_slots


def test_fp8_cross_attention_cache_holds_more_slots_and_still_transcribes(clips, core):
    from engine.slots import slot_bytes

    budget = 100 * 1024**2
    engines = Engines(
        Settings(models="tiny.en", device="cpu", slot_memory_bytes=budget, cross_kv="fp8")
    )
    engine = engines.get("tiny.en").engine
    # fp32 self-attention, fp8 cross-attention: ~10 MB a slot, against ~24 MB (4 slots)
    fp8 = torch.float8_e4m3fn
    assert engine.n_slots == budget // slot_bytes(engine.loaded.dims, torch.float32, fp8) == 10
    assert engine.runner().slots.cache.cross_k.dtype == fp8
    text = core(engines.settings).transcribe("tiny.en", clips["en_jfk"].bytes, JobOptions()).text
    assert "ask not what your country can do for you" in text.lower()
    with pytest.raises(ValueError, match="cross_kv"):
        Settings(cross_kv="int4")


def test_out_of_memory_halves_the_slot_pool_and_the_job_still_succeeds(clips, monkeypatch, core):
    from engine import Engine
    from engine.runner import Runner
    from worker.core.calls import EngineFailed

    settings = Settings(models="tiny.en", device="cpu", slot_memory_bytes=200 * 1024**2)
    opened, open_model = [], Engine.open
    monkeypatch.setattr(Engine, "open", lambda c: opened.append(open_model(c)) or opened[-1])
    engines = core(settings, context=InProcess)  # where the patches below reach
    engines.load("tiny.en")
    stream = opened[0]
    before = stream.engine.n_slots
    launch, failures = Runner.launch, []

    def launch_that_runs_out(self):
        if len(failures) < 2 and self.n_live:  # the first two attempts run out mid-decode
            failures.append(self.slots.n_slots)
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return launch(self)

    monkeypatch.setattr(Runner, "launch", launch_that_runs_out)
    result = engines.transcribe("tiny.en", clips["en_jfk"].bytes, JobOptions())
    assert "ask not what your country can do for you" in result.text.lower()
    assert failures == [before, before // 2]
    assert stream.engine.n_slots == before // 4

    # at one slot there is nothing left to give up: the error reaches the job
    while stream.shrink():
        pass
    failures.clear()
    with pytest.raises(EngineFailed, match="out of memory") as failed:
        engines.transcribe("tiny.en", clips["en_jfk"].bytes, JobOptions())
    assert not failed.value.retry and failed.value.oom


def test_a_model_loads_without_holding_up_the_jobs_of_loaded_ones(monkeypatch):
    """While one thread loads (or converts) a model, threads of loaded models go on, and the
    other threads that want the loading model wait for that one load, or share its error."""
    import threading

    from engine import Engine

    engines = Engines(Settings(models="tiny.en,base", device="cpu"))
    tiny = engines.get("tiny.en")
    release, opened, fail = threading.Event(), [], [False, True]
    open_model = Engine.open

    def slow_open(config):
        if config.name == "base":
            opened.append(config.name)
            assert release.wait(60)
            if fail.pop():
                raise OSError("the model directory went away")
        return open_model(config)

    monkeypatch.setattr(Engine, "open", slow_open)
    results = {}

    def get(key):
        try:
            results[key] = engines.get("base")
        except OSError as e:
            results[key] = e

    first, second = (threading.Thread(target=get, args=(k,)) for k in ("first", "second"))
    first.start()
    while not opened:
        time.sleep(0.01)
    second.start()
    start = time.monotonic()
    assert engines.get("tiny.en") is tiny  # not held up by the load of base
    assert time.monotonic() - start < 1.0
    release.set()
    first.join(60), second.join(60)
    assert isinstance(results["first"], OSError) and results["second"] is results["first"]
    assert opened == ["base"]  # one load for both threads
    assert engines.get("base").engine.name == "base"  # the next one loads it again
    assert opened == ["base", "base"] and engines.loaded == ["tiny.en", "base"]


def test_a_shared_core_refuses_a_connection_without_its_key_and_serves_the_next(clips, core):
    """`worker --processes`: the core's socket (in a folder only its user may enter) takes a
    job process only with the key; a wrong key is refused and the core goes on serving."""
    import os
    import stat
    from multiprocessing.connection import AuthenticationError, Client

    settings = Settings(models="tiny.en", device="cpu")
    owner = core(settings, listen=True)
    owner.load("tiny.en")
    folder = os.path.dirname(owner.address)
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    with pytest.raises(AuthenticationError):
        Client(owner.address, "AF_UNIX", authkey=b"not the key")
    job = core(settings, connect=(owner.address, owner.authkey))
    job.load("tiny.en")  # as a job process does before it takes a message: warm already
    text = job.transcribe("tiny.en", clips["en_jfk"].bytes, JobOptions()).text
    assert "ask not what your country can do for you" in text
    deadline = time.monotonic() + 5
    while owner.job_processes != 1:  # the job process found the core warm
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_jobs_first_pass_finds_speech_only_where_its_options_use_it(monkeypatch, core):
    from engine import inputs
    from tests.conftest import long_speech

    made, detector = [], inputs.Detector
    monkeypatch.setattr(inputs, "Detector", lambda device: made.append(device) or detector(device))
    engines = core(Settings(models="tiny.en", device="cpu"), context=InProcess)
    data = long_speech(33)  # 33 s: read in a first pass
    plain = engines.transcribe("tiny.en", data, JobOptions(mode="chunked", vad=False))
    assert not made and "ask not what your country can do for you" in plain.text.lower()
    engines.transcribe("tiny.en", data, JobOptions(mode="chunked"))  # vad on by default
    assert len(made) == 1
