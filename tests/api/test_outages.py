"""Redis or storage out of reach: every route answers 503 `unavailable` in JSON with
`Retry-After`, and nothing is left in storage; anything unforeseen is a JSON 500 `internal`."""

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import redis
from fastapi.testclient import TestClient

from api.main import create_app
from tests.api import wire
from tests.api.test_jobs_api import assert_error, queued_messages, stored_keys, submit
from tests.conftest import free_port
from tests.faults.fleet import RedisServer, StorageServer
from worker.app import create_app as create_celery
from worker.contract.jobs import JobInput, JobRecord, JobStatus, JobStore, new_job_id
from worker.jobs.orphans import OrphanSweeper
from worker.storage import Storage


def assert_unavailable(response, what: str) -> None:
    assert_error(response, 503, "unavailable", what, "try again")
    assert response.headers["Retry-After"] == "5"
    assert "127.0.0.1" not in response.text and "Error" not in response.text


def succeeded_job(settings) -> JobRecord:
    """A succeeded job's record in the real Redis (its result is not stored)."""
    record = JobRecord(
        id=new_job_id(), model="tiny.en", input=JobInput(kind="audio", bytes=1, format="flac")
    )
    store = JobStore(redis.Redis.from_url(settings.redis_url))
    store.create(record)
    return store.transition(record.id, JobStatus.succeeded)


@pytest.fixture
def no_redis(settings):
    """The settings with Redis on a port where nothing listens."""
    return settings.model_copy(update={"redis_url": f"redis://127.0.0.1:{free_port()}/0"})


@pytest.fixture
def no_storage(settings):
    """The settings with storage on a port where nothing listens."""
    return settings.model_copy(update={"s3_endpoint_url": f"http://127.0.0.1:{free_port()}"})


@pytest.mark.parametrize(
    "method, path", [("get", "/v1/jobs/{id}"), ("get", "/v1/jobs/{id}/result")]
)
def test_reads_without_redis_are_unavailable(no_redis, method, path):
    with TestClient(create_app(no_redis)) as c:
        response = c.request(method, path.format(id=new_job_id()))
    assert_unavailable(response, "the job store")


def test_a_submission_without_redis_is_unavailable_and_stores_nothing(settings, no_redis, clips):
    with TestClient(create_app(no_redis)) as c:
        assert_unavailable(submit(c, clips["en_jfk"].bytes), "the job store")
    assert stored_keys(settings) == []


def test_a_submission_without_storage_is_unavailable(no_storage, clips):
    with TestClient(create_app(no_storage)) as c:
        assert_unavailable(submit(c, clips["en_jfk"].bytes), "object storage")


def test_a_result_without_storage_is_unavailable(no_storage):
    job = succeeded_job(no_storage)
    with TestClient(create_app(no_storage)) as c:
        assert_unavailable(c.get(f"/v1/jobs/{job.id}/result"), "object storage")


class _Overloaded(BaseHTTPRequestHandler):
    """An S3 endpoint that answers every request 503 SlowDown, as S3 does when overloaded."""

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("content-length") or 0))
        body = b"<Error><Code>SlowDown</Code><Message>Reduce your request rate</Message></Error>"
        self.send_response(503)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_PUT = do_HEAD = do_POST = do_DELETE = _answer

    def log_message(self, *args) -> None:
        pass


def test_storage_answering_5xx_is_unavailable(settings):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Overloaded)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    overloaded = settings.model_copy(
        update={"s3_endpoint_url": f"http://127.0.0.1:{server.server_address[1]}"}
    )
    job = succeeded_job(overloaded)
    try:
        with TestClient(create_app(overloaded)) as c:
            assert_unavailable(c.get(f"/v1/jobs/{job.id}/result"), "object storage")
    finally:
        server.shutdown()


@pytest.mark.parametrize("query", ["", "?format=text", "?format=srt", "?download=url"])
def test_a_succeeded_job_whose_result_storage_lost_is_gone(settings, query):
    """Storage answered that the result is not there (deleted, or a storage that lost what it
    held, as the local stack's in-memory one did at each restart): 410, never a 500."""
    settings = settings.model_copy(update={"s3_public_endpoint_url": settings.s3_endpoint_url})
    job = succeeded_job(settings)
    with TestClient(create_app(settings)) as c:
        answer = c.get(f"/v1/jobs/{job.id}/result{query}")
    assert_error(answer, 410, "result_gone", "no longer in storage", "submit the job again")


