"""The API v1 door in-process (real Redis, a real S3 endpoint, no worker): cancelling a queued
job, form fields in either order, HEAD and 405, CORS, download URLs unset, storage secrets,
the docs pages on local assets."""

from __future__ import annotations

import asyncio
import re
from html.parser import HTMLParser
from importlib.resources import files

import pytest
import redis
from fastapi.testclient import TestClient
from pydantic import ValidationError

from api.main import create_app
from tests.api.test_jobs_api import assert_error, queued_messages, stored_keys, submit
from tests.api.wire import MULTIPART, multipart, post
from worker.contract.jobs import JobStatus, JobStore
from worker.contract.settings import Settings


@pytest.fixture
def client(settings):
    with TestClient(create_app(settings)) as c:
        yield c


def test_a_queued_job_is_cancelled_its_input_deleted_its_record_kept_a_while(
    client, settings, clips
):
    job = submit(client, clips["en_jfk"].bytes).json()
    assert stored_keys(settings) == [f"jobs/default/{job['id']}/input"]
    answer = client.delete(f"/v1/jobs/{job['id']}")
    assert answer.status_code == 200, answer.text
    assert answer.json()["status"] == "cancelled"
    assert answer.json()["error"] == {"code": "cancelled", "message": "cancelled by the client"}
    assert stored_keys(settings) == []
    store = JobStore(redis.Redis.from_url(settings.redis_url))
    assert store.get(job["id"]).status is JobStatus.cancelled
    ttl = store.redis.ttl(f"whisperfleet:job:{job['id']}")
    assert 0 < ttl <= settings.cancelled_retention_s
    assert store.in_flight("default") == 0
    # its message is still queued: the worker drops it, the record being terminal
    assert len(queued_messages(settings)) == 1
    assert_error(client.get(f"/v1/jobs/{job['id']}/result"), 409, "job_cancelled")
    listed = client.get("/v1/jobs").json()["data"]
    assert [(j["id"], j["status"]) for j in listed] == [(job["id"], "cancelled")]

    assert client.delete(f"/v1/jobs/{job['id']}").status_code == 204  # now forgotten
    assert_error(client.get(f"/v1/jobs/{job['id']}"), 404, "not_found")
    assert client.get("/v1/jobs").json()["data"] == []


def test_fields_before_the_file_are_checked_before_a_byte_is_stored(client, settings):
    app = client.app
    big = b"RIFF" + bytes(3 * 1024 * 1024)  # would be over the limit, were it read
    body = multipart(big, "a.wav", model="nope")
    answer = post(app, [body[i : i + 4096] for i in range(0, len(body), 4096)])
    assert_error(answer, 422, "unknown_model", "nope")
    assert stored_keys(settings) == []


def test_fields_after_the_file_are_checked_after_and_the_upload_removed(client, settings, clips):
    boundary = MULTIPART.partition("boundary=")[2]
    file = multipart(clips["en_jfk"].bytes, "a.flac")[: -len(f"--{boundary}--\r\n")]
    field = f'--{boundary}\r\nContent-Disposition: form-data; name="task"\r\n\r\nsing\r\n'
    answer = post(client.app, [file + field.encode() + f"--{boundary}--\r\n".encode()])
    assert_error(answer, 422, "invalid_option", "task")
    assert stored_keys(settings) == [] and queued_messages(settings) == []


def test_head_answers_every_get_route_and_405_says_what_is_allowed(client, clips):
    job = submit(client, clips["en_jfk"].bytes).json()
    for path in ("/healthz", "/v1/jobs", f"/v1/jobs/{job['id']}"):
        get, head = client.get(path), client.head(path)
        assert head.status_code == get.status_code == 200 and head.content == b""
        assert head.headers["content-type"] == get.headers["content-type"]
    assert client.head("/v1/jobs/nope").status_code == 404
    answer = client.put(f"/v1/jobs/{job['id']}")
    assert_error(answer, 405, "method_not_allowed")
    assert set(answer.headers["allow"].split(", ")) == {"GET", "HEAD", "DELETE"}
    paths = client.get("/openapi.json").json()["paths"]
    assert "head" in paths["/v1/jobs/{job_id}"] and "delete" in paths["/v1/jobs/{job_id}"]


def test_cors_is_off_unless_origins_are_configured(settings):
    origin = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
    with TestClient(create_app(settings)) as c:
        assert "access-control-allow-origin" not in c.options("/v1/jobs", headers=origin).headers
    allowed = settings.model_copy(update={"cors_origins": ["https://app.example"]})
    with TestClient(create_app(allowed)) as c:
        answer = c.options("/v1/jobs", headers=origin)
        assert answer.headers["access-control-allow-origin"] == "https://app.example"
        other = c.options("/v1/jobs", headers={**origin, "Origin": "https://evil.example"})
        assert "access-control-allow-origin" not in other.headers


def test_download_urls_are_refused_when_no_public_address_is_set(client, settings, clips):
    job = submit(client, clips["en_jfk"].bytes).json()
    store = JobStore(redis.Redis.from_url(settings.redis_url))
    store.transition(job["id"], JobStatus.succeeded)
    answer = client.get(f"/v1/jobs/{job['id']}/result", params={"download": "url"})
    assert_error(answer, 409, "download_unavailable", "WHISPERFLEET_S3_PUBLIC_ENDPOINT_URL")
    assert "127.0.0.1" not in answer.text


def test_the_keys_of_the_embedded_storage_are_refused_for_any_other():
    with pytest.raises(ValidationError, match="default keys"):
        Settings(s3_endpoint_url="http://storage:9000")
    Settings(s3_endpoint_url="http://storage:9000", s3_access_key_id="a", s3_secret_access_key="b")
    Settings(s3_endpoint_url="http://127.0.0.1:9000")  # the embedded one


