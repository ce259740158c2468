"""Micro-batching: jobs on many threads share the engine's batches; a lone one is not held."""

import threading

import pytest
import torch

from engine.longform import TranscriptionOptions
from engine.scheduler import Scheduler
from engine.transcribe import Transcriber
from worker.batching import Batcher, _device_fault


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
