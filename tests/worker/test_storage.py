"""Object storage over a real S3 HTTP endpoint (moto's server)."""

import logging
import threading

import pytest

from worker.storage import PART_SIZE, Storage


@pytest.fixture
def storage(settings) -> Storage:
    s = Storage(settings)
    s.ensure_bucket()
    return s


def test_result_is_written_once(storage):
    assert storage.put_once("jobs/t/1/result.json", b'{"text": "first"}', "application/json")
    assert not storage.put_once("jobs/t/1/result.json", b'{"text": "second"}', "application/json")
    assert storage.get("jobs/t/1/result.json") == b'{"text": "first"}'


@pytest.mark.parametrize("size", [0, 1000, PART_SIZE + 12345, 2 * PART_SIZE])
def test_streamed_writes_round_trip(storage, size):
    data = bytes(range(256)) * (size // 256) + b"x" * (size % 256)
    writer = storage.writer("jobs/t/2/input")
    for i in range(0, len(data), 65536):
        if writer.append(data[i : i + 65536]):
            writer.flush()
    writer.close()
    assert storage.get("jobs/t/2/input") == data


def test_aborted_multipart_leaves_nothing(storage):
    writer = storage.writer("jobs/t/3/input")
    assert writer.append(b"a" * (PART_SIZE + 1))
    writer.flush()
    writer.abort()
    with pytest.raises(storage.client.exceptions.NoSuchKey):
        storage.get("jobs/t/3/input")


@pytest.mark.parametrize("size", [1000, PART_SIZE + 1])
def test_abort_after_close_deletes_the_object(storage, size):
    """A submission that fails after its input was stored takes the input back."""
    writer = storage.writer("jobs/t/4/input")
    if writer.append(b"a" * size):
        writer.flush()
    writer.close()
    writer.abort()
    assert list(storage.pages("jobs/")) == [[]]


def test_pages_list_keys_under_a_prefix(storage):
    for key in ("jobs/t/5/input", "jobs/t/5/result.json", "other/x"):
        storage.put_once(key, b"x", "application/octet-stream")
    assert [sorted(page) for page in storage.pages("jobs/")] == [
        ["jobs/t/5/input", "jobs/t/5/result.json"]
    ]


def _pool_full_warnings(storage: Storage, threads: int, caplog) -> int:
    """`threads` threads reading at once, again and again: the times urllib3 found the pool
    full and dropped a connection (each one made and closed for nothing)."""
    storage.ensure_bucket()
    storage.client.put_object(Bucket=storage.bucket, Key="jobs/t/4/input", Body=b"x" * 100_000)
    start = threading.Barrier(threads)

    def read() -> None:
        start.wait()
        for _ in range(5):
            storage.get("jobs/t/4/input")

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="urllib3.connectionpool"):
        workers = [threading.Thread(target=read) for _ in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    return sum("Connection pool is full" in r.getMessage() for r in caplog.records)


def test_the_connection_pool_holds_a_connection_for_each_thread(settings, caplog):
    """Issue #37: the worker's client kept 10 connections for 80 job threads ("Connection
    pool is full" some 1,700 times in one run on the H200)."""
    assert _pool_full_warnings(Storage(settings), 40, caplog) > 0  # botocore's 10: the finding
    sized = Storage(settings, threads=40)
    assert sized.client.meta.config.max_pool_connections == 40
    assert _pool_full_warnings(sized, 40, caplog) == 0
    assert Storage(settings, threads=2).client.meta.config.max_pool_connections == 10