def test_open_access_is_only_where_configured(settings, clips):
    keyed = settings.model_copy(update={"auth": "keys"})
    with TestClient(create_app(keyed)) as c:
        assert_error(c.get("/v1/jobs"), 401, "unauthorized")
        assert_error(submit(c, clips["en_jfk"].bytes), 401, "unauthorized")
        assert stored_keys(settings) == []
    assert Settings().auth == "keys"


class _Refs(HTMLParser):
    """Every URL an HTML page makes the browser load or link: src, href, ReDoc's spec-url."""

    def __init__(self):
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.urls += [v for k, v in attrs if k in ("src", "href", "spec-url") and v]


def _references(html: str) -> list[str]:
    parser = _Refs()
    parser.feed(html)
    # Swagger UI's document and OAuth2 redirect are set in its inline script
    return parser.urls + re.findall(r"""(?:url|oauth2RedirectUrl): [^'"]*['"]([^'"]+)['"]""", html)


ASSET_TYPES = {".js": ("text/javascript", "application/javascript"), ".css": ("text/css",)}
ASSET_TYPES[".png"] = ("image/png",)
ASSET_MIN_BYTES = {".js": 100_000, ".css": 10_000, ".png": 500}


@pytest.mark.parametrize("root_path", ["", "/wf"])
@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_the_docs_pages_load_every_asset_from_the_server_not_a_cdn(settings, page, root_path):
    with TestClient(create_app(settings), root_path=root_path) as c:
        answer = c.get(root_path + page)  # as an ASGI server puts it, the prefix included
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/html")
        assert not re.search(r"(?i)\bhttps?:|//[a-z0-9.-]+\.[a-z]{2,}/", answer.text)
        urls = _references(answer.text)
        assets = [u for u in urls if u.startswith(f"{root_path}/docs/assets/")]
        kinds = {u.rpartition(".")[2] for u in assets}
        assert kinds == ({"js", "css", "png"} if page == "/docs" else {"js", "png"}), urls
        assert f"{root_path}/openapi.json" in urls
        for url in urls:
            assert url.startswith(f"{root_path}/") and not url.startswith("//"), url
            if url.endswith("oauth2-redirect"):
                continue  # a page Swagger UI opens only for an OAuth2 flow; checked below
            got = c.get(url)
            assert got.status_code == 200, (url, got.status_code)
            ext = url[url.rfind(".") :]
            if ext in ASSET_TYPES:
                assert got.headers["content-type"].startswith(ASSET_TYPES[ext]), url
                assert len(got.content) >= ASSET_MIN_BYTES[ext], (url, len(got.content))
                assert c.head(url).status_code == 200
        assert c.get(f"{root_path}/docs/oauth2-redirect").status_code == 200


def _asgi_status(app, path: str) -> int:
    """The status of GET `path`, the path reaching the app exactly as given (an HTTP client
    removes `..` segments before sending; curl --path-as-is does not)."""
    statuses, sent, done = [], [], asyncio.Event()  # an Event binds to the loop that waits

    async def receive():
        # the request, then (as a server does) a disconnect once the response has ended: a
        # FileResponse listens for one while it sends, and a second request would spin it
        if not sent:
            sent.append(None)
            return {"type": "http.request", "body": b"", "more_body": False}
        while not done.is_set():
            await asyncio.sleep(0.01)
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            statuses.append(message["status"])
        elif message["type"] == "http.response.body" and not message.get("more_body"):
            done.set()

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"api")],
        "client": ("127.0.0.1", 1),
        "server": ("api", 80),
    }
    asyncio.run(app(scope, receive, send))
    return statuses[0]


def test_the_docs_assets_serve_nothing_outside_their_folder(client):
    # the assets are the wheel's static/ folder; its module sits one level up
    assert (files("fastapi_offline") / "static" / "swagger-ui.css").is_file()
    assert (files("fastapi_offline") / "core.py").is_file()
    encoded = [
        "/docs/assets/..%2Fcore.py",
        "/docs/assets/%2e%2e/core.py",
        "/docs/assets/%2E%2E%2Fcore.py",
        "/docs/assets/..%5Ccore.py",
        "/docs/assets/%2Fetc%2Fpasswd",
        "/docs/assets/" + "..%2F" * 12 + "etc%2Fpasswd",
        "/docs/assets/",
    ]
    for path in encoded:
        answer = client.get(path)
        assert answer.status_code == 404, (path, answer.status_code)
        assert answer.json()["error"]["code"] == "not_found"
    for path in ("/docs/assets/../core.py", "/docs/assets/" + "../" * 12 + "etc/passwd"):
        assert _asgi_status(client.app, path) == 404, path
    assert _asgi_status(client.app, "/docs/assets/x/../swagger-ui.css") == 200  # it reaches
    assert client.post("/docs/assets/swagger-ui.css").status_code == 405


def test_the_docs_pages_and_assets_stay_open_where_keys_are_required(settings):
    keyed = settings.model_copy(update={"auth": "keys"})
    with TestClient(create_app(keyed)) as c:
        assert_error(c.get("/v1/jobs"), 401, "unauthorized")
        for path in ("/docs", "/redoc", "/openapi.json", "/docs/assets/swagger-ui-bundle.js"):
            assert c.get(path).status_code == 200, path  # as /docs and /openapi.json were
        paths = c.get("/openapi.json").json()["paths"]
        assert not [p for p in paths if p.startswith(("/docs", "/redoc"))]
