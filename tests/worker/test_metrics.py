"""The worker's metrics listen where they are told: this host only by default."""

import httpx
import psutil
import redis

from tests.conftest import free_port
from worker import metrics
from worker.contract.jobs import JobStore
from worker.contract.settings import Settings


def test_metrics_listen_on_the_metrics_host_only(settings):
    assert Settings().metrics_host == "127.0.0.1"
    port = free_port()
    metrics.serve("127.0.0.1", port, JobStore(redis.Redis.from_url(settings.redis_url)), set())
    listening = {
        c.laddr.ip
        for c in psutil.Process().net_connections("tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }
    assert listening == {"127.0.0.1"}
    assert "whisperfleet_queue_depth" in httpx.get(f"http://127.0.0.1:{port}/metrics").text