def test_readiness_says_which_dependency_is_away_and_no_more(no_redis, no_storage):
    broken = no_redis.model_copy(update={"s3_endpoint_url": no_storage.s3_endpoint_url})
    with TestClient(create_app(broken)) as c:
        response = c.get("/readyz")
    assert response.status_code == 503
    assert response.json() == {
        "status": "unavailable",
        "checks": {"redis": "unavailable", "storage": "unavailable", "workers": "unavailable"},
    }


def test_an_unforeseen_failure_is_a_logged_json_500(settings, caplog):
    """A stored result that does not parse (written by hand, or a bug): `internal`, with the
    traceback in the log and none of it in the answer."""
    job = succeeded_job(settings)
    with TestClient(create_app(settings)) as c, caplog.at_level(logging.ERROR, "api.errors"):
        Storage(settings).put_once(job.result_key, b'{"text": 1}', "application/json")
        response = c.get(f"/v1/jobs/{job.id}/result")
    assert_error(response, 500, "internal", "the failure is logged")
    assert "ValidationError" not in response.text and "'text'" not in response.text
    (entry,) = [r for r in caplog.records if r.name == "api.errors"]
    assert f"GET /v1/jobs/{job.id}/result failed" in entry.getMessage()
    assert entry.exc_info[0].__name__ == "ValidationError"


def test_redis_lost_mid_upload_leaves_nothing_stored(settings, tmp_path, clips):
    """Redis answers when the request starts and is killed while the body streams in: the
    record cannot be written, so the stored input is deleted."""
    server = RedisServer(tmp_path)
    server.start()
    app = create_app(settings.model_copy(update={"redis_url": server.url}))
    body = wire.multipart(clips["en_jfk"].bytes, "jfk.flac", model="tiny.en")

    def chunks():
        yield body[:1000]
        server.close()  # kill -9
        yield body[1000:]

    with TestClient(app):
        response = wire.post(app, chunks())
    assert_unavailable(response, "the job store")
    assert stored_keys(settings) == []


def test_a_job_the_queue_cannot_take_leaves_no_record_and_no_input(settings, clips):
    """The record is written but the message cannot be published: both are withdrawn, so the
    503 means the job will never run."""
    app = create_app(settings)
    with TestClient(app) as c:
        dead = settings.model_copy(update={"redis_url": f"redis://127.0.0.1:{free_port()}/0"})
        app.state.celery = create_celery(dead)
        assert_unavailable(submit(c, clips["en_jfk"].bytes), "the job queue")
    r = redis.Redis.from_url(settings.redis_url)
    assert r.keys("whisperfleet:job:*") == [] and r.zcard("whisperfleet:active") == 0
    assert stored_keys(settings) == [] and not queued_messages(settings)


@pytest.fixture
def storage_server():
    """A moto server of this test's own, which the test may freeze (SIGSTOP)."""
    server = StorageServer()
    yield server
    server.close()


def test_storage_frozen_mid_submission_leaves_nothing_once_swept(settings, storage_server, clips):
    """Storage stops answering as the input is written: 503 within the storage timeout, and
    no record. The put may still land when storage wakes, after the API's delete gave up:
    the sweeper removes it."""
    settings = settings.model_copy(
        update={"s3_endpoint_url": storage_server.url, "s3_timeout_s": 0.5}
    )
    app = create_app(settings)
    with TestClient(app) as c:
        storage_server.freeze()
        try:
            response = submit(c, clips["en_jfk"].bytes)
        finally:
            storage_server.thaw()
    assert_unavailable(response, "object storage")
    store = JobStore(redis.Redis.from_url(settings.redis_url))
    assert store.redis.keys("whisperfleet:job:*") == []
    sweeper = OrphanSweeper(Storage(settings), store, every_s=0, record_lifetime_s=3600)
    sweeper.sweep()
    sweeper.sweep()
    assert stored_keys(settings) == []
