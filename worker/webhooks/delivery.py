"""Webhooks: a job's record posted, signed, to the URL the job named, once the job has ended.

Light on purpose (no torch, no FastAPI): the API checks a webhook's address at submission
(`destination`), the GPU worker's hooks and the API's cancel `notify` this process, and
`whisperfleet webhooks` (`run`) posts them: a Celery worker of its own, on its own queue
(`webhooks`), never on the GPU workers' job threads.

What is posted: `POST <webhook URL>` with the job's record as `GET /v1/jobs/{id}` shows it
(JSON, `Content-Type: application/json`), once the job is `succeeded`, `failed` or
`cancelled`, and these headers:

    Whisperfleet-Webhook-Id: <attempt id>       new for every attempt
    Whisperfleet-Event-Id: <job id>.<status>     the same on every attempt: dedupe on it
    Whisperfleet-Signature: t=<unix seconds>,v1=<hex>

where `<hex>` is HMAC-SHA256, keyed with the tenant's webhook secret (`whsec_...`, its UTF-8
bytes), of `<attempt id>.<t>.` followed by the body's bytes, as sent. A receiver recomputes it
over the raw body, compares in constant time (`hmac.compare_digest`), and refuses a `t` more
than five minutes from its clock (a replay); several `v1=` may appear (any one matching
suffices). In Python this is `verify(secret, request_headers, raw_body)`; by hand:

    t, v1 = (dict(p.split("=", 1) for p in header.split(","))[k] for k in ("t", "v1"))
    msg = f"{attempt_id}.{t}.".encode() + raw_body
    ok = hmac.compare_digest(hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest(), v1)
    ok = ok and abs(time.time() - int(t)) <= 300

Delivery: an answer 2xx within `WEBHOOK_TIMEOUT_S` is delivered; anything else (another
status, a timeout, a refused connection) is a failed attempt, tried again under a new attempt
id after a backoff with jitter (first after `--backoff` seconds, doubling, at most an hour),
`WEBHOOK_MAX_ATTEMPTS` attempts in all, then given up (logged). Redirects are not followed,
and at most a few KB of the answer are read. An attempt id is posted at most once: a message
redelivered after its process died (or a second notification of the same job) finds its
attempt already claimed and does not post it again; where that attempt's outcome was never
recorded, the next attempt follows under a new id (so a receiver may see an event twice, with
two attempt ids: dedupe on the event id).

Addresses: a URL whose host resolves to any address that is not public (private, loopback,
link-local such as 169.254.169.254, multicast, reserved, unspecified, shared, IPv6 unique-local
or site-local, or an IPv4-mapped, 6to4, Teredo or NAT64 form of one) is refused, unless the
address lies in one of `WEBHOOK_ALLOW_NETWORKS` (CIDRs). The check runs at submission and
again at each delivery (a name may be re-pointed at an internal address after it was
checked: DNS rebinding), and the connection goes to the very address checked, never
resolved a second time. A delivery refused this way is not tried again.
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import ipaddress
import json
import logging
import random
import socket
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from functools import cache
from urllib.parse import urlsplit

import redis
from celery import Celery, Task
from celery.exceptions import Reject
from celery.signals import worker_ready
from kombu import Exchange, Queue

from worker.contract.jobs import TERMINAL, JobRecord, JobStore
from worker.contract.settings import Settings, get_settings
from worker.contract.tenants import Tenants
from worker.logs import configure as configure_logs
from worker.logs import current_job, ready, worker_argv

log = logging.getLogger(__name__)

WEBHOOK_TASK = "whisperfleet.webhook"
WEBHOOK_QUEUE = "webhooks"
USER_AGENT = "whisperfleet-webhooks/1"
ID_HEADER = "Whisperfleet-Webhook-Id"
EVENT_HEADER = "Whisperfleet-Event-Id"
SIGNATURE_HEADER = "Whisperfleet-Signature"
TOLERANCE_S = 300
MAX_ANSWER_BYTES = 4096  # of a receiver's answer, read and thrown away
DEFAULT_BACKOFF_S = 30.0  # before the second attempt; doubling, with jitter, at most MAX_DELAY_S
MAX_DELAY_S = 3600.0
# what is posted of a record: the fields `GET /v1/jobs/{id}` shows (api.schemas.JobPublic; a
# test keeps the two equal), never the service's own (tenant, worker, quarantine)
PUBLIC_FIELDS = frozenset(
    {"id", "status", "model", "options", "priority", "input", "created_at", "started_at",
     "finished_at", "attempts", "progress", "error", "source", "webhook", "backfill"}
)  # fmt: skip

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")


# -- addresses


class WebhookRefused(ValueError):
    """A webhook URL this service will not post to; the message names the URL's host only."""


