"""Hostile input at the door: every one is a 4xx in JSON that names what was wrong with the
input (never the process), and leaves nothing behind: no object, no record, no message.
docs/reliability.md's table "Hostile input at the door" lists these cases."""

import pytest
import redis
from fastapi.testclient import TestClient

from api.main import create_app
from tests.api import wire
from tests.api.test_jobs_api import queued_messages, stored_keys

B = wire.BOUNDARY
FLAC = b"fLaC\x00\x00\x00\x22" + bytes(200)  # enough of a FLAC for the door


def part(name: str, value: bytes, *headers: str) -> bytes:
    head = "".join(f"{h}\r\n" for h in headers)
    return (
        f'--{B}\r\nContent-Disposition: form-data; name="{name}"\r\n{head}\r\n'.encode()
        + value
        + b"\r\n"
    )


def npy(header: str, data: bytes = bytes(64), version: int = 1) -> bytes:
    """A .npy file with this header text, padded as numpy pads it."""
    text = header.encode("latin1")
    prefix = 10 if version == 1 else 12
    text += b" " * (-(prefix + len(text) + 1) % 64) + b"\n"
    size = len(text).to_bytes(2 if version == 1 else 4, "little")
    return b"\x93NUMPY" + bytes([version, 0]) + size + text + data


def header(descr="'<f4'", fortran="False", shape="(80, 3000)") -> str:
    return f"{{'descr': {descr}, 'fortran_order': {fortran}, 'shape': {shape}, }}"


