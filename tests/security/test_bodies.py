"""Bodies at the door: a caller is authenticated before any of its body is read, and no body
is read past its cap (issue #37: a caller without a key made the API buffer 64 MB of JSON on
POST /v1/backfills, about 190 MB of memory, before its 401)."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys

import httpx
import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from api.bodies import MAX_JSON_BYTES
from api.main import ROUTERS, create_app
from tests.api import wire
from tests.api.test_jobs_api import assert_error
from tests.conftest import free_port, stop, wait_for_port
from worker.contract.tenants import Tenants

CHUNK = 16 * 1024
JSON = "application/json"
# every route that takes a body, and the kind of body it takes
BODIES = [
    ("/v1/jobs", JSON),
    ("/v1/jobs", wire.MULTIPART),
    ("/v1/backfills", JSON),
    ("/v1/audio/transcriptions", wire.MULTIPART),
    ("/v1/audio/translations", wire.MULTIPART),
]


@pytest.fixture
def keyed(settings):
    return settings.model_copy(update={"auth": "keys"})


def send(app, path: str, content_type: str, chunks: int, key: str | None = None):
    """POST `chunks` chunks of CHUNK bytes (no Content-Length), each pulled only when the app
    reads it; returns the answer and how many chunks the app pulled."""
    pulled = 0

    async def body():
        nonlocal pulled
        for _ in range(chunks):
            pulled += 1
            yield b"[" * CHUNK

    async def post() -> httpx.Response:
        headers = {"content-type": content_type}
        if key:
            headers["authorization"] = f"Bearer {key}"
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            return await client.post(path, content=body(), headers=headers)

    return asyncio.run(post()), pulled


def test_no_route_has_a_body_parameter_which_fastapi_would_read_before_authenticating():
    """FastAPI reads a declared body before it runs the route's dependencies (its key)."""
    routes = [r for router in ROUTERS for r in router.routes if isinstance(r, APIRoute)]
    assert any("POST" in r.methods for r in routes)
    assert [r.path for r in routes if r.body_field is not None] == []


@pytest.mark.parametrize("path, content_type", BODIES)
def test_a_caller_without_a_key_is_refused_before_its_body_is_read(keyed, path, content_type):
    app = create_app(keyed)
    with TestClient(app):
        answer, pulled = send(app, path, content_type, chunks=4096)  # 64 MiB
    assert_error(answer, 401, "unauthorized")
    assert pulled <= 1
    with TestClient(app):
        answer, pulled = send(app, path, content_type, chunks=4096, key="wf_not-a-key")
    assert_error(answer, 401, "invalid_key")
    assert pulled <= 1


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/backfills"])
def test_a_json_body_past_its_cap_is_refused_as_it_arrives(keyed, path):
    app = create_app(keyed)
    with TestClient(app) as client:
        key, _ = Tenants(app.state.store.redis, keyed).create_key("acme")
        answer, pulled = send(app, path, JSON, chunks=4096, key=key)
        assert_error(answer, 413, "too_large", str(MAX_JSON_BYTES))
        assert pulled <= MAX_JSON_BYTES // CHUNK + 1
        # declared too long: refused before a byte is read
        big = {"authorization": f"Bearer {key}", "content-length": str(64 * 2**20)}
        answer = client.post(path, content=b"{}", headers={**big, "content-type": JSON})
        assert_error(answer, 413, "too_large")


@pytest.mark.parametrize("path", ["/v1/jobs", "/v1/backfills"])
@pytest.mark.parametrize("body", ["[" * 20_000 + "]" * 20_000, '{"a":' * 5_000 + "1" + "}" * 5_000])
def test_json_nested_too_deeply_to_parse_is_a_422_not_a_500(settings, path, body):
    assert len(body) <= MAX_JSON_BYTES
    with TestClient(create_app(settings)) as client:
        answer = client.post(path, content=body, headers={"content-type": JSON})
    assert_error(answer, 422, "invalid_request", "nested too deeply")


def test_the_api_process_answers_a_caller_without_a_key_before_its_body_arrives(stack_env):
    """A real `whisperfleet api` with keys on: a POST declaring 64 MB, of which 1 KiB is sent,
    is answered 401 at once (not after the server waited for, and held, the rest)."""
    port = free_port()
    env = {**stack_env, "WHISPERFLEET_AUTH": "keys"}
    api = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "api", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_for_port(port, api)
        for path, content_type in BODIES:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
                head = (
                    f"POST {path} HTTP/1.1\r\nHost: api\r\nContent-Type: {content_type}\r\n"
                    f"Content-Length: {64 * 2**20}\r\n\r\n"
                )
                s.sendall(head.encode() + b"[" * 1024)
                status, body = read_answer(s)
            assert status == "HTTP/1.1 401 Unauthorized", (path, status)
            assert json.loads(body)["error"]["code"] == "unauthorized"
    finally:
        stop(api)


def read_answer(s: socket.socket) -> tuple[str, bytes]:
    """An HTTP/1.1 answer's status line and body (by its Content-Length)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += s.recv(65536) or pytest.fail(f"the connection closed: {data!r}")
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin1").split("\r\n")
    length = next(
        int(v) for k, _, v in (x.partition(": ") for x in lines) if k.lower() == "content-length"
    )
    while len(body) < length:
        body += s.recv(65536) or pytest.fail("the connection closed mid-answer")
    return lines[0], body