def _host_words(host: str) -> str:
    return repr(host) if len(host) <= 80 else f"{host[:77]!r}..."


def _networks(allow: list[str]) -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    try:
        return [ipaddress.ip_network(n, strict=False) for n in allow]
    except ValueError as e:
        raise ValueError(f"WHISPERFLEET_WEBHOOK_ALLOW_NETWORKS: {e}") from None


def _forms(ip: IPAddress) -> list[IPAddress]:
    """The address, or, for an IPv6 address that carries an IPv4 one, the IPv4 addresses a
    connection to it may reach (mapped: only that one; 6to4, Teredo, NAT64: both)."""
    if isinstance(ip, ipaddress.IPv4Address):
        return [ip]
    if ip.ipv4_mapped is not None:
        return [ip.ipv4_mapped]
    forms: list[IPAddress] = [ip]
    if ip.sixtofour is not None:
        forms.append(ip.sixtofour)
    if ip.teredo is not None:
        forms.extend(ip.teredo)
    if ip in _NAT64:
        forms.append(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF))
    return forms


def _public(ip: IPAddress) -> bool:
    if isinstance(ip, ipaddress.IPv6Address) and ip.is_site_local:
        return False
    return ip.is_global and not (
        ip.is_private
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
    )


def _allowed(ip: IPAddress, networks: list) -> bool:
    """Inside an allowed network (an IPv4-mapped address: its IPv4 address), or public in
    every form."""
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    listed = [ip] if mapped is None else [ip, mapped]
    if any(a in n for n in networks for a in listed if a.version == n.version):
        return True
    return all(_public(f) for f in _forms(ip))


def _split(url: str) -> tuple[str, str, int]:
    """(scheme, host, port) of a webhook URL; WebhookRefused if it is not one."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise WebhookRefused("webhook: not a valid URL") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise WebhookRefused("webhook: expected an http:// or https:// URL")
    return parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80)


def destination(url: str, allow_networks: list[str]) -> list[IPAddress]:
    """The addresses `url`'s host resolves to, in the resolver's order, once every one of them
    is public or inside one of `allow_networks` (CIDRs); else WebhookRefused. Blocking (DNS):
    the API calls it in a thread."""
    _, host, port = _split(url)
    networks = _networks(allow_networks)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise WebhookRefused(f"webhook host {_host_words(host)} does not resolve") from None
    addresses: list[IPAddress] = []
    for family, *_, sockaddr in infos:
        if family not in (socket.AF_INET, socket.AF_INET6):
            continue
        text = sockaddr[0]
        if family == socket.AF_INET6 and len(sockaddr) > 3 and sockaddr[3]:
            text = f"{text.partition('%')[0]}%{sockaddr[3]}"  # keep the zone: link-local
        ip = ipaddress.ip_address(text)
        if ip not in addresses:
            addresses.append(ip)
    if not addresses:
        raise WebhookRefused(f"webhook host {_host_words(host)} does not resolve")
    if not all(_allowed(ip, networks) for ip in addresses):
        raise WebhookRefused(
            f"webhook host {_host_words(host)} resolves to a private, loopback, link-local or "
            "otherwise non-public address: refused"
        )
    return addresses


# -- signing


def sign(secret: str, attempt_id: str, timestamp: int, body: bytes) -> str:
    """The `Whisperfleet-Signature` header's value: `t=<timestamp>,v1=<hex HMAC-SHA256>`."""
    message = f"{attempt_id}.{timestamp}.".encode() + body
    digest = hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={digest}"


def _header(headers: Mapping[str, str], name: str) -> str | None:
    name = name.lower()
    for key, value in headers.items():
        if key.lower() == name:
            return value
    return None


