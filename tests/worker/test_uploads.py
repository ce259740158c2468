import pytest

from worker.contract.uploads import sniff


@pytest.mark.parametrize(
    "head, fmt, supported",
    [
        (b"RIFF\x24\x00\x00\x00WAVEfmt ", "wav", True),
        (b"fLaC\x00\x00\x00\x22", "flac", True),
        (b"OggS\x00\x02\x00\x00", "ogg", True),
        (b"ID3\x04\x00\x00\x00\x00", "mp3", True),
        (b"\xff\xfb\x90\x64\x00", "mp3", True),
        (b"\xff\xf1\x50\x80\x00", "aac", True),
        (b"\x00\x00\x00\x20ftypM4A ", "mp4", True),
        (b"\x1a\x45\xdf\xa3\x9f\x42", "webm", True),
        (b"\x93NUMPY\x01\x00", "npy", True),
        (b"<html><body>", None, False),
        (b"", None, False),
    ],
)
def test_sniff(head, fmt, supported):
    result = sniff(head)
    assert (result.format, result.supported) == (fmt, supported)


def test_spectrogram_headers_and_values_without_numpy_in_the_api():
    import io

    import numpy as np

    from worker.contract.uploads import all_finite, parse_npy_header

    for dtype in ("<f2", "<f4", "<f8"):
        array = np.random.default_rng(0).standard_normal((1, 128, 3500)).astype(dtype)
        buf = io.BytesIO()
        np.save(buf, array)
        data = buf.getvalue()
        header = parse_npy_header(data)
        assert (header.dtype, header.shape, header.frames) == (dtype, (1, 128, 3500), 3500)
        assert header.offset + header.nbytes == len(data)
        assert all_finite(data[header.offset :], dtype)
        for bad in (np.nan, np.inf, -np.inf):
            array[0, 5, 7] = bad
            buf = io.BytesIO()
            np.save(buf, array)
            assert not all_finite(buf.getvalue()[header.offset :], dtype)


def _wav(seconds: float, *chunks: bytes) -> bytes:
    """A 16 kHz mono 16-bit WAV with `chunks` (id + size + data) before its `data` chunk."""
    import struct

    data = bytes(int(16000 * seconds) * 2)
    fmt = b"fmt " + struct.pack("<IHHIIHH", 16, 1, 1, 16000, 32000, 2, 16)
    body = b"WAVE" + fmt + b"".join(chunks) + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


@pytest.mark.parametrize(
    "name, data, duration",
    [
        ("wav", _wav(2.5), 2.5),
        ("wav after an odd-sized chunk", _wav(1.0, b"LIST\x03\x00\x00\x00abc\x00"), 1.0),
        (
            "wav with its data past the window",
            _wav(0.1, b"junk\x80\x38\x01\x00" + bytes(80_000)),
            None,
        ),
        ("flac", "en_jfk", 11.0),
        ("npy", "npy", 35.0),
        ("ogg", b"OggS\x00\x02" + bytes(100), None),
    ],
)
def test_the_length_a_header_declares(clips, name, data, duration):
    """Read from the first bytes only, the same whatever the prefix it is first asked with."""
    import io

    import numpy as np

    from worker.contract.uploads import HEAD_BYTES, read_head

    if data == "npy":
        buf = io.BytesIO()
        np.save(buf, np.zeros((1, 80, 3500), np.float32))
        data = buf.getvalue()
    elif isinstance(data, str):
        data = clips[data].bytes
    head = data[:HEAD_BYTES]
    found = read_head(head, complete=True)
    assert (
        found.duration_s == pytest.approx(duration, abs=0.01) if duration else not found.duration_s
    )
    n = 0
    while isinstance(step := read_head(head[:n], complete=n == len(head)), int):
        assert step > n  # it asks for more than it holds
        n = min(step, len(head))
    assert step == found
