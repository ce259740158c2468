"""The API v1 door in-process (real Redis, a real S3 endpoint, no worker): cancelling a queued
job, form fields in either order, HEAD and 405, CORS, download URLs unset, storage secrets."""

from __future__ import annotations

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
