"""Prometheus metrics of one worker process, served on `WHISPERFLEET_METRICS_HOST` (127.0.0.1)
and `WHISPERFLEET_METRICS_PORT` (0: off).

Counters and histograms are updated where things happen; queue depths, the jobs not yet
terminal and the jobs this worker runs are read when Prometheus scrapes. The engine's own
metrics (`ENGINE`: batches, busy time, audio seconds, GPU memory) are kept in its core process
(`worker.core.process`), which sends them every second; the worker serves the latest. `/ready`
on the same port answers 200 once the worker takes jobs, 503 before (loading its model) and
after (stopping).
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from wsgiref.simple_server import WSGIRequestHandler, make_server

import redis
from prometheus_client import CollectorRegistry, Counter, Histogram, make_wsgi_app
from prometheus_client.core import REGISTRY, GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from worker.contract.jobs import QUEUES, JobStore

log = logging.getLogger(__name__)

# Set once the worker takes jobs (its default model loaded), cleared as it stops: `/ready`
READY = threading.Event()
JOBS = Counter("whisperfleet_jobs", "Jobs this worker ended or handed on", ["outcome"])
ENGINE = CollectorRegistry()  # updated in the engine core, sent to the worker (`core_report`)
BATCH = Histogram(
    "whisperfleet_batch_inputs",
    "Inputs started together by a batcher",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
    registry=ENGINE,
)
ENGINE_SECONDS = Counter(
    "whisperfleet_engine_seconds",
    "Host seconds in the engine: admitting windows (encoder) or in decode steps",
    ["phase"],
    registry=ENGINE,
)
WINDOWS = Counter("whisperfleet_windows_encoded", "30 s windows encoded", registry=ENGINE)
AUDIO_SECONDS = Counter(
    "whisperfleet_audio_seconds",
    "Seconds of audio transcribed (rate: audio seconds per second)",
    registry=ENGINE,
)
ENGINE_BUSY = Counter(
    "whisperfleet_engine_busy_seconds",
    "Seconds a batcher spent in engine steps, with windows decoding (rate: the busy fraction)",
    registry=ENGINE,
)
JOB_STAGE = Histogram(
    "whisperfleet_job_stage_seconds",
    "Where a job's time goes: queue (accepted to started, first attempt), fetch (its input "
    "read from storage), decode (audio to samples), engine (handed to the batcher to its "
    "result), store (its result written)",
    ["stage", "priority"],
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 120),
)


@contextmanager
def stage(name: str, priority: str) -> Iterator[None]:
    """Time one stage of a job (`JOB_STAGE`), also when it raises."""
    start = time.perf_counter()
    try:
        yield
    finally:
        JOB_STAGE.labels(name, priority).observe(time.perf_counter() - start)


class _Scraped(Collector):
    def __init__(self, store: JobStore, held: set[str]):
        self.store, self.held = store, held

    def collect(self):
        depth = GaugeMetricFamily("whisperfleet_queue_depth", "Messages waiting", labels=["queue"])
        active = GaugeMetricFamily("whisperfleet_active_jobs", "Jobs not yet terminal (fleet)")
        try:
            for name in QUEUES:
                depth.add_metric([name], self.store.redis.llen(name))
            active.add_metric([], self.store.redis.zcard(self.store.active))
        except redis.RedisError as e:
            log.warning("metrics: Redis unavailable (%s)", e)
        yield depth
        yield active
        yield GaugeMetricFamily(
            "whisperfleet_running_jobs", "Jobs this worker runs (holds the lease of)",
            value=len(self.held),
        )  # fmt: skip


def engine_snapshot() -> list[Metric]:
    """The engine's metrics as they stand in this process (the core), to send: its counters
    and histograms, and GPU memory."""
    import torch  # the core has it loaded already

    snapshot = list(ENGINE.collect())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        memory = GaugeMetricFamily(
            "whisperfleet_gpu_memory_bytes", "GPU memory allocated", labels=["kind"]
        )
        memory.add_metric(["allocated"], torch.cuda.memory_allocated())
        memory.add_metric(["peak"], torch.cuda.max_memory_allocated())
        snapshot.append(memory)
    return snapshot


class _CoreMetrics(Collector):
    """The engine core's metrics as it last sent them. Before a core's first report there are
    none: this process's own engine registry may hold another core's counts (an in-process
    one), and a scrape must never mix two cores."""

    latest: list[Metric] = []

    def collect(self) -> Iterator[Metric]:
        return iter(self.latest)


_CORE = _CoreMetrics()
REGISTRY.register(_CORE)


def core_report(snapshot: list[Metric]) -> None:
    """Serve the metrics the engine core sent (`engine_snapshot` there); [] for a new core
    that has not reported yet."""
    _CORE.latest = snapshot


def _with_ready(metrics_app):
    """The metrics, and `/ready`: 200 once the worker takes jobs (READY), else 503."""

    def app(environ, start_response):
        if environ.get("PATH_INFO") != "/ready":
            return metrics_app(environ, start_response)
        ready = READY.is_set()
        body = json.dumps({"ready": ready}).encode()
        status = "200 OK" if ready else "503 Service Unavailable"
        start_response(status, [("Content-Type", "application/json")])
        return [body]

    return app


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:  # scrapes are not news
        pass


def serve(
    host: str, port: int, store: JobStore | None = None, held: set[str] | None = None
) -> str | None:
    """Serve `/metrics` and `/ready` from a thread; held: the ids of the jobs whose lease
    this worker holds (without a store: a process that runs no jobs, the engine's metrics).
    Returns where, for the process's line at start (None: not served)."""
    if not port:
        return None
    if store is not None:
        REGISTRY.register(_Scraped(store, held))
    try:
        family = socket.getaddrinfo(host, port)[0][0]  # an IPv6 host too
        server_class = type("MetricsServer", (ThreadingWSGIServer,), {"address_family": family})
        app = _with_ready(make_wsgi_app(REGISTRY))
        server = make_server(host, port, app, server_class, handler_class=_Quiet)
    except OSError as e:  # another worker on this host has the port: run without
        log.warning("metrics: port %d unavailable (%s); not serving metrics", port, e)
        return None
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return f"http://{host}:{port}/metrics"
