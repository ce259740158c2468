"""Micro-batching: jobs on many threads share the engine's batches; a lone one is not held."""

import subprocess
import sys
import threading
import time

import pytest
import torch

from engine import TranscriptionOptions
from engine.options import SpeakerCount
from engine.runner import Runner
from tests.conftest import open_stream
from worker.core.batching import Batcher
from worker.core.calls import EngineFailed
from worker.core.process import CUDA_FAULT_EXIT


def test_inputs_arriving_together_share_an_encoder_batch(clips, encoded):
    stream = open_stream("tiny.en", slots=8)
    batcher = Batcher(stream, batch_size=4, max_wait_s=60.0)
    names = ["en_jfk", "en_ljspeech_LJ050-0131", "en_librispeech_1272-128104-0000", "en_jfk"]
    items = [stream.prepare(clips[n].bytes) for n in names]
    results = [None] * 4

    def job(i: int) -> None:  # as Celery's threads pool runs jobs
        ticket = batcher.submit(items[i], TranscriptionOptions(), urgent=True)
        results[i] = ticket.future.result(timeout=60)

    threads = [threading.Thread(target=job, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # four waiting: started at once (max_wait_s is a minute), in one encoder batch
    assert encoded == [4]
    assert "ask not what your country can do for you" in results[0].text.lower()
    assert results[3].text == results[0].text


def test_a_lone_input_starts_after_the_short_wait(clips, encoded):
    stream = open_stream("tiny.en", slots=8)
    batcher = Batcher(stream, batch_size=16, max_wait_s=0.05)
    item = stream.prepare(clips["en_jfk"].bytes)
    result = batcher.submit(item, TranscriptionOptions(), urgent=False).future.result(timeout=60)
    assert "ask not" in result.text.lower() and encoded == [1]


def test_closed_and_waited_for_the_batcher_ends_after_its_inputs(clips):
    def batchers() -> int:  # the other tests' batchers idle on
        return sum(t.name == "batcher" for t in threading.enumerate())

    stream, before = open_stream("tiny.en", slots=8), batchers()
    batcher = Batcher(stream, batch_size=1, max_wait_s=0.0)
    ticket = batcher.submit(stream.prepare(clips["en_jfk"].bytes), TranscriptionOptions(), False)
    assert batchers() == before + 1
    batcher.close(wait=True)
    assert "ask not" in ticket.future.result(timeout=0).text.lower()
    assert not stream.busy and batchers() == before


def test_an_engine_error_fails_the_inputs_in_flight_and_the_next_ones_run(clips, monkeypatch):
    """Any engine error but a GPU fault: the inputs in flight fail (to be retried), the stream
    starts again empty, the batcher goes on."""
    stream = open_stream("tiny.en", slots=8)
    batcher = Batcher(stream, batch_size=2, max_wait_s=60.0)
    launch, broken = Runner.launch, [True]

    def launch_once_broken(self):
        if broken and self.n_live:
            broken.clear()
            raise RuntimeError("a bug in a decode step")
        return launch(self)

    monkeypatch.setattr(Runner, "launch", launch_once_broken)
    data = [clips[n].bytes for n in ("en_jfk", "en_ljspeech_LJ050-0131")]
    tickets = [batcher.submit(stream.prepare(d), TranscriptionOptions(), True) for d in data]
    for ticket in tickets:
        with pytest.raises(EngineFailed, match="a bug in a decode step") as failed:
            ticket.future.result(timeout=60)
        assert failed.value.retry
    assert not stream.busy
    again = [batcher.submit(stream.prepare(d), TranscriptionOptions(), True) for d in data]
    assert "ask not" in again[0].future.result(timeout=60).text.lower()
    assert again[1].future.result(timeout=60).text


def test_a_failed_diarization_fails_its_job_alone(clips, monkeypatch):
    """Speakers are found after an input's windows are decoded: a failure there fails that
    input (to be retried), and the others in flight, and the next, run on."""
    stream = open_stream("tiny.en", slots=8)
    batcher = Batcher(stream, batch_size=2, max_wait_s=0.05)
    broken = [True]
    diarize = stream.engine.diarize

    def diarize_once_broken(recordings):
        if broken:
            broken.clear()
            raise OSError("the recording could not be read again")
        return diarize(recordings)

    monkeypatch.setattr(stream.engine, "diarize", diarize_once_broken)
    item = stream.prepare(clips["en_jfk"].bytes)
    speakers = TranscriptionOptions(diarize=SpeakerCount())
    asking = batcher.submit(item, speakers, True)
    lj = stream.prepare(clips["en_ljspeech_LJ050-0131"].bytes)
    plain = batcher.submit(lj, TranscriptionOptions(), True)
    with pytest.raises(EngineFailed, match="could not be read again") as failed:
        asking.future.result(timeout=60)
    assert failed.value.retry and not failed.value.oom
    assert plain.future.result(timeout=60).text
    again = batcher.submit(item, speakers, True).future.result(timeout=60)
    assert [s.speaker for s in again.speakers] == ["SPEAKER_00"]


def test_a_gpu_fault_goes_to_the_handler_the_process_gave(clips, monkeypatch):
    """The batcher does not end the process itself: it hands a fault of the GPU (a
    torch.AcceleratorError, by type) to the worker's handler, which decides."""
    faults = []
    stream = open_stream("tiny.en", slots=8)
    batcher = Batcher(stream, batch_size=1, max_wait_s=0.0, on_device_fault=faults.append)
    launch = Runner.launch

    def faulty_launch(self):
        if self.n_live and not faults:
            raise torch.AcceleratorError("CUDA error: device-side assert triggered")
        return launch(self)

    monkeypatch.setattr(Runner, "launch", faulty_launch)
    ticket = batcher.submit(stream.prepare(clips["en_jfk"].bytes), TranscriptionOptions(), True)
    with pytest.raises(EngineFailed):
        ticket.future.result(timeout=60)
    assert len(faults) == 1 and isinstance(faults[0], torch.AcceleratorError)


# Batch-mates of a job that faults the GPU in a decode step: a device-side assert from an index
# past the end, seen on the next synchronisation, as the real faults are.
FAULT_MID_BATCH = """
import sys, torch
from engine import Engine, EngineConfig, Stream, TranscriptionOptions
from worker.core.batching import Batcher
from worker.core.process import exit_on_device_fault

step = Stream.step
def faulty_step(self):
    finished = step(self)
    torch.arange(4, device="cuda")[torch.tensor([9], device="cuda")].item()
    return finished
Stream.step = faulty_step

stream = Engine.open(EngineConfig(model="tiny.en", device="cuda"))
batcher = Batcher(stream, len(sys.argv) - 1, 1.0, on_device_fault=exit_on_device_fault)
items = [stream.prepare(open(path, "rb").read()) for path in sys.argv[1:]]
tickets = [batcher.submit(item, TranscriptionOptions(), urgent=True) for item in items]
print([ticket.future.result(timeout=300).text for ticket in tickets])
"""


@pytest.mark.requires_cuda
def test_a_real_cuda_fault_with_inputs_in_flight_ends_the_process(clips):
    """The process exits with CUDA_FAULT_EXIT (its supervisor starts a new one; the jobs are
    taken over by lease) instead of answering its batch-mates from a broken CUDA context."""
    paths = [str(clips[name].path) for name in ("en_jfk", "en_ljspeech_LJ050-0131")]
    result = subprocess.run(
        [sys.executable, "-c", FAULT_MID_BATCH, *paths],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == CUDA_FAULT_EXIT, result.stderr[-3000:]
    assert "engine fault on the GPU, exiting" in result.stderr
    assert result.stdout == ""


# Jobs arriving a few at a time, so that the batcher captures graphs for new batch sizes, while
# other job threads open long audio (3 min), whose first pass runs on the GPU in their thread.
MANY_THREADS = """
import sys, threading, time
import numpy as np
from engine import Engine, EngineConfig, TranscriptionOptions
from worker.core.batching import Batcher

stream = Engine.open(EngineConfig(model="tiny.en", device="cuda"))
batcher = Batcher(stream, batch_size=4, max_wait_s=0.01)
options = TranscriptionOptions()
clip = stream.prepare(open(sys.argv[1], "rb").read())
done = threading.Event()
texts = [None] * 32

def open_long_audio():
    while not done.is_set():
        stream.prepare(np.tile(clip, 16))

def job(i):
    time.sleep(0.01 * i)
    item = stream.prepare(clip)
    texts[i] = batcher.submit(item, options, urgent=False).future.result(timeout=300).text

openers = [threading.Thread(target=open_long_audio) for _ in range(4)]
jobs = [threading.Thread(target=job, args=(i,)) for i in range(len(texts))]
for thread in openers + jobs:
    thread.start()
for thread in jobs:
    thread.join()
done.set()
print(sum("ask not what your country" in text.lower() for text in texts if text))
"""


@pytest.mark.requires_cuda
def test_graphs_are_captured_while_job_threads_use_the_gpu(clips):
    result = subprocess.run(
        [sys.executable, "-c", MANY_THREADS, str(clips["en_jfk"].path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["32"]


def test_an_idle_batcher_captures_what_the_warm_up_left_one_graph_a_turn(clips, monkeypatch):
    """The graphs `Stream.warm` leaves for later are captured while the batcher is idle, one a
    turn: an input arriving meanwhile waits for the capture in hand, not for the rest, and no
    capture runs while the stream has windows to decode."""
    stream = open_stream("tiny.en", slots=8)
    seen, left, tickets = [], [6], []

    def capture_next(self):  # as on CUDA with six prefills left, each taking its time
        seen.append((self.n_live, bool(tickets) and tickets[0].future.done()))
        while len(seen) == 2 and not tickets:
            time.sleep(0.01)  # the input arrives during the second capture
        left[0] -= 1
        return left[0] >= 0

    monkeypatch.setattr(Runner, "capture_next", capture_next)
    batcher = Batcher(stream, batch_size=4, max_wait_s=0.0)
    until(lambda: len(seen) == 2)
    item = stream.prepare(clips["en_jfk"].bytes)
    tickets.append(batcher.submit(item, TranscriptionOptions(), urgent=True))
    assert "ask not" in tickets[0].future.result(timeout=60).text.lower()
    until(lambda: len(seen) == 7)
    time.sleep(0.2)
    assert len(seen) == 7  # six captured, a seventh found none left, then no more asks
    assert all(live == 0 for live, _ in seen)
    assert [done for _, done in seen] == [False, False, True, True, True, True, True]


def until(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "not in time"
        time.sleep(0.01)