END = f"--{B}--\r\n".encode()
CASES = [
    # the multipart body itself
    ("no parts", END, wire.MULTIPART, 422, "invalid_request", "no `file` part"),
    ("empty body", b"", wire.MULTIPART, 422, "invalid_request", "no `file` part"),
    (
        "empty boundary",
        part("file", FLAC) + END,
        "multipart/form-data; boundary=",
        422,
        "invalid_request",
        "boundary must be 1 to 70 characters",
    ),
    (
        "boundary of 71 characters",
        part("file", FLAC) + END,
        f"multipart/form-data; boundary={'b' * 71}",
        422,
        "invalid_request",
        "boundary must be 1 to 70 characters",
    ),
    (
        "garbage before the first boundary",
        b"junk" * 1000 + b"\r\n" + part("file", FLAC) + END,
        wire.MULTIPART,
        422,
        "invalid_request",
        "does not follow the boundary",
    ),
    (
        "20 headers in a part",
        part("file", FLAC, *(f"X-Header-{i}: v" for i in range(20))) + END,
        wire.MULTIPART,
        422,
        "invalid_request",
        "more than 8 headers",
    ),
    (
        "a file name of 5,000 characters",
        wire.multipart(FLAC, "a" * 5000 + ".flac"),
        wire.MULTIPART,
        422,
        "invalid_request",
        "header is over 4096 bytes",
    ),
    (
        "a body cut before its closing boundary",
        part("file", FLAC),
        wire.MULTIPART,
        422,
        "invalid_request",
        "cut short",
    ),
    (
        "a field sent 10,000 times",
        b"".join(part("model", b"tiny.en") for _ in range(10_000)) + part("file", FLAC) + END,
        wire.MULTIPART,
        422,
        "invalid_request",
        "'model' was sent twice",
    ),
    # .npy headers
    (
        "a .npy header of 30,000 characters",
        wire.multipart(npy(header(shape="(" * 15_000 + ")" * 15_000))),
        wire.MULTIPART,
        422,
        "invalid_spectrogram",
        "a .npy header of 30080 bytes; at most 10000",
    ),
    (
        "shape (80, 3000.5)",
        wire.multipart(npy(header(shape="(80, 3000.5)"))),
        wire.MULTIPART,
        422,
        "invalid_spectrogram",
        "shape (80, 3000.5): expected a tuple of whole numbers",
    ),
    (
        "shape (True, 80, 3000)",
        wire.multipart(npy(header(shape="(True, 80, 3000)"))),
        wire.MULTIPART,
        422,
        "invalid_spectrogram",
        "shape (True, 80, 3000): expected a tuple",
    ),
    (
        "shape (80, -3000)",
        wire.multipart(npy(header(shape="(80, -3000)"))),
        wire.MULTIPART,
        422,
        "invalid_spectrogram",
        "shape (80, -3000): expected a tuple of whole numbers",
    ),
    (
        "shape [80, 3000] (a list)",
        wire.multipart(npy(header(shape="[80, 3000]"))),
        wire.MULTIPART,
        422,
        "invalid_spectrogram",
        "shape [80, 3000]: expected a tuple",
    ),
    (
        "a dimension of 10**30",
        wire.multipart(npy(header(shape=f"(80, {10**30})"))),
        wire.MULTIPART,
        422,
        "invalid_spectrogram",
        "expected a tuple of whole numbers",
    ),
    (
        "dimensions whose bytes pass the size cap (128 x 5000 float64: 5 MB)",
        wire.multipart(npy(header(descr="'<f8'", shape="(128, 5000)"))),
        wire.MULTIPART,
        413,
        "too_large",
        "the .npy header describes 5120128 bytes",
    ),
    (
        "dtype >f4 (big-endian)",
        wire.multipart(npy(header(descr="'>f4'"))),
        wire.MULTIPART,
        422,
        "invalid_spectrogram",
        "dtype '>f4'",
    ),
    (
        "dtype |b1",
        wire.multipart(npy(header(descr="'|b1'"))),
        wire.MULTIPART,
        422,
        "invalid_spectrogram",
        "dtype '|b1'",
    ),
    (
        "a structured dtype",
        wire.multipart(npy(header(descr="[('a', '<f4')]"))),
        wire.MULTIPART,
        422,
        "invalid_spectrogram",
        "dtype [('a', '<f4')]",
    ),
    (
        "fortran_order 0",
        wire.multipart(npy(header(fortran="0"))),
        wire.MULTIPART,
        422,
        "invalid_spectrogram",
        "fortran_order 0: expected True or False",
    ),
    (
        "a header that is a list",
        wire.multipart(npy("[1, 2]")),
        wire.MULTIPART,
        422,
        "invalid_spectrogram",
        "not a dict of descr, fortran_order and shape",
    ),
    (
        "a header with a fourth key",
        wire.multipart(npy(header()[:-1] + "'extra': 1}")),
        wire.MULTIPART,
        422,
        "invalid_spectrogram",
        "not a dict of descr, fortran_order and shape",
    ),
    (
        "a header naming a variable",
        wire.multipart(npy(header(fortran="x"))),
        wire.MULTIPART,
        422,
        "invalid_spectrogram",
        "not a Python literal",
    ),
    (
        "a header nested 5,000 deep",
        wire.multipart(npy("-" * 5000 + "1")),
        wire.MULTIPART,
        422,
        "invalid_spectrogram",
        "not a Python literal",
    ),
    (
        "a .npy of version 9",
        wire.multipart(npy(header(), version=9)),
        wire.MULTIPART,
        422,
        "invalid_spectrogram",
        "not a .npy file of version 1, 2 or 3",
    ),
]


@pytest.fixture
def client(settings):
    with TestClient(create_app(settings)) as c:
        yield c


def assert_refused_leaving_nothing(settings, response, status, code, words) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == code and words in error["message"], error
    for internal in ("Error", "Traceback", " object at 0x", "<ast.", "127.0.0.1"):
        assert internal not in response.text
    assert stored_keys(settings) == [] and not queued_messages(settings)
    assert redis.Redis.from_url(settings.redis_url).keys("whisperfleet:job:*") == []


@pytest.mark.parametrize(
    "body, content_type, status, code, words", [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_hostile_input_is_refused_in_json_and_leaves_nothing(
    client, settings, body, content_type, status, code, words
):
    response = client.post("/v1/jobs", content=body, headers={"content-type": content_type})
    assert_refused_leaving_nothing(settings, response, status, code, words)


def test_the_whole_body_is_capped_without_a_content_length(client, settings):
    """50,000 small parts after the closing boundary (the parser skips an epilogue), streamed
    without a Content-Length: refused once the body passes the file's cap + 64 KiB."""
    epilogue = b"".join(part(f"f{i}", b"x" * 40) for i in range(50_000))
    body = wire.multipart(FLAC) + epilogue
    assert len(body) > settings.max_upload_bytes + 64 * 1024
    response = wire.post(client.app, wire.chunked(body, 65536))
    assert_refused_leaving_nothing(settings, response, 413, "too_large", "request body is over")
