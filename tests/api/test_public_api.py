"""The public API with keys, against the real stack: the API and a worker as processes (tiny.en
on the CPU), the real Redis (db 12), moto's S3 server. Two tenants, each with its own key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import redis

from tests import conftest
from tests.conftest import free_port, long_speech, stop, wait_for_port
from tests.worker.test_webhooks import Receiver
from tools.wer import word_error_rate
from worker.contract.settings import Settings
from worker.contract.tenants import Tenants
from worker.storage import Storage
from worker.webhooks.delivery import verify

pytestmark = pytest.mark.slow
REDIS_URL = f"{conftest.REDIS_URL}/12"
TERMINAL = {"succeeded", "failed", "cancelled"}


@pytest.fixture(scope="module")
def stack(s3_endpoint, tmp_path_factory, clips):
    client = redis.Redis.from_url(REDIS_URL)
    client.flushdb()
    bucket = f"pub-{uuid.uuid4().hex[:12]}"
    env = {
        "WHISPERFLEET_REDIS_URL": REDIS_URL,
        "WHISPERFLEET_S3_ENDPOINT_URL": s3_endpoint,
        "WHISPERFLEET_S3_BUCKET": bucket,
        # moto on loopback stands for the storage's public address
        "WHISPERFLEET_S3_PUBLIC_ENDPOINT_URL": s3_endpoint,
        "WHISPERFLEET_MAX_UPLOAD_BYTES": str(16 * 1024 * 1024),
        "WHISPERFLEET_MAX_AUDIO_S": "600",
        "WHISPERFLEET_DEVICE": "cpu",
        "WHISPERFLEET_MODELS": "tiny.en",
        "WHISPERFLEET_METRICS_PORT": "0",
        "WHISPERFLEET_AUTH": "keys",
        "WHISPERFLEET_WEBHOOK_ALLOW_NETWORKS": "127.0.0.0/8",  # the test's receiver only
    }
    settings = Settings(**{k.removeprefix("WHISPERFLEET_").lower(): v for k, v in env.items()})
    storage = Storage(settings)
    storage.ensure_bucket()
    sources = f"src-{uuid.uuid4().hex[:12]}"
    storage.client.create_bucket(Bucket=sources)
    for tenant in ("acme", "beta"):
        storage.client.put_object(
            Bucket=sources, Key=f"{tenant}/jfk.flac", Body=clips["en_jfk"].bytes
        )
    storage.client.put_object(Bucket=sources, Key="acme/notes.txt", Body=b"not audio at all")
    tenants = Tenants(client, settings)
    keys = {name: tenants.create_key(name)[0] for name in ("acme", "beta")}
    for name in keys:
        tenants.update(name, sources=[f"s3://{sources}/{name}/"])

    logs = tmp_path_factory.mktemp("public-api")
    port = free_port()
    cli = [sys.executable, "-m", "worker.cli"]
    full = {**os.environ, **env}
    with (
        open(logs / "worker.log", "w") as wlog,
        open(logs / "api.log", "w") as alog,
        open(logs / "webhooks.log", "w") as hlog,
    ):
        worker = subprocess.Popen(
            [*cli, "worker", "--concurrency", "4"], env=full, stdout=wlog, stderr=wlog
        )
        api = subprocess.Popen(
            [*cli, "api", "--port", str(port)], env=full, stdout=alog, stderr=alog
        )
        hooks = subprocess.Popen(
            [*cli, "webhooks", "--backoff", "0.3"], env=full, stdout=hlog, stderr=hlog
        )
    try:
        wait_for_port(port, api)
        yield Stack(f"http://127.0.0.1:{port}", keys, tenants, storage, sources, client, logs)
    finally:
        stop(api)
        stop(worker)
        stop(hooks)
        for name in ("api.log", "worker.log", "webhooks.log"):
            sys.stderr.write(f"--- {name} (tail)\n{(logs / name).read_text()[-3000:]}\n")


class Stack:
    def __init__(self, url, keys, tenants, storage, sources, redis_client, logs):
        self.url, self.keys, self.tenants, self.logs = url, keys, tenants, logs
        self.storage, self.sources, self.redis = storage, sources, redis_client

    def client(self, tenant: str | None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.keys[tenant]}"} if tenant else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)

    def keys_under(self, prefix: str) -> list[str]:
        return [k for page in self.storage.pages(prefix) for k in page]


def submit(http: httpx.Client, data: bytes, headers=None, **fields) -> httpx.Response:
    return http.post("/v1/jobs", files={"file": ("clip.flac", data)}, data=fields, headers=headers)


def wait(http: httpx.Client, job_id: str, timeout: float = 120) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = http.get(f"/v1/jobs/{job_id}").json()
        if job["status"] in TERMINAL:
            return job
        time.sleep(0.2)
    raise TimeoutError(f"job {job_id} is still {job['status']}")


def error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_keys_are_required_and_a_revoked_key_stops_at_once(stack, clips):
    anonymous = stack.client(None)
    answer = anonymous.get("/v1/jobs")
    assert error(answer, 401)["code"] == "unauthorized"
    assert answer.headers["www-authenticate"] == "Bearer"
    wrong = httpx.get(f"{stack.url}/v1/jobs", headers={"Authorization": "Bearer wf_nope_nope"})
    assert error(wrong, 401)["code"] == "invalid_key"
    assert error(submit(anonymous, clips["en_jfk"].bytes), 401)["code"] == "unauthorized"

    key, record = stack.tenants.create_key("acme", "short-lived")
    http = httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {key}"})
    assert http.get("/v1/jobs").status_code == 200
    assert stack.tenants.revoke(record.id)
    assert error(http.get("/v1/jobs"), 401)["code"] == "invalid_key"


def test_the_cli_makes_lists_and_revokes_keys_stored_only_hashed(stack):
    env = {**os.environ, "WHISPERFLEET_REDIS_URL": REDIS_URL}
    cli = [sys.executable, "-m", "worker.cli", "keys"]
    made = subprocess.run([*cli, "create", "--tenant", "gamma", "--name", "ci"], env=env,
                          capture_output=True, text=True, check=True)  # fmt: skip
    key = made.stdout.strip()
    assert key.startswith("wf_") and "shown this once" in made.stderr
    records = stack.redis.scan_iter(match="whisperfleet:apikey:*")
    stored = [stack.redis.get(k) or b"" for k in records]
    stored += list(stack.redis.hgetall("whisperfleet:apikeys").values())
    assert stored and not any(key.encode() in value for value in stored)
    assert httpx.get(f"{stack.url}/v1/jobs", headers={"Authorization": f"Bearer {key}"}).is_success

    listed = subprocess.run([*cli, "list", "--tenant", "gamma"], env=env, capture_output=True,
                            text=True, check=True).stdout  # fmt: skip
    key_id = key.split("_")[1]
    assert key_id in listed and "gamma" in listed and key not in listed
    subprocess.run([*cli, "revoke", key_id], env=env, check=True, capture_output=True)
    assert (
        httpx.get(f"{stack.url}/v1/jobs", headers={"Authorization": f"Bearer {key}"}).status_code
        == 401
    )
    bad = subprocess.run(
        [*cli, "create", "--tenant", "Not A Name"], env=env, capture_output=True, text=True
    )
    assert bad.returncode == 2 and "tenant" in bad.stderr


def test_a_tenant_sees_only_its_own_jobs(stack, clips):
    acme, beta = stack.client("acme"), stack.client("beta")
    answer = submit(acme, clips["en_jfk"].bytes)
    assert answer.status_code == 202, answer.text
    job = wait(acme, answer.json()["id"])
    assert job["status"] == "succeeded", job
    unknown = uuid.uuid4().hex
    for path in ("/v1/jobs/{}", "/v1/jobs/{}/result"):
        theirs, nobody = beta.get(path.format(job["id"])), beta.get(path.format(unknown))
        assert error(theirs, 404) == {"code": "not_found", "message": f"no job {job['id']}"}
        assert error(nobody, 404)["message"] == f"no job {unknown}"
    assert error(beta.delete(f"/v1/jobs/{job['id']}"), 404)["code"] == "not_found"
    assert job["id"] not in [j["id"] for j in beta.get("/v1/jobs?limit=100").json()["data"]]
    assert job["id"] in [j["id"] for j in acme.get("/v1/jobs?limit=100").json()["data"]]
    assert acme.get(f"/v1/jobs/{job['id']}/result").json()["text"]  # still there for acme


def test_parallel_retries_with_one_idempotency_key_make_one_job(stack, clips):
    acme = stack.client("acme")
    before = len(stack.keys_under("jobs/acme/"))
    headers = {"Idempotency-Key": f"upload-{uuid.uuid4()}"}
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: submit(acme, clips["en_jfk"].bytes, headers), range(6)))
    assert all(a.status_code == 202 for a in answers), [a.text for a in answers]
    assert len({a.json()["id"] for a in answers}) == 1
    job = wait(acme, answers[0].json()["id"])
    assert job["status"] == "succeeded" and job["attempts"] == 1
    assert len(stack.keys_under("jobs/acme/")) == before + 2  # one input, one result

    again = submit(acme, clips["en_jfk"].bytes, headers)
    assert again.status_code == 202 and again.json()["id"] == job["id"]
    other = submit(acme, clips["en_librispeech_1272-128104-0000"].bytes, headers)
    assert error(other, 409)["code"] == "idempotency_conflict"
    options = submit(acme, clips["en_jfk"].bytes, headers, prompt="Kennedy")
    assert error(options, 409)["code"] == "idempotency_conflict"
    # the same key is another tenant's own
    beta = submit(stack.client("beta"), clips["en_jfk"].bytes, headers)
    assert beta.status_code == 202 and beta.json()["id"] != job["id"]
    assert len(stack.keys_under("jobs/acme/")) == before + 2


def test_an_idempotency_key_after_a_refusal_is_free_again(stack, clips):
    acme = stack.client("acme")
    headers = {"Idempotency-Key": f"refused-{uuid.uuid4()}"}
    assert error(submit(acme, b"not audio", headers), 422)["code"] == "invalid_audio"
    assert submit(acme, clips["en_jfk"].bytes, headers).status_code == 202


def test_jobs_from_storage_references(stack, clips):
    acme = stack.client("acme")
    source = f"s3://{stack.sources}/acme/jfk.flac"
    answer = acme.post("/v1/jobs", json={"source": source, "prompt": "Kennedy"})
    assert answer.status_code == 202, answer.text
    job = wait(acme, answer.json()["id"])
    assert job["status"] == "succeeded" and job["source"] == source
    assert job["input"]["format"] == "flac" and job["input"]["filename"] == "jfk.flac"
    text = acme.get(f"/v1/jobs/{job['id']}/result").json()["text"]
    assert word_error_rate([clips["en_jfk"].reference], [text]) <= 0.15
    assert stack.keys_under(f"jobs/acme/{job['id']}/") == [f"jobs/acme/{job['id']}/result.json"]

    refused = {
        f"s3://{stack.sources}/beta/jfk.flac": (403, "source_not_allowed"),
        f"s3://{stack.sources}/acme/missing.flac": (422, "source_not_found"),
        f"s3://{stack.sources}/acme/notes.txt": (422, "invalid_audio"),
        f"s3://{stack.sources}/acme/../beta/jfk.flac": (422, "invalid_source"),
        f"s3://{stack.sources}/acmeX/jfk.flac": (403, "source_not_allowed"),
        f"http://{stack.sources}/acme/jfk.flac": (422, "invalid_source"),
        "file:///etc/passwd": (422, "invalid_source"),
        f"s3://{stack.storage.bucket}/jobs/beta/x/input": (403, "source_not_allowed"),
    }
    for uri, (status, code) in refused.items():
        assert error(acme.post("/v1/jobs", json={"source": uri}), status)["code"] == code, uri
    assert error(acme.post("/v1/jobs", json={"source": 7}), 422)["code"] == "invalid_source"
    bad_option = acme.post("/v1/jobs", json={"source": source, "task": "sing"})
    assert error(bad_option, 422)["code"] == "invalid_option"

    # deleting the job never deletes the tenant's own object
    assert acme.delete(f"/v1/jobs/{job['id']}").status_code == 204
    assert stack.storage.head("acme/jfk.flac", stack.sources)[0] == len(clips["en_jfk"].bytes)


def test_the_list_pages_by_cursor_while_jobs_are_added(stack, clips):
    key, _ = stack.tenants.create_key("lister")
    http = httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {key}"})
    first = [submit(http, clips["en_jfk"].bytes).json()["id"] for _ in range(5)]
    seen, cursor = [], None
    while True:
        params = {"limit": 2, **({"cursor": cursor} if cursor else {})}
        page = http.get("/v1/jobs", params=params).json()
        seen += [j["id"] for j in page["data"]]
        if len(seen) == 2:  # jobs added mid-way come before the cursor: not in later pages
            submit(http, clips["en_jfk"].bytes)
            submit(http, clips["en_jfk"].bytes)
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == first[::-1]

    everything = http.get("/v1/jobs", params={"limit": 100}).json()["data"]
    assert len(everything) == 7
    for job in everything:
        wait(http, job["id"])
    done = http.get("/v1/jobs", params={"status": "succeeded", "limit": 100}).json()
    assert len(done["data"]) == 7 and done["next_cursor"] is None
    assert http.get("/v1/jobs", params={"status": "queued"}).json()["data"] == []
    third = everything[-3]["created_at"]
    after = http.get("/v1/jobs", params={"created_after": third, "limit": 100}).json()["data"]
    assert [j["id"] for j in after] == [j["id"] for j in everything[:-3]]
    for bad in ({"limit": 0}, {"limit": 101}, {"cursor": "x"}, {"status": "lost"}):
        assert error(http.get("/v1/jobs", params=bad), 422)["code"] == "invalid_request"


def test_every_result_format_and_a_presigned_url(stack, clips):
    acme = stack.client("acme")
    job = wait(acme, submit(acme, clips["en_jfk"].bytes).json()["id"])
    result = f"/v1/jobs/{job['id']}/result"
    stored = acme.get(result).json()
    kinds = {
        "json": "application/json",
        "verbose_json": "application/json",
        "text": "text/plain",
        "srt": "application/x-subrip",
        "vtt": "text/vtt",
    }
    for format, kind in kinds.items():
        answer = acme.get(result, params={"format": format})
        assert answer.status_code == 200 and answer.headers["content-type"].startswith(kind)
        assert stored["segments"][0]["text"].strip() in answer.text
    head = acme.head(result, params={"format": "srt"})
    assert head.status_code == 200 and head.content == b""

    link = acme.get(result, params={"download": "url"}).json()
    assert link["url"].startswith(stack.storage.settings.s3_public_endpoint_url)
    assert httpx.get(link["url"]).json() == stored
    other = acme.get(result, params={"download": "url", "format": "srt"})
    assert error(other, 422)["code"] == "invalid_request"


def test_a_failed_jobs_result_says_it_failed(stack, clips):
    acme = stack.client("acme")
    good = clips["en_jfk"].bytes
    answer = submit(acme, good[: len(good) // 3])  # passes the door; the decoder finds it cut
    assert answer.status_code == 202, answer.text
    job = wait(acme, answer.json()["id"])
    assert job["status"] == "failed"
    refusal = error(acme.get(f"/v1/jobs/{job['id']}/result"), 409)
    assert refusal["code"] == "job_failed" and job["error"]["message"] in refusal["message"]


def test_deleting_a_finished_job_deletes_its_objects_and_record(stack, clips):
    acme = stack.client("acme")
    job = wait(acme, submit(acme, clips["en_jfk"].bytes).json()["id"])
    assert len(stack.keys_under(f"jobs/acme/{job['id']}/")) == 2
    assert acme.delete(f"/v1/jobs/{job['id']}").status_code == 204
    assert stack.keys_under(f"jobs/acme/{job['id']}/") == []
    assert error(acme.get(f"/v1/jobs/{job['id']}"), 404)["code"] == "not_found"
    assert error(acme.delete(f"/v1/jobs/{job['id']}"), 404)["code"] == "not_found"
    assert job["id"] not in [j["id"] for j in acme.get("/v1/jobs?limit=100").json()["data"]]


def test_rate_limits_answer_429_with_retry_after(stack, clips):
    key, _ = stack.tenants.create_key("limited")
    stack.tenants.update("limited", jobs_per_minute=2)
    http = httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {key}"})
    answers = [submit(http, clips["en_jfk"].bytes) for _ in range(3)]
    assert [a.status_code for a in answers[:2]] == [202, 202]
    assert error(answers[2], 429)["code"] == "rate_limited"
    assert 0 < int(answers[2].headers["retry-after"]) <= 60

    key, _ = stack.tenants.create_key("narrow")
    stack.tenants.update("narrow", jobs_in_flight=1)
    http = httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {key}"})
    first = submit(http, clips["en_jfk"].bytes)
    second = submit(http, clips["en_jfk"].bytes)
    assert first.status_code == 202
    assert error(second, 429)["code"] == "too_many_jobs" and second.headers["retry-after"]
    wait(http, first.json()["id"])
    assert submit(http, clips["en_jfk"].bytes).status_code == 202
    assert json.loads(stack.redis.get("whisperfleet:tenant:narrow"))["jobs_in_flight"] == 1


def test_webhooks_are_signed_with_their_tenants_secret_and_retried(stack, clips):
    receiver = Receiver()
    receiver.script["/acme"] = [500, 200]  # the first attempt fails
    try:
        acme, beta = stack.client("acme"), stack.client("beta")
        done = submit(acme, clips["en_jfk"].bytes, webhook=receiver.url("/acme")).json()
        queued = submit(beta, clips["en_jfk"].bytes, webhook=receiver.url("/beta")).json()
        # cancelled while still queued (posted `cancelled`), or deleted if it was done already
        deleted = beta.delete(f"/v1/jobs/{queued['id']}").status_code
        assert deleted in (200, 204)
        posts = receiver.wait("/acme", 2, timeout=120)
        assert len(posts) == 2, posts
        job = acme.get(f"/v1/jobs/{done['id']}").json()
        assert json.loads(posts[1]["body"]) == job and job["status"] == "succeeded"
        ids = [p["headers"]["Whisperfleet-Webhook-Id"] for p in posts]
        events = {p["headers"]["Whisperfleet-Event-Id"] for p in posts}
        assert ids[0] != ids[1] and events == {f"{job['id']}.succeeded"}
        secrets = {t: stack.tenants.get(t).webhook_secret for t in ("acme", "beta")}
        assert verify(secrets["acme"], posts[1]["headers"], posts[1]["body"])
        assert not verify(secrets["beta"], posts[1]["headers"], posts[1]["body"])

        (theirs,) = receiver.wait("/beta", 1)
        status = "cancelled" if deleted == 200 else "succeeded"
        assert json.loads(theirs["body"])["status"] == status
        assert json.loads(theirs["body"])["id"] == queued["id"]
        assert verify(secrets["beta"], theirs["headers"], theirs["body"])
        assert not verify(secrets["acme"], theirs["headers"], theirs["body"])
        private = submit(acme, clips["en_jfk"].bytes, webhook="http://10.1.2.3/hook")
        assert error(private, 422)["code"] == "invalid_webhook"
        link_local = submit(acme, clips["en_jfk"].bytes, webhook="http://169.254.169.254/")
        assert error(link_local, 422)["code"] == "invalid_webhook"
    finally:
        receiver.close()


def test_a_running_job_deleted_over_http_stops_and_leaves_nothing(stack, clips):
    acme = stack.client("acme")
    job = submit(acme, long_speech(440)).json()
    deadline = time.monotonic() + 60
    while acme.get(f"/v1/jobs/{job['id']}").json()["status"] != "running":
        assert time.monotonic() < deadline, "the long job never started"
        time.sleep(0.1)
    answer = acme.delete(f"/v1/jobs/{job['id']}")
    assert answer.status_code == 200 and answer.json()["status"] == "cancelled"
    stopped = f"job {job['id']} cancelled while running"
    deadline = time.monotonic() + 10
    while stopped not in (stack.logs / "worker.log").read_text():
        assert time.monotonic() < deadline, "the worker did not stop the job"
        time.sleep(0.1)
    # nothing of it stays, and the worker goes on
    quick = wait(acme, submit(acme, clips["en_jfk"].bytes).json()["id"], timeout=60)
    assert quick["status"] == "succeeded"
    for _ in range(20):
        assert stack.keys_under(f"jobs/acme/{job['id']}/") == []
        time.sleep(0.2)
    record = acme.get(f"/v1/jobs/{job['id']}").json()
    assert record["status"] == "cancelled" and record["error"]["code"] == "cancelled"
    assert error(acme.get(f"/v1/jobs/{job['id']}/result"), 409)["code"] == "job_cancelled"
