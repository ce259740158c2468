import pytest

from worker.inputs import sniff


@pytest.mark.parametrize(
    "head, fmt, supported",
    [
        (b"RIFF\x24\x00\x00\x00WAVEfmt ", "wav", True),
        (b"fLaC\x00\x00\x00\x22", "flac", True),
        (b"OggS\x00\x02\x00\x00", "ogg", True),
        (b"ID3\x04\x00\x00\x00\x00", "mp3", True),
        (b"\xff\xfb\x90\x64\x00", "mp3", True),
        (b"\xff\xf1\x50\x80\x00", "aac", False),
        (b"\x00\x00\x00\x20ftypM4A ", "mp4", False),
        (b"\x1a\x45\xdf\xa3\x9f\x42", "webm", False),
        (b"\x93NUMPY\x01\x00", "npy", False),
        (b"<html><body>", None, False),
        (b"", None, False),
    ],
)
def test_sniff(head, fmt, supported):
    result = sniff(head)
    assert (result.format, result.supported) == (fmt, supported)