def verify(
    secret: str,
    headers: Mapping[str, str],
    body: bytes,
    tolerance_s: float = TOLERANCE_S,
    now: float | None = None,
) -> bool:
    """Whether `body` with `headers` (any mapping; names in any case) was signed with `secret`
    no more than `tolerance_s` from `now`: what a receiver checks before trusting a post."""
    attempt_id = _header(headers, ID_HEADER)
    signature = _header(headers, SIGNATURE_HEADER)
    if not attempt_id or not signature:
        return False
    timestamp, candidates = None, []
    for part in signature.split(","):
        key, _, value = part.strip().partition("=")
        if key == "t":
            timestamp = value
        elif key == "v1":
            candidates.append(value)
    if timestamp is None or not timestamp.isdigit() or not candidates:
        return False
    now = time.time() if now is None else now
    if abs(now - int(timestamp)) > tolerance_s:
        return False
    expected = sign(secret, attempt_id, int(timestamp), body).partition(",v1=")[2]
    return any(hmac.compare_digest(expected.encode(), c.encode()) for c in candidates)


# -- one post


def payload(record: JobRecord) -> dict:
    """The record as the API shows it: without the service's own fields."""
    return record.model_dump(mode="json", include=set(PUBLIC_FIELDS))


def body(record: JobRecord) -> bytes:
    return json.dumps(payload(record), separators=(",", ":"), ensure_ascii=False).encode()


class _Pinned:
    """Connects to addresses that were checked, in order, never resolving the host again."""

    addresses: list[IPAddress]

    def connect(self) -> None:
        deadline = time.monotonic() + self.timeout
        error: OSError | None = None
        for ip in self.addresses:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            family = socket.AF_INET if ip.version == 4 else socket.AF_INET6
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.settimeout(left)
                sock.connect((str(ip), self.port))
                sock.settimeout(self.timeout)
            except OSError as e:
                sock.close()
                error = e
                continue
            self.sock = self.wrap(sock)
            return
        raise error or TimeoutError("connect timed out")

    def wrap(self, sock: socket.socket) -> socket.socket:
        return sock

    def abort(self) -> None:
        """From another thread: end a post that ran past its time."""
        sock = getattr(self, "sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class _PinnedHTTP(_Pinned, http.client.HTTPConnection):
    def __init__(self, host: str, port: int, addresses: list[IPAddress], timeout: float):
        http.client.HTTPConnection.__init__(self, host, port, timeout=timeout)
        self.addresses = addresses


class _PinnedHTTPS(_Pinned, http.client.HTTPSConnection):
    def __init__(self, host: str, port: int, addresses: list[IPAddress], timeout: float):
        context = ssl.create_default_context()
        http.client.HTTPSConnection.__init__(self, host, port, timeout=timeout, context=context)
        self.addresses = addresses

    def wrap(self, sock: socket.socket) -> socket.socket:
        try:
            return self._context.wrap_socket(sock, server_hostname=self.host)
        except BaseException:
            sock.close()
            raise


def post(
    url: str,
    data: bytes,
    headers: Mapping[str, str],
    allow_networks: list[str],
    timeout_s: float,
) -> int:
    """POST `data` to `url` once: the answer's status. The host is resolved and checked here
    (WebhookRefused), and the connection made to the address checked; redirects are not
    followed; the whole post, answer included, ends within `timeout_s` (OSError or
    http.client.HTTPException otherwise)."""
    scheme, host, port = _split(url)
    addresses = destination(url, allow_networks)
    parts = urlsplit(url)
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    kind = _PinnedHTTPS if scheme == "https" else _PinnedHTTP
    conn = kind(host, port, addresses, timeout_s)
    timer = threading.Timer(timeout_s, conn.abort)
    timer.daemon = True
    timer.start()
    try:
        conn.request("POST", target, body=data, headers=dict(headers))
        answer = conn.getresponse()
        answer.read(MAX_ANSWER_BYTES)
        return answer.status
    finally:
        timer.cancel()
        conn.close()


# -- notifying and delivering


def _queue() -> Queue:
    return Queue(WEBHOOK_QUEUE, Exchange(WEBHOOK_QUEUE), routing_key=WEBHOOK_QUEUE)


def notify(celery_app: Celery, record: JobRecord) -> bool:
    """Queue the post of `record` (just moved to a terminal state) if it names a webhook:
    whether a message was sent. The broker away (after Celery's own retries) is logged, never
    raised: the job's end stands without its webhook. Sent with a queue object, not a name: a
    name would add `webhooks` to `celery_app`'s own queues, which its workers would then
    consume after their next reconnect."""
    if record.webhook is None:
        return False
    try:
        celery_app.send_task(WEBHOOK_TASK, args=[record.id], queue=_queue())
    except Exception as e:  # kombu's OperationalError, Redis's errors: the broker is away
        log.error("job %s: its webhook was not queued (%s: %s)", record.id, type(e).__name__, e)
        return False
    return True


def create_webhook_app(settings: Settings) -> Celery:
    """The webhooks process's Celery app: the GPU workers' broker and reliability settings,
    only `worker.webhooks.delivery`, only the `webhooks` queue. Never the current app, so importing
    this module (the GPU worker's hooks do, for `notify`) leaves a process's own app alone."""
    app = Celery("whisperfleet-webhooks", broker=settings.redis_url, set_as_current=False)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        task_ignore_result=True,
        task_acks_late=True,  # acked after the attempt's outcome (and its retry) is recorded
        task_reject_on_worker_lost=True,
        task_acks_on_failure_or_timeout=False,
        worker_prefetch_multiplier=1,
        task_queues=[_queue()],
        task_default_queue=WEBHOOK_QUEUE,
        task_routes={WEBHOOK_TASK: {"queue": _queue()}},
        broker_transport_options={"visibility_timeout": settings.visibility_timeout_s},
        broker_connection_retry_on_startup=True,
        worker_pool="threads",
        worker_hijack_root_logger=False,
    )
    return app


