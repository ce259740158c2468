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
        header = parse_npy_header(data, 10_000)
        assert (header.dtype, header.shape, header.frames) == (dtype, (1, 128, 3500), 3500)
        assert header.offset + header.nbytes == len(data)
        assert all_finite(data[header.offset :], dtype)
        for bad in (np.nan, np.inf, -np.inf):
            array[0, 5, 7] = bad
            buf = io.BytesIO()
            np.save(buf, array)
            assert not all_finite(buf.getvalue()[header.offset :], dtype)
