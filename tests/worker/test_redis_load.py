"""scripts/redis_load.py's parts that its numbers rest on, against the real Redis: MONITOR's
lines read back byte for byte, and a traced job replayed with its transactions whole."""

from __future__ import annotations

import base64
import json
import time
import uuid

import redis

from scripts.redis_load import Monitor, job_commands, queue_command, replay, round_trips
from tests.conftest import REDIS_URL


def test_monitor_gives_back_each_argument_byte_for_byte():
    client = redis.Redis.from_url(f"{REDIS_URL}/13")
    key = f"load-test:{uuid.uuid4().hex}"
    awkward = b'a "quoted" \\ value\n\r\t\x00\xff with spaces'
    monitor = Monitor(client.connection_pool.connection_kwargs.get("port", 6379))
    monitor.start()
    client.set(key, awkward)
    client.hset(key + ":h", "field", b"\x01\x02")
    time.sleep(0.3)
    seen = [args for _, _, args in monitor.stop()]
    client.delete(key, key + ":h")
    assert [b"SET", key.encode(), awkward] in seen
    assert [b"HSET", key.encode() + b":h", b"field", b"\x01\x02"] in seen


def test_a_traced_job_replays_with_its_transactions_whole_and_its_own_commands_only(tmp_path):
    job = uuid.uuid4().hex
    commands = [
        ("api", [b"WATCH", f"job:{job}".encode()]),
        ("api", [b"MULTI"]),
        ("api", [b"SET", f"job:{job}".encode(), b'{"status": "queued"}']),
        ("api", [b"EXEC"]),
        ("api", [b"LPUSH", b"bulk", job.encode()]),
        ("worker", [b"BRPOP", b"bulk", b"interactive", b"1"]),  # the delivery
        ("worker", [b"PUBLISH", b"/0.celeryev/worker.heartbeat", b"{}"]),  # background
        ("worker", [b"BRPOP", b"bulk", b"interactive", b"1"]),  # idle polling
        ("worker", [b"GET", f"job:{job}".encode()]),
        ("lua", [b"get", f"lease:{job}".encode()]),  # run by an EVALSHA: not replayed
    ]
    own = job_commands(commands)
    assert [a[0] for _, a in own] == [
        b"WATCH",
        b"MULTI",
        b"SET",
        b"EXEC",
        b"LPUSH",
        b"BRPOP",
        b"GET",
    ]
    trips = round_trips(own)
    assert [len(t) for t in trips] == [1, 3, 1, 1, 1]  # MULTI ... EXEC in one write
    assert trips[3] == [[b"rpop", b"bulk"]]  # the pop made plain
    queue = [t for t in trips if any(queue_command(c) for c in t)]
    assert queue == [[[b"LPUSH", b"bulk", job.encode()]], [[b"rpop", b"bulk"]]]

    trace = tmp_path / "trace.json"
    encoded = [
        {
            "t": 0.0,
            "client": "x",
            "role": role,
            "args": [base64.b64encode(a).decode() for a in args],
        }
        for role, args in commands
    ]
    trace.write_text(json.dumps({"job_id": job, "scripts": [], "commands": encoded}))
    out = tmp_path / "replay.json"

    class Args:
        redis_server, clients, seconds, json, part = "redis-server", "1,2", 0.5, out, "job"

    Args.trace = trace
    replay(Args)
    rows = json.loads(out.read_text())["rows"]
    assert [r["clients"] for r in rows] == [1, 2]
    assert all(r["jobs_per_s"] > 0 and r["errors_per_job"] == 0 for r in rows)