class Outcome(StrEnum):
    delivered = "delivered"  # answered 2xx
    failed = "failed"  # another answer, or none: try again under a new attempt id
    refused = "refused"  # the address is not public: not tried again
    claimed = "claimed"  # this attempt id was taken before (a redelivery): not posted again
    skipped = "skipped"  # no record, not terminal, no webhook: nothing to post


@dataclass
class Sender:
    """What one attempt needs, made once per process."""

    settings: Settings
    redis: redis.Redis
    prefix: str = "whisperfleet"

    @property
    def store(self) -> JobStore:
        return JobStore(self.redis, self.prefix)

    def _key(self, kind: str, name: str) -> str:
        return f"{self.prefix}:webhook:{kind}:{name}"

    @property
    def claim_ttl_s(self) -> int:
        # longer than a message can wait to be redelivered, and than all the backoffs
        return int(2 * self.settings.visibility_timeout_s + 24 * 3600)

    def attempt(self, job_id: str, number: int) -> Outcome:
        """Attempt `number` (1, 2, ...) of posting job `job_id`'s record. Its attempt id is
        claimed first (`<prefix>:webhook:attempt:<id>`, SET NX): a claimed id is never posted
        again. A delivered event is marked (`<prefix>:webhook:event:<id>`): later attempts,
        from a duplicate notification, then post nothing."""
        record = self.store.get(job_id)
        if record is None or record.status not in TERMINAL or record.webhook is None:
            log.info("webhook of job %s: nothing to post (record gone or not ended)", job_id)
            return Outcome.skipped
        attempt_id, event_id = f"{job_id}-{number}", f"{job_id}.{record.status}"
        event = self._key("event", event_id)
        if self.redis.exists(event):
            log.info("webhook of job %s: delivered already", job_id)
            return Outcome.delivered
        key = self._key("attempt", attempt_id)
        if not self.redis.set(key, "started", nx=True, ex=self.claim_ttl_s):
            state = (self.redis.get(key) or b"expired").decode()
            log.warning("webhook of job %s: attempt %d was made before (%s)", job_id, number, state)
            done = (Outcome.delivered, Outcome.refused)
            return Outcome(state) if state in done else Outcome.claimed
        data = body(record)
        tenants = Tenants(self.redis, self.settings, self.prefix)
        secret = tenants.get(record.tenant).webhook_secret
        headers = {
            "Content-Type": "application/json",
            "User-Agent": USER_AGENT,
            ID_HEADER: attempt_id,
            EVENT_HEADER: event_id,
            SIGNATURE_HEADER: sign(secret, attempt_id, int(time.time()), data),
        }
        # the tenant's networks as they are now: a list narrowed since submission holds
        allow = tenants.limits(record.tenant).webhook_networks
        timeout = self.settings.webhook_timeout_s
        try:
            status = post(record.webhook, data, headers, allow, timeout)
        except WebhookRefused as e:
            log.warning("webhook of job %s refused at delivery, not retried: %s", job_id, e)
            self.redis.set(key, Outcome.refused, xx=True, keepttl=True)
            return Outcome.refused
        except (OSError, http.client.HTTPException) as e:
            self.redis.set(key, Outcome.failed, xx=True, keepttl=True)
            reason = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            log.warning("webhook of job %s: attempt %d failed (%s)", job_id, number, reason)
            return Outcome.failed
        if 200 <= status < 300:
            with self.redis.pipeline() as pipe:
                pipe.set(key, Outcome.delivered, xx=True, keepttl=True)
                pipe.set(event, attempt_id, ex=self.claim_ttl_s)
                pipe.execute()
            log.info("webhook of job %s delivered (attempt %d, %d)", job_id, number, status)
            return Outcome.delivered
        self.redis.set(key, Outcome.failed, xx=True, keepttl=True)
        log.warning("webhook of job %s: attempt %d answered %d", job_id, number, status)
        return Outcome.failed


