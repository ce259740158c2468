"""Webhooks (worker.webhooks.delivery): the address check (private, loopback, link-local and
their IPv6 forms refused; DNS rebinding caught at delivery; the connection pinned to the address
checked), the signature, one attempt against a real loopback receiver, and the real
`whisperfleet webhooks` process: a signed post verified by the receiver, a retry after a
failure, a private address never posted, attempts bounded. A redis-server of its own (a free
port), so no test database is shared."""

from __future__ import annotations

import json
import os
import socket
import ssl
import subprocess
import sys
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import redis

from tests.conftest import free_port, start_redis, stop
from worker.app import create_app
from worker.contract.jobs import JobInput, JobRecord, JobStatus, JobStore, Progress, new_job_id
from worker.contract.settings import Settings
from worker.contract.tenants import Tenants
from worker.webhooks import delivery as webhooks
from worker.webhooks.delivery import (
    EVENT_HEADER,
    ID_HEADER,
    SIGNATURE_HEADER,
    Outcome,
    Sender,
    WebhookRefused,
    destination,
    notify,
    post,
    sign,
    verify,
)

LOOPBACK = ["127.0.0.0/8"]

# -- fixtures: a Redis and a receiver of our own


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    port = free_port()
    proc = start_redis(port, "--appendonly", "no", "--dir", str(tmp_path_factory.mktemp("redis")))
    yield f"redis://127.0.0.1:{port}/0"
    stop(proc)


