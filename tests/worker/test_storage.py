"""Object storage over a real S3 HTTP endpoint (moto's server)."""

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
