"""The reliability contract under real faults: worker processes killed (`kill -9`) and stopped
(SIGTERM) mid-batch, messages delivered twice, malformed inputs among good ones. Real Redis
(our own), moto's S3 server, real worker processes (`tests/faults/fleet.py`). Each test
prints `submitted N, succeeded S, failed F, duplicates D, lost L`; docs/reliability.md has the
table. The contract's other faults: test_restarts.py and test_processes.py (one file a theme,
so that pytest-xdist runs them side by side)."""

from __future__ import annotations

import io
import signal

import numpy as np
import pytest

from tests.faults.fleet import RUNNING, submit_many

pytestmark = pytest.mark.slow


def test_kill_9_mid_batch_then_a_new_worker_finishes_every_job_once(fleet, inputs):
    ids = submit_many(fleet, inputs, 12)  # a batch of 8 (the fleet's concurrency) and more
    first = fleet.start_worker()
    fleet.wait_until(ids, RUNNING, 1, timeout=120)
    first.kill()  # mid-batch: jobs running, others prefetched
    first.wait()
    fleet.start_worker()
    fleet.wait_all(ids)
    tally = fleet.tally(ids)
    assert (tally.succeeded, tally.duplicates, tally.lost) == (12, 0, 0)
    assert "has no live worker: sent again" in fleet.logs()  # the reconciler took over


@pytest.mark.parametrize("point", ["after_result", "before_ack"])
def test_kill_9_after_the_result_is_written_leaves_one_result(fleet, inputs, point):
    """after_result: killed after the put, before the record; before_ack: after both."""
    ids = submit_many(fleet, inputs, 4)
    dying = fleet.start_worker(failpoint=point)
    assert dying.wait(timeout=120) == -signal.SIGKILL
    fleet.start_worker()
    fleet.wait_all(ids)
    tally = fleet.tally(ids)
    assert (tally.succeeded, tally.duplicates, tally.lost) == (4, 0, 0)
    if point == "after_result":  # its job was taken over, and its stored result kept
        assert "result was stored" in fleet.logs()


def test_one_message_delivered_twice_to_two_workers_runs_once(fleet, inputs):
    ids = submit_many(fleet, inputs, 8, twice=True)
    fleet.start_worker()
    fleet.start_worker()
    fleet.wait_all(ids)
    tally = fleet.tally(ids)
    assert (tally.succeeded, tally.duplicates, tally.lost) == (8, 0, 0)
    assert all(fleet.store.get(i).attempts == 1 for i in ids)
    # each second delivery dropped, and so is each one more that the reconciler sent (under
    # load a worker's prefetched message can look missing past STALE_AFTER_S: 15 drops, 3
    # sent again, in one suite run)
    logs = fleet.logs()
    assert logs.count("dropping this delivery") == 8 + logs.count("has no live worker: sent again")


def malformed(good: bytes) -> list[tuple[bytes, str, str]]:
    """Ten bad inputs put straight into storage: (data, kind, format)."""

    def npy(array: np.ndarray) -> bytes:
        out = io.BytesIO()
        np.save(out, array)
        return out.getvalue()

    nan = np.zeros((80, 3000), np.float32)
    nan[3, 7] = np.nan
    bad = [
        (b"this is not audio at all, just some text", "audio", "flac"),
        (b"", "audio", "flac"),
        (good[: len(good) // 3], "audio", "flac"),  # truncated
        (npy(nan), "spectrogram", "npy"),
        (npy(np.zeros((128, 3000), np.float32)), "spectrogram", "npy"),  # tiny.en has 80 mels
    ]
    return bad * 2


def test_ten_malformed_inputs_among_good_ones_fail_alone(fleet, inputs):
    """In the same batches as good inputs (8 threads, the bad ones queued among the last good
    ones), each malformed one fails alone, and no good one fails or runs twice."""
    bad = malformed(inputs[0])
    good_ids = submit_many(fleet, inputs, 12)
    bad_ids = [fleet.submit(data, kind, fmt) for data, kind, fmt in bad]
    worker = fleet.start_worker()
    fleet.wait_all(good_ids + bad_ids, timeout=600)
    tally = fleet.tally(good_ids + bad_ids)
    assert (tally.succeeded, tally.failed, tally.duplicates, tally.lost) == (12, 10, 0, 0)
    for job_id in bad_ids:
        error = fleet.store.get(job_id).error
        assert error.code in ("invalid_audio", "invalid_spectrogram") and error.message
    assert worker.poll() is None  # never restarted: the same process took every job
    assert all(fleet.store.get(i).attempts == 1 for i in good_ids + bad_ids)


def test_sigterm_during_a_batch_drains_without_loss_or_repeats(fleet, inputs):
    ids = submit_many(fleet, inputs, 12)
    first = fleet.start_worker()
    fleet.wait_until(ids, RUNNING, 1, timeout=120)
    assert fleet.readiness() == "ok"
    first.terminate()  # warm shutdown: take nothing more, finish what is in flight
    fleet.wait_readiness("unavailable", timeout=5)  # draining: no longer a worker taking jobs
    assert first.wait(timeout=120) == 0
    fleet.start_worker()
    fleet.wait_all(ids)
    tally = fleet.tally(ids)
    assert (tally.succeeded, tally.duplicates, tally.lost) == (12, 0, 0)
    assert all(fleet.store.get(i).attempts == 1 for i in ids)  # nothing ran twice