class Receiver:
    """A webhook receiver on loopback: records every post; answers each path with the
    statuses scripted for it, in order (then 200)."""

    def __init__(self):
        self.posts: list[dict] = []
        self.script: dict[str, list[int]] = {}
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                data = self.rfile.read(int(self.headers["Content-Length"]))
                receiver.posts.append(
                    {"path": self.path, "headers": dict(self.headers.items()), "body": data}
                )
                statuses = receiver.script.get(self.path) or [200]
                status = statuses.pop(0) if len(statuses) > 1 else statuses[0]
                self.send_response(status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def at(self, path: str) -> list[dict]:
        return [p for p in self.posts if p["path"] == path]

    def wait(self, path: str, count: int, timeout: float = 20.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while len(self.at(path)) < count and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.at(path)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def receiver():
    r = Receiver()
    yield r
    r.close()


def finished(store: JobStore, webhook: str | None, tenant: str = "default") -> JobRecord:
    """A job that ran and succeeded, as a worker leaves it."""
    record = JobRecord(
        id=new_job_id(),
        tenant=tenant,
        model="tiny.en",
        input=JobInput(kind="audio", bytes=1000, format="flac"),
        webhook=webhook,
    )
    store.create(record)
    store.transition(record.id, JobStatus.running, worker="test:1")
    return store.transition(
        record.id, JobStatus.succeeded, progress=Progress(done_s=1.0, total_s=1.0)
    )


def resolver(monkeypatch, names: dict[str, list[str]]) -> list[str]:
    """socket.getaddrinfo answering `names` (each call takes the next address; the last one
    stays), every other host as before; returns the names asked, in order."""
    real, asked = socket.getaddrinfo, []

    def fake(host, port, *args, **kwargs):
        if host not in names:
            return real(host, port, *args, **kwargs)
        asked.append(host)
        answers = names[host]
        address = answers.pop(0) if len(answers) > 1 else answers[0]
        return real(address, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    return asked


# -- addresses


@pytest.mark.parametrize(
    "host",
    [
        "10.0.0.1",
        "172.16.5.4",
        "192.168.1.1",
        "127.0.0.1",
        "169.254.169.254",  # cloud metadata
        "0.0.0.0",
        "100.64.0.1",  # shared (carrier-grade NAT)
        "224.0.0.1",  # multicast
        "240.0.0.1",  # reserved
        "2130706433",  # 127.0.0.1 as one number
        "[::1]",
        "[::]",
        "[fc00::1]",
        "[fd12:3456::1]",
        "[fe80::1]",
        "[fec0::1]",  # site-local
        "[ff02::1]",
        "[::ffff:10.0.0.1]",  # IPv4-mapped
        "[::ffff:127.0.0.1]",
        "[2002:a00:1::1]",  # 6to4 of 10.0.0.1
        "[64:ff9b::a00:1]",  # NAT64 of 10.0.0.1
    ],
)
def test_non_public_addresses_are_refused(host):
    with pytest.raises(WebhookRefused) as refused:
        destination(f"http://{host}:8080/secret-path?x=1", [])
    message = str(refused.value)
    assert repr(host.strip("[]")) in message and "non-public" in message
    assert "8080" not in message and "secret-path" not in message  # the host only


@pytest.mark.parametrize(
    "host", ["8.8.8.8", "1.1.1.1", "[2606:4700:4700::1111]", "[::ffff:8.8.8.8]"]
)
def test_public_addresses_pass(host):
    [address] = destination(f"https://{host}/hook", [])
    assert str(address) in host or address.ipv4_mapped


def test_allowed_networks_let_private_addresses_through():
    assert str(destination("http://127.0.0.1:9/", LOOPBACK)[0]) == "127.0.0.1"
    assert str(destination("http://[::1]:9/", ["::1/128"])[0]) == "::1"
    assert destination("http://[::ffff:127.0.0.1]/", LOOPBACK)  # the same address
    assert destination("http://10.1.2.3/", ["10.0.0.0/8"])
    with pytest.raises(WebhookRefused):
        destination("http://10.255.255.1/hook", LOOPBACK)
    with pytest.raises(WebhookRefused):
        destination("http://[::1]/", LOOPBACK)
    with pytest.raises(ValueError, match="ALLOW_NETWORKS"):
        destination("http://127.0.0.1/", ["not-a-network"])


def test_a_host_is_refused_if_any_of_its_addresses_is_not_public(monkeypatch):
    real = socket.getaddrinfo

    def both(host, port, *args, **kwargs):
        if host == "mixed.example":
            return real("8.8.8.8", port, *args, **kwargs) + real("10.0.0.7", port, *args, **kwargs)
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", both)
    with pytest.raises(WebhookRefused, match="'mixed.example'"):
        destination("https://mixed.example/hook", [])


def test_unresolvable_hosts_and_other_urls_are_refused():
    with pytest.raises(WebhookRefused, match="does not resolve"):
        destination("https://no-such-host.invalid/hook", [])
    for url in ("ftp://8.8.8.8/", "http:///hook", "http://8.8.8.8:99999/", "8.8.8.8"):
        with pytest.raises(WebhookRefused):
            destination(url, [])


def test_dns_rebinding_is_caught_at_delivery(monkeypatch):
    """Public when the API checked it, loopback by the time it is posted: refused then, and
    nothing is connected to."""
    asked = resolver(monkeypatch, {"rebind.example": ["93.184.216.34", "127.0.0.1"]})
    url = "http://rebind.example/hook"
    assert [str(a) for a in destination(url, [])] == ["93.184.216.34"]  # at submission
    connects = []
    monkeypatch.setattr(socket.socket, "connect", lambda *a: connects.append(a))
    with pytest.raises(WebhookRefused, match="'rebind.example'"):
        post(url, b"{}", {}, [], timeout_s=2)
    assert asked == ["rebind.example", "rebind.example"] and connects == []


def test_the_connection_goes_to_the_address_checked(monkeypatch, receiver):
    """Resolved once, checked, connected to: a second answer of the resolver (here a private
    address) is never asked for; the Host header is the URL's."""
    asked = resolver(monkeypatch, {"pinned.example": ["127.0.0.1", "10.0.0.9"]})
    url = receiver.url("/pinned", host="pinned.example")
    assert post(url, b'{"a":1}', {"Content-Type": "application/json"}, LOOPBACK, 5) == 200
    [got] = receiver.at("/pinned")
    assert asked == ["pinned.example"]
    assert got["headers"]["Host"] == f"pinned.example:{receiver.port}" and got["body"] == b'{"a":1}'


def _certificate(folder: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for `name`: (certificate, key) files."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, name)])
    now = datetime.now(UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - timedelta(minutes=1))
        .not_valid_after(now + timedelta(hours=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def test_https_connects_to_the_address_checked_and_verifies_the_urls_name(monkeypatch, tmp_path):
    """TLS to the pinned address, with SNI and certificate checks for the URL's host: a
    certificate for that name passes, the same server reached by another name does not."""
    cert, key = _certificate(tmp_path, "hook.example")
    hosts = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            hosts.append(self.headers["Host"])
            self.send_response(204)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    tls = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    tls.load_cert_chain(cert, key)
    server.socket = tls.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_address[1]
    try:
        with pytest.raises(ssl.SSLCertVerificationError):  # not trusted yet
            post(f"https://127.0.0.1:{port}/h", b"{}", {}, LOOPBACK, 5)
        default_context = ssl.create_default_context

        def trusting(*args, **kwargs):
            context = default_context(*args, **kwargs)
            context.load_verify_locations(cert)
            return context

        monkeypatch.setattr(ssl, "create_default_context", trusting)
        resolver(monkeypatch, {"hook.example": ["127.0.0.1"]})
        assert post(f"https://hook.example:{port}/h", b"{}", {}, LOOPBACK, 5) == 204
        assert hosts == [f"hook.example:{port}"]
        with pytest.raises(ssl.SSLCertVerificationError):  # the name is not the certificate's
            post(f"https://127.0.0.1:{port}/h", b"{}", {}, LOOPBACK, 5)
    finally:
        server.shutdown()
        server.server_close()


def test_a_post_is_bounded_and_follows_no_redirect(receiver):
    receiver.script["/moved"] = [302]
    assert post(receiver.url("/moved"), b"{}", {}, LOOPBACK, 5) == 302
    with socket.socket() as silent:  # accepts, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        started = time.monotonic()
        with pytest.raises(OSError):
            post(f"http://127.0.0.1:{silent.getsockname()[1]}/", b"{}", {}, LOOPBACK, 0.5)
        assert time.monotonic() - started < 3


# -- signatures


def test_a_signature_verifies_and_any_change_breaks_it():
    secret, body, now = "whsec_test", b'{"id":"j1","status":"succeeded"}', 1_700_000_000
    headers = {ID_HEADER: "j1-1", SIGNATURE_HEADER: sign(secret, "j1-1", now, body)}
    assert headers[SIGNATURE_HEADER].startswith(f"t={now},v1=")
    assert verify(secret, headers, body, now=now + 10)
    lower = {k.lower(): v for k, v in headers.items()}
    assert verify(secret, lower, body, now=now)  # header names in any case
    assert not verify(secret, headers, body + b" ", now=now)  # the body
    assert not verify("whsec_other", headers, body, now=now)  # the secret
    assert not verify(secret, {**headers, ID_HEADER: "j1-2"}, body, now=now)  # the attempt
    later = {**headers, SIGNATURE_HEADER: headers[SIGNATURE_HEADER].replace(str(now), str(now + 1))}
    assert not verify(secret, later, body, now=now)  # the timestamp
    assert not verify(secret, headers, body, now=now + 301)  # too old: a replay
    assert not verify(secret, {ID_HEADER: "j1-1"}, body, now=now)
    assert not verify(secret, {**headers, SIGNATURE_HEADER: "garbage"}, body, now=now)
    rotated = {**headers, SIGNATURE_HEADER: f"{headers[SIGNATURE_HEADER]},v1=00ff"}
    assert verify(secret, rotated, body, now=now)  # any one v1 may match


def test_the_payload_is_the_public_record():
    record = JobRecord(
        id="j1",
        tenant="acme",
        model="tiny.en",
        input=JobInput(kind="audio", bytes=1, format="wav"),
        worker="host:1",
        quarantined=True,
        source="s3://bucket/acme/a.wav",
        webhook="https://example.com/hook",
    )
    from api.schemas import JobPublic  # the test only: the sender never imports the API

    sent = json.loads(webhooks.body(record))
    assert sent == JobPublic.from_record(record).model_dump(mode="json")
    assert sent["id"] == "j1" and sent["source"] == "s3://bucket/acme/a.wav"
    assert not {"tenant", "worker", "quarantined", "quarantine_deaths"} & set(sent)


# -- notifying


def test_notify_sends_to_the_webhooks_queue_only_jobs_with_a_webhook():
    app = create_app(Settings(redis_url="memory://"))
    queues = set(app.amqp.queues)
    record = JobRecord(
        id="j1", model="tiny.en", input=JobInput(kind="audio", bytes=1, format="wav")
    )
    assert notify(app, record) is False
    assert notify(app, record.model_copy(update={"webhook": "https://example.com/h"})) is True
    with app.connection() as conn:
        message = conn.SimpleQueue(webhooks.WEBHOOK_QUEUE).get(timeout=2)
        assert message.headers["task"] == webhooks.WEBHOOK_TASK
        assert message.headers["argsrepr"] == "['j1']"
        message.ack()
    assert set(app.amqp.queues) == queues  # the GPU workers' app never consumes `webhooks`


def test_notify_with_the_broker_away_logs_and_goes_on(caplog):
    app = create_app(Settings(redis_url=f"redis://127.0.0.1:{free_port()}/0"))
    app.conf.broker_connection_timeout = 0.2
    app.conf.task_publish_retry_policy = {"max_retries": 0}
    record = JobRecord(
        id="j2",
        model="tiny.en",
        input=JobInput(kind="audio", bytes=1, format="wav"),
        webhook="https://example.com/h",
    )
    assert notify(app, record) is False
    assert "j2: its webhook was not queued" in caplog.text


def test_the_webhooks_module_imports_neither_torch_nor_fastapi():
    code = (
        "import sys, worker.webhooks.delivery; "
        "print(sorted({'torch', 'fastapi'} & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_task_hooks_notify_after_a_terminal_move_only(redis_url, monkeypatch):
    """A GPU worker's hooks: `succeeded` and `failed` notify; a move refused (the job was
    cancelled meanwhile: the API notified then) does not."""
    from worker.jobs import tasks
    from worker.jobs.execute import JobFailed, Stored

    store = JobStore(redis.Redis.from_url(redis_url), prefix=f"t{uuid.uuid4().hex[:8]}")
    sent = []
    monkeypatch.setattr(tasks, "notify", lambda app, r: sent.append((r.id, r.status, app)))
    monkeypatch.setitem(tasks.transcribe.__dict__, "store", store)
    jobs = []
    for _ in range(3):
        record = JobRecord(
            id=new_job_id(),
            model="tiny.en",
            input=JobInput(kind="audio", bytes=1, format="wav"),
            webhook="https://example.com/h",
        )
        store.create(record)
        store.transition(record.id, JobStatus.running)
        jobs.append(record.id)
    store.transition(jobs[2], JobStatus.cancelled)
    tasks.transcribe.push_request(args=[jobs[0]], leased=False)
    try:
        tasks.transcribe.on_success(Stored(duration=1.0), "t", [jobs[0]], {})
        tasks.transcribe.on_failure(JobFailed("invalid_audio", "x"), "t", [jobs[1]], {}, None)
        tasks.transcribe.on_failure(JobFailed("invalid_audio", "x"), "t", [jobs[2]], {}, None)
    finally:
        tasks.transcribe.pop_request()
    assert sent == [
        (jobs[0], JobStatus.succeeded, tasks.app),
        (jobs[1], JobStatus.failed, tasks.app),
    ]


# -- one attempt, in this process


@pytest.fixture
def sender(redis_url):
    settings = Settings(redis_url=redis_url, webhook_allow_networks=LOOPBACK, webhook_timeout_s=5)
    return Sender(settings, redis.Redis.from_url(redis_url), prefix=f"t{uuid.uuid4().hex[:8]}")


def test_an_attempt_id_is_posted_at_most_once(sender, receiver):
    record = finished(sender.store, receiver.url("/once"))
    assert sender.attempt(record.id, 1) is Outcome.delivered
    assert sender.attempt(record.id, 1) is Outcome.delivered  # a redelivery: not posted
    assert sender.attempt(record.id, 2) is Outcome.delivered  # a second notify: not posted
    [got] = receiver.at("/once")
    secret = Tenants(sender.redis, sender.settings, sender.prefix).get("default").webhook_secret
    assert verify(secret, got["headers"], got["body"])
    assert got["headers"][ID_HEADER] == f"{record.id}-1"
    assert got["headers"][EVENT_HEADER] == f"{record.id}.succeeded"


def test_an_attempt_that_died_mid_post_is_not_repeated(sender, receiver):
    """Its process killed after claiming the attempt id: the redelivery posts nothing and
    hands over to the next attempt (Outcome.claimed: the task schedules it)."""
    record = finished(sender.store, receiver.url("/died"))
    sender.redis.set(sender._key("attempt", f"{record.id}-1"), "started")
    assert sender.attempt(record.id, 1) is Outcome.claimed
    assert receiver.at("/died") == []
    assert sender.attempt(record.id, 2) is Outcome.delivered
    assert [p["headers"][ID_HEADER] for p in receiver.at("/died")] == [f"{record.id}-2"]


def test_delivery_checks_the_tenants_own_networks_as_they_are_now(sender, receiver):
    """The fleet allows loopback; a tenant narrowed to public addresses after it submitted
    is refused at delivery, once, and nothing is posted; back on the fleet's list, posted."""
    tenants = Tenants(sender.redis, sender.settings, sender.prefix)
    tenants.update("acme", webhook_networks=[])
    refused = finished(sender.store, receiver.url("/narrowed"), tenant="acme")
    assert sender.attempt(refused.id, 1) is Outcome.refused
    tenants.update("acme", webhook_networks=None)
    posted = finished(sender.store, receiver.url("/narrowed"), tenant="acme")
    assert sender.attempt(posted.id, 1) is Outcome.delivered
    [got] = receiver.at("/narrowed")
    assert got["headers"][ID_HEADER] == f"{posted.id}-1"


def test_nothing_is_posted_for_a_job_not_ended_or_gone(sender, receiver):
    record = JobRecord(
        id=new_job_id(),
        model="tiny.en",
        input=JobInput(kind="audio", bytes=1, format="wav"),
        webhook=receiver.url("/early"),
    )
    sender.store.create(record)
    assert sender.attempt(record.id, 1) is Outcome.skipped
    assert sender.attempt(new_job_id(), 1) is Outcome.skipped
    assert receiver.at("/early") == []


# -- the real process


@pytest.fixture(scope="module")
def webhooks_process(redis_url, tmp_path_factory):
    log_path = Path(tmp_path_factory.mktemp("webhooks")) / "webhooks.log"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("WHISPERFLEET_")},
        "WHISPERFLEET_REDIS_URL": redis_url,
        "WHISPERFLEET_WEBHOOK_ALLOW_NETWORKS": "127.0.0.0/8",
        "WHISPERFLEET_WEBHOOK_TIMEOUT_S": "5",
        "WHISPERFLEET_WEBHOOK_MAX_ATTEMPTS": "3",
    }
    argv = [sys.executable, "-m", "worker.cli", "webhooks", "--concurrency", "4"]
    with open(log_path, "w") as log:
        proc = subprocess.Popen([*argv, "--backoff", "0.3"], env=env, stdout=log, stderr=log)
    deadline = time.monotonic() + 60
    while "ready: takes webhooks" not in log_path.read_text():
        assert proc.poll() is None, log_path.read_text()
        assert time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.1)
    client = redis.Redis.from_url(redis_url)
    settings = Settings(redis_url=redis_url)
    yield proc, log_path, JobStore(client), create_app(settings), Tenants(client, settings)
    stop(proc)


def wait_for_log(log_path: Path, text: str, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while text not in log_path.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    return log_path.read_text()


@pytest.mark.slow
def test_the_process_posts_a_signed_record_once(webhooks_process, receiver):
    proc, log_path, store, app, tenants = webhooks_process
    record = finished(store, receiver.url("/signed"), tenant="acme")
    assert notify(app, record)
    [got] = receiver.wait("/signed", 1)
    secret = tenants.get("acme").webhook_secret
    assert verify(secret, got["headers"], got["body"])
    assert not verify(tenants.get("other").webhook_secret, got["headers"], got["body"])
    assert json.loads(got["body"]) == webhooks.payload(store.get(record.id))
    assert got["headers"]["Content-Type"] == "application/json"
    assert got["headers"][EVENT_HEADER] == f"{record.id}.succeeded"
    wait_for_log(log_path, f"webhook of job {record.id} delivered")
    time.sleep(0.5)
    assert len(receiver.at("/signed")) == 1
    assert "libtorch" not in Path(f"/proc/{proc.pid}/maps").read_text()  # no torch there


@pytest.mark.slow
def test_a_failed_attempt_is_retried_under_a_new_attempt_id(webhooks_process, receiver):
    _, log_path, store, app, tenants = webhooks_process
    receiver.script["/flaky"] = [500, 200]
    record = finished(store, receiver.url("/flaky"))
    notify(app, record)
    first, second = receiver.wait("/flaky", 2)
    assert [first["headers"][ID_HEADER], second["headers"][ID_HEADER]] == [
        f"{record.id}-1",
        f"{record.id}-2",
    ]
    assert first["headers"][EVENT_HEADER] == second["headers"][EVENT_HEADER]
    secret = tenants.get("default").webhook_secret
    assert verify(secret, first["headers"], first["body"])
    assert verify(secret, second["headers"], second["body"])
    text = wait_for_log(log_path, f"webhook of job {record.id} delivered (attempt 2, 200)")
    assert f"webhook of job {record.id}: attempt 1 answered 500" in text


@pytest.mark.slow
def test_a_private_address_is_never_posted(webhooks_process):
    """Its record names an address the API would have refused (or that a name points at
    now): refused at delivery, once, not retried."""
    _, log_path, store, app, _ = webhooks_process
    record = finished(store, "http://10.255.255.1/hook")
    notify(app, record)
    text = wait_for_log(log_path, f"webhook of job {record.id} refused at delivery")
    assert "'10.255.255.1' resolves to a private" in text
    time.sleep(1.0)  # past the first backoff: no second attempt
    text = log_path.read_text()
    assert text.count(f"webhook of job {record.id}") == 1
    assert store.redis.get(f"whisperfleet:webhook:attempt:{record.id}-1") == b"refused"
    assert store.redis.get(f"whisperfleet:webhook:attempt:{record.id}-2") is None


@pytest.mark.slow
def test_attempts_end_after_the_configured_number(webhooks_process, receiver):
    _, log_path, store, app, _ = webhooks_process
    receiver.script["/down"] = [503]
    record = finished(store, receiver.url("/down"))
    notify(app, record)
    text = wait_for_log(log_path, f"webhook of job {record.id}: given up after 3 attempts")
    assert f"webhook of job {record.id}: given up after 3 attempts" in text
    time.sleep(1.0)
    assert len(receiver.at("/down")) == 3
