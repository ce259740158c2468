"""Micro-batching: jobs on many threads share the engine's batches; a lone one is not held."""

import subprocess
import sys
import threading

import pytest
import torch

from engine.longform import TranscriptionOptions
from engine.scheduler import Scheduler
from engine.transcribe import Transcriber
from worker.batching import CUDA_FAULT_EXIT, Batcher, _device_fault


@pytest.fixture
def encoded(monkeypatch) -> list[int]:
    """The size of every encoder batch the scheduler runs."""
    sizes, encode = [], Scheduler.encode

    def spy(self, mels):
        sizes.append(len(mels))
        return encode(self, mels)

    monkeypatch.setattr(Scheduler, "encode", spy)
    return sizes


def test_inputs_arriving_together_share_an_encoder_batch(tiny_en, clips, encoded):
    transcriber = Transcriber(tiny_en.loaded, n_slots=8)
    batcher = Batcher(transcriber, batch_size=4, max_wait_s=60.0)
    options = TranscriptionOptions().verified(tiny_en.loaded.tokenizer)
    names = ["en_jfk", "en_ljspeech_LJ050-0131", "en_librispeech_1272-128104-0000", "en_jfk"]
    items = [transcriber.prepare(clips[n].bytes) for n in names]
    results = [None] * 4

    def job(i: int) -> None:  # as Celery's threads pool runs jobs
        results[i] = batcher.submit(items[i], options, urgent=True).future.result(timeout=60)

    threads = [threading.Thread(target=job, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # four waiting: started at once (max_wait_s is a minute), in one encoder batch
    assert encoded == [4]
    assert "ask not what your country can do for you" in results[0].text.lower()
    assert results[3].text == results[0].text


def test_a_lone_input_starts_after_the_short_wait(tiny_en, clips, encoded):
    batcher = Batcher(Transcriber(tiny_en.loaded, n_slots=8), batch_size=16, max_wait_s=0.05)
    options = TranscriptionOptions().verified(tiny_en.loaded.tokenizer)
    item = batcher.transcriber.prepare(clips["en_jfk"].bytes)
    result = batcher.submit(item, options, urgent=False).future.result(timeout=60)
    assert "ask not" in result.text.lower() and encoded == [1]


@pytest.mark.parametrize(
    "error, fault",
    [
        (RuntimeError("CUDA error: an illegal memory access was encountered"), True),
        (RuntimeError("CUDA error: device-side assert triggered"), True),
        (RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasGemmEx"), True),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
        (RuntimeError("no window is ready, yet some inputs are not done"), False),
        (ValueError("seek 3000 is behind frame 6000"), False),
    ],
)
def test_only_faults_of_the_gpu_itself_end_the_process(error, fault):
    assert _device_fault(error) is fault


# Batch-mates of a job that faults the GPU in a decode step: a device-side assert from an index
# past the end, seen on the next synchronisation, as the real faults are.
FAULT_MID_BATCH = """
import sys, torch
from engine.longform import TranscriptionOptions
from engine.transcribe import Stream, Transcriber
from worker.batching import Batcher

step = Stream.step
def faulty_step(self):
    finished = step(self)
    torch.arange(4, device="cuda")[torch.tensor([9], device="cuda")].item()
    return finished
Stream.step = faulty_step

transcriber = Transcriber.load("tiny.en", device="cuda")
batcher = Batcher(transcriber, batch_size=len(sys.argv) - 1, max_wait_s=1.0)
options = TranscriptionOptions().verified(transcriber.loaded.tokenizer)
items = [transcriber.prepare(open(path, "rb").read()) for path in sys.argv[1:]]
tickets = [batcher.submit(item, options, urgent=True) for item in items]
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
from engine.longform import TranscriptionOptions
from engine.transcribe import Transcriber
from worker.batching import Batcher

transcriber = Transcriber.load("tiny.en", device="cuda")
batcher = Batcher(transcriber, batch_size=4, max_wait_s=0.01)
options = TranscriptionOptions().verified(transcriber.loaded.tokenizer)
clip = transcriber.prepare(open(sys.argv[1], "rb").read())
done = threading.Event()
texts = [None] * 32

def open_long_audio():
    while not done.is_set():
        transcriber.prepare(np.tile(clip, 16))

def job(i):
    time.sleep(0.01 * i)
    item = transcriber.prepare(clip)
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