def backoff(number: int, first_s: float) -> float:
    """Seconds before attempt `number + 1`: `first_s` doubling, at most MAX_DELAY_S, with
    jitter (a uniform draw from half of it to all of it)."""
    delay = min(MAX_DELAY_S, first_s * 2 ** (number - 1))
    return random.uniform(delay / 2, delay)


@cache
def _sender() -> Sender:
    settings = get_settings()
    return Sender(settings, redis.Redis.from_url(settings.redis_url))


app = create_webhook_app(get_settings())
_backoff_s = DEFAULT_BACKOFF_S  # `run` sets it from `whisperfleet webhooks --backoff`


@app.task(bind=True, name=WEBHOOK_TASK, shared=False, max_retries=None)
def deliver(self: Task, job_id: str) -> str:
    """One attempt; a failed one is tried again (a new message, a new attempt id) until
    WEBHOOK_MAX_ATTEMPTS. Redis away: the message goes back to the queue."""
    current_job.set(job_id)
    number = self.request.retries + 1
    settings = get_settings()
    try:
        outcome = _sender().attempt(job_id, number)
    except redis.RedisError as e:
        log.warning("webhook of job %s: Redis unavailable (%s); its message goes back", job_id, e)
        raise Reject(e, requeue=True) from e
    if outcome not in (Outcome.failed, Outcome.claimed):
        return outcome
    if number >= settings.webhook_max_attempts:
        log.error("webhook of job %s: given up after %d attempts", job_id, number)
        return outcome
    delay = backoff(number, _backoff_s)
    delay = min(delay, settings.visibility_timeout_s / 2)  # an ETA past it is redelivered
    log.info("webhook of job %s: attempt %d in %.1f s", job_id, number + 1, delay)
    try:
        raise self.retry(countdown=delay, max_retries=None)
    except Reject as e:  # the retry could not be sent (Redis away): put the message back
        raise Reject(e.reason, requeue=True) from e


def run(concurrency: int, backoff_s: float = DEFAULT_BACKOFF_S) -> None:
    """`whisperfleet webhooks`: post webhooks with `concurrency` threads until stopped."""
    global _backoff_s
    _backoff_s = backoff_s
    settings = get_settings()
    configure_logs(settings.log_format)
    _networks(settings.webhook_allow_networks)  # a list that does not parse stops us here
    worker_ready.connect(lambda sender, **_: ready(sender, "webhooks"), weak=False)
    app.worker_main(worker_argv("whisperfleet-webhooks", WEBHOOK_QUEUE, concurrency))
