"""The same file gets the same verdict however the wire cuts it: into the inspector directly,
and through real multipart requests with and without other fields before the file."""

import io

import numpy as np
import pytest
from fastapi.testclient import TestClient

from api.main import create_app
from tests.api import wire
from tests.api.test_jobs_api import stored_keys
from worker.contract.options import OptionError
from worker.contract.uploads import HEAD_BYTES, Inspector

HEADER = 128  # numpy's header for this array: its first float starts here
# 1 byte, odd primes (100003: a first chunk past the header window), around the end of the
# .npy header and of the header window, whole
CHUNKS = [1, 7, 61, 4099, 100_003, HEADER - 2, HEADER + 2, HEAD_BYTES - 2, HEAD_BYTES + 2, None]
NAN_AT = {  # the float that is NaN: its index (2 bytes each)
    "first float": 0,
    "just past the header window": (HEAD_BYTES + 64 - HEADER) // 2,
    "in the middle": 80 * 3000 // 2,
    "last float": 80 * 3000 - 1,
}


def spectrogram(nan_at: int | None = None) -> bytes:
    mel = np.random.default_rng(0).standard_normal((80, 3000)).astype(np.float16)
    if nan_at is not None:
        mel.flat[nan_at] = np.nan
    buf = io.BytesIO()
    np.save(buf, mel)
    data = buf.getvalue()
    assert data[HEADER:] == mel.tobytes()
    return data


def cut(data: bytes, size: int | None) -> list[bytes]:
    return wire.chunked(data, size or len(data))


@pytest.mark.parametrize("size", CHUNKS)
def test_the_inspector_accepts_a_valid_spectrogram_in_any_chunks(size):
    inspector = Inspector(max_bytes=2**20, max_audio_s=60)
    for chunk in cut(spectrogram(), size):
        inspector.feed(chunk)
    assert inspector.finish().npy.shape == (80, 3000)


@pytest.mark.parametrize("where", NAN_AT)
@pytest.mark.parametrize("size", CHUNKS)
def test_the_inspector_finds_a_nan_in_any_chunks(size, where):
    inspector = Inspector(max_bytes=2**20, max_audio_s=60)
    with pytest.raises(OptionError, match="NaN or infinite") as refused:
        for chunk in cut(spectrogram(NAN_AT[where]), size):
            inspector.feed(chunk)
        inspector.finish()
    assert refused.value.code == "invalid_spectrogram"


@pytest.mark.parametrize(
    "fields", [{}, {"model": "tiny.en", "language": "en"}], ids=["alone", "after fields"]
)
@pytest.mark.parametrize("size", CHUNKS)
def test_a_multipart_spectrogram_has_one_verdict_in_any_chunks(settings, size, fields):
    app = create_app(settings)
    with TestClient(app):
        ok = wire.post(app, cut(wire.multipart(spectrogram(), "mel.npy", **fields), size))
        assert ok.status_code == 202, ok.text
        for where, index in NAN_AT.items():
            body = wire.multipart(spectrogram(index), "mel.npy", **fields)
            refused = wire.post(app, cut(body, size))
            assert refused.status_code == 422, (where, refused.text)
            assert refused.json()["error"]["code"] == "invalid_spectrogram"
            assert "NaN or infinite" in refused.json()["error"]["message"], where
    assert stored_keys(settings) == [f"jobs/default/{ok.json()['id']}/input"]
