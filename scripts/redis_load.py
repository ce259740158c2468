"""Redis's share of a job, and how many jobs one Redis carries: the numbers behind the plan for
a fleet of many GPUs (docs/benchmarks.md, "One Redis for a fleet").

    python scripts/redis_load.py count [--jobs 20] [--idle 20] [--poll 1.0]
        [--clip ../shared/audio/dev/en_jfk.flac] [--device cpu] [--trace trace.json]
    python scripts/redis_load.py replay --trace trace.json [--clients 1,4,16,64] [--seconds 10]
        [--part job|queue] [--redis-server redis-server]

count: a Redis and an S3 server of their own (fresh ports; the stock `moto.server`, which logs
every request, so that they can be counted), then `whisperfleet api` (API keys on, as
deployed) and `whisperfleet worker` as processes, as the end-to-end tests run them. Counted
with Redis's `INFO commandstats` and the S3 server's request log:
- idle: what the ready worker and the API make Redis run with no job (heartbeat, reconciler,
  Celery's polling), per second;
- jobs: `--jobs` jobs at once over REST, each polled every `--poll` seconds until it ends, then
  its result fetched; the commands of that run less the idle rate over its length, per job;
- a poll: `GET /v1/jobs/{id}` alone, so that a client's own polling can be added as it polls;
- one more job under `MONITOR`: each command in order with whose it is (the API's, the
  worker's, or run by a Lua script), written to --trace for the replay.

replay: a fresh redis-server (no persistence, as the embedded one) and `--clients` processes,
each replaying the traced job's own commands (`job_commands`) over one connection again and
again, in their order, with a new job id each time (a transaction in one write, as redis-py
sends it; the delivery's blocking pop made a plain pop; Lua scripts loaded first). For each
count of clients: jobs a second, commands a second and Redis's CPU: the most jobs a second one
Redis (one core) runs with the real records and messages. `--part queue` replays only Celery's
queue (the message pushed, popped, kept unacknowledged, acknowledged): the rate one Redis
sustains as the broker alone.
"""

from __future__ import annotations

import argparse
import base64
import json
import multiprocessing
import re
import shutil
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests: the shared helpers

from scripts import harness  # noqa: E402
from tests.conftest import free_port  # noqa: E402
from worker.contract.tenants import Tenants  # noqa: E402

TERMINAL = {"succeeded", "failed", "cancelled"}
OWN = {b"info", b"config", b"client", b"monitor"}  # this script's own commands
BLOCKING = {b"brpop": b"rpop", b"blpop": b"lpop"}  # replayed without their timeout
CELERY_KEYS = {b"unacked", b"unacked_index"}  # kombu's record of delivered, unacked messages
MONITOR_LINE = re.compile(rb"^(\d+\.\d+) \[(\d+) ([^\]]+)\] (.*)$")
QUOTED = re.compile(rb'"((?:[^"\\]|\\.)*)"')
ESCAPES = {ord("n"): 10, ord("r"): 13, ord("t"): 9, ord("a"): 7, ord("b"): 8}


def unescape(raw: bytes) -> bytes:
    """An argument as MONITOR quotes it (Redis's sdscatrepr) back to its bytes."""
    out, i = bytearray(), 0
    while i < len(raw):
        if raw[i] == 0x5C and i + 1 < len(raw):  # a backslash
            if raw[i + 1] == ord("x"):
                out.append(int(raw[i + 2 : i + 4], 16))
                i += 4
                continue
            out.append(ESCAPES.get(raw[i + 1], raw[i + 1]))
            i += 2
            continue
        out.append(raw[i])
        i += 1
    return bytes(out)


class Monitor(threading.Thread):
    """Every command Redis runs, parsed from MONITOR: (seconds, client "ip:port" or "lua",
    arguments)."""

    def __init__(self, port: int):
        super().__init__(daemon=True)
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.sendall(b"MONITOR\r\n")
        self.file = self.sock.makefile("rb")
        self.file.readline()  # +OK
        self.commands: list[tuple[float, str, list[bytes]]] = []

    def run(self) -> None:
        for line in self.file:
            if m := MONITOR_LINE.match(line.rstrip(b"\r\n").removeprefix(b"+")):
                args = [unescape(a) for a in QUOTED.findall(m.group(4))]
                self.commands.append((float(m.group(1)), m.group(3).decode(), args))

    def stop(self) -> list[tuple[float, str, list[bytes]]]:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.join(5)
        return self.commands


def command_calls(client: redis.Redis) -> Counter:
    """Calls by command since the last CONFIG RESETSTAT, less this script's own."""
    stats = client.info("commandstats")
    calls = Counter({k.removeprefix("cmdstat_"): v["calls"] for k, v in stats.items()})
    for own in ("config|resetstat", "info"):
        calls.pop(own, None)
    return calls


def roles(procs: dict[str, psutil.Process], redis_port: int) -> dict[int, str]:
    """Each open connection to Redis by its local port -> whose it is: the process named, or
    one it started (the worker's engine core and job processes count as the worker)."""
    found = {}
    for role, proc in procs.items():
        for p in [proc, *proc.children(recursive=True)]:
            for c in p.net_connections(kind="tcp"):
                if c.raddr and c.raddr.port == redis_port:
                    found[c.laddr.port] = role
    return found


class Stack(harness.Stack):
    """Redis, an S3 server that logs its requests, the API and a worker, on fresh ports."""

    def __init__(self, args: argparse.Namespace, logs: Path):
        self.metrics = free_port()
        env = {"WHISPERFLEET_DEVICE": args.device, "WHISPERFLEET_METRICS_PORT": str(self.metrics)}
        super().__init__(logs, env)
        try:
            self._start()
        except BaseException:
            self.close()  # nothing left running
            raise

    def _start(self) -> None:
        self.embedded_redis()
        self.start("s3", [sys.executable, "-m", "moto.server", "-p", str(self.s3_port)], grace=5)
        harness.until(lambda: harness.answers(self.s3_port), "moto.server", 60, self.check)
        self.redis = redis.Redis.from_url(self.redis_url)
        self.key, _ = Tenants(self.redis, self.settings).create_key("plan")
        self.worker("worker", [])
        self.http = self.api({"Authorization": f"Bearer {self.key}"})
        self.ready([self.metrics], timeout=300)  # the model loaded and warm

    def s3_requests(self) -> Counter:
        """Requests the S3 server logged so far, by method."""
        lines = (self.log_dir / "s3.log").read_text(errors="replace").splitlines()
        return Counter(
            m.group(1) for line in lines if (m := re.search(r'"(GET|PUT|POST|HEAD|DELETE) ', line))
        )

    def job(self, clip: bytes, poll_s: float) -> tuple[str, int]:
        """Submit, poll until it ends, fetch the result: (job id, polls)."""
        r = self.http.post("/v1/jobs", files={"file": ("clip.flac", clip)})
        r.raise_for_status()
        job_id, polls = r.json()["id"], 0
        while True:
            time.sleep(poll_s)
            polls += 1
            status = self.http.get(f"/v1/jobs/{job_id}").json()["status"]
            if status in TERMINAL:
                break
        if status != "succeeded":
            raise SystemExit(f"job {job_id} ended {status}")
        self.http.get(f"/v1/jobs/{job_id}/result").raise_for_status()
        return job_id, polls


def count(args: argparse.Namespace) -> None:
    clip = Path(args.clip).read_bytes()
    logs = Path(tempfile.mkdtemp(prefix="redis-load-"))
    stack = Stack(args, logs)
    monitor = Monitor(stack.redis_port)  # from the start: the Lua scripts' first loads
    monitor.start()
    try:
        stack.job(clip, args.poll)  # the first job: model paths, scripts, pools all made
        r = stack.redis
        r.config_resetstat()
        time.sleep(args.idle)
        idle = command_calls(r)
        idle_rate = {k: v / args.idle for k, v in idle.items()}

        r.config_resetstat()
        s3_before, start = stack.s3_requests(), time.monotonic()
        with ThreadPoolExecutor(args.jobs) as pool:
            done = list(pool.map(lambda _: stack.job(clip, args.poll), range(args.jobs)))
        took = time.monotonic() - start
        calls = command_calls(r)
        connections = len(r.client_list()) - 2  # not this script's two
        s3 = stack.s3_requests() - s3_before
        polls = sum(p for _, p in done) / args.jobs

        r.config_resetstat()
        for _ in range(50):  # a poll alone, on an ended job
            stack.http.get(f"/v1/jobs/{done[0][0]}")
        per_poll = {k: v / 50 for k, v in command_calls(r).items()}

        window = time.time()
        traced, _ = stack.job(clip, args.poll)
        time.sleep(0.5)
        commands = monitor.stop()
        scripts = [
            a[2].decode()
            for _, _, a in commands
            if [x.lower() for x in a[:2]] == [b"script", b"load"]
        ]
        commands = [(t, c, a) for t, c, a in commands if t >= window]
        procs = {role: psutil.Process(stack.pid(role)) for role in ("api", "worker")}
        by_port = roles(procs, stack.redis_port)
    finally:
        stack.close()

    print(
        f"{args.jobs} jobs at once (a {len(clip) // 1024} KiB clip), {took:.1f} s, each polled "
        f"every {args.poll} s ({polls:.1f} polls a job); idle {args.idle} s"
    )
    print("| command | idle, a second | a job (less idle) | a poll |")
    print("|---|---|---|---|")
    names = sorted(set(calls) | set(idle_rate), key=lambda k: -calls.get(k, 0))
    per_job = {}
    for name in names:
        per_job[name] = (calls.get(name, 0) - idle_rate.get(name, 0) * took) / args.jobs
        cells = (idle_rate.get(name, 0), per_job[name], per_poll.get(name, 0))
        print(f"| {name} | {cells[0]:.2f} | {cells[1]:.1f} | {cells[2]:.1f} |")
    total = sum(per_job.values())
    poll_total = sum(per_poll.values())
    print(f"| all | {sum(idle_rate.values()):.2f} | {total:.1f} | {poll_total:.1f} |")
    print(f"a job without its polls: {total - polls * poll_total:.1f} commands")
    print(f"S3 requests a job: {dict((k, round(v / args.jobs, 2)) for k, v in s3.items())}")
    print(f"connections to Redis (the API and one worker): {connections}")

    kept = [(t, c, a) for t, c, a in commands if a and a[0].lower() not in OWN]
    by_role = Counter()
    rows = []
    for t, client, a in kept:
        port = int(client.rsplit(":", 1)[1]) if ":" in client else None
        role = "lua" if client == "lua" else by_port.get(port, "other")
        by_role[role] += 1
        rows.append(
            {
                "t": t,
                "client": client,
                "role": role,
                "args": [base64.b64encode(x).decode() for x in a],
            }
        )
    print(f"the traced job ({traced}): {len(kept)} commands, by process: {dict(by_role)}")
    if args.trace:
        trace = {"job_id": traced, "scripts": scripts, "commands": rows}
        Path(args.trace).write_text(json.dumps(trace, indent=0))
        print(f"trace: {args.trace}")
    if args.json:
        out = {
            "jobs": args.jobs,
            "seconds": took,
            "polls_per_job": polls,
            "idle_per_s": idle_rate,
            "per_job": per_job,
            "per_poll": per_poll,
            "s3_per_job": {k: v / args.jobs for k, v in s3.items()},
            "traced_by_process": dict(by_role),
            "connections": connections,
        }
        Path(args.json).write_text(json.dumps(out, indent=1))


def job_commands(trace: list[tuple[str, list[bytes]]]) -> list[tuple[str, list[bytes]]]:
    """The traced commands that are the job's own: not those Lua scripts ran (their EVALSHA
    is kept), not the worker's heartbeat events, and one blocking pop, the delivery (the
    others in the window are the worker's idle polling, counted as the idle rate)."""
    kept, popped = [], False
    for role, args in trace:
        name = args[0].lower()
        if role == "lua" or name == b"publish" or (name in BLOCKING and popped):
            continue
        popped |= name in BLOCKING
        kept.append((role, args))
    return kept


def round_trips(trace: list[tuple[str, list[bytes]]]) -> list[list[list[bytes]]]:
    """The commands grouped as their clients send them: a transaction (MULTI ... EXEC) in one
    write, as redis-py's pipelines do, every other command on its own."""
    trips, open_multi = [], None
    for _, args in trace:
        name = args[0].lower()
        if name in BLOCKING:
            args = [BLOCKING[name], args[1]]  # the first queue it names, without a timeout
        if open_multi is not None:
            open_multi.append(args)
            if name == b"exec":
                trips.append(open_multi)
                open_multi = None
        elif name == b"multi":
            open_multi = [args]
        else:
            trips.append([args])
    return trips


def queue_command(args: list[bytes]) -> bool:
    """Whether a command is Celery's queue (kombu's Redis transport): the message pushed, popped,
    kept as unacknowledged and acknowledged."""
    return args[0].lower() in (b"lpush", b"rpop") or any(a in CELERY_KEYS for a in args[1:2])


def replay_client(port: int, trips, job_id: bytes, seconds: float, out) -> None:
    conn = redis.Connection(host="127.0.0.1", port=port)
    jobs = commands = errors = 0
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        new = uuid.uuid4().hex.encode()[: len(job_id)]
        for trip in trips:
            trip = [[a.replace(job_id, new) for a in args] for args in trip]
            conn.send_packed_command(conn.pack_commands(trip))
            for _ in trip:
                try:
                    conn.read_response()
                except redis.ResponseError:
                    errors += 1
            commands += len(trip)
        jobs += 1
    out.put((jobs, commands, errors))


def replay(args: argparse.Namespace) -> None:
    data = json.loads(Path(args.trace).read_text())
    job_id = data["job_id"].encode()
    trace = [(c["role"], [base64.b64decode(a) for a in c["args"]]) for c in data["commands"]]
    trace = job_commands(trace)
    trips = round_trips(trace)
    if args.part == "queue":
        trips = [t for t in trips if any(queue_command(c) for c in t)]
    logs = tempfile.TemporaryDirectory(prefix="redis-load-")  # redis-server's log alone
    stack = harness.Stack(Path(logs.name))
    stack.redis_server(shutil.which(args.redis_server) or args.redis_server)
    port = stack.redis_port
    r = redis.Redis(port=port)
    for source in data.get("scripts", []):
        r.script_load(source)
    missing = {a[1] for _, a in trace if a[0].lower() == b"evalsha"}
    if missing and not all(r.script_exists(*missing)):
        print("note: the trace's Lua scripts are not known here; their calls count as errors")
    per_job = sum(len(t) for t in trips)
    print(f"replaying job {data['job_id']} ({args.part}): {per_job} commands, {len(trips)} trips")
    print("| clients | jobs/s | commands/s | Redis CPU (cores) | errors a job |")
    print("|---|---|---|---|---|")
    results = []
    try:
        for n in map(int, args.clients.split(",")):
            r.flushall()
            cpu0 = r.info("cpu")
            start = time.monotonic()
            out = multiprocessing.Queue()
            procs = [
                multiprocessing.Process(
                    target=replay_client, args=(port, trips, job_id, args.seconds, out)
                )
                for _ in range(n)
            ]
            for p in procs:
                p.start()
            done = [out.get() for _ in procs]
            for p in procs:
                p.join()
            wall = time.monotonic() - start
            cpu1 = r.info("cpu")
            cpu = sum(cpu1[k] - cpu0[k] for k in ("used_cpu_sys", "used_cpu_user")) / wall
            jobs, commands, errors = (sum(d[i] for d in done) for i in range(3))
            row = {
                "clients": n,
                "jobs_per_s": jobs / wall,
                "commands_per_s": commands / wall,
                "redis_cpu": cpu,
                "errors_per_job": errors / max(jobs, 1),
            }
            results.append(row)
            print(
                f"| {n} | {row['jobs_per_s']:,.0f} | {row['commands_per_s']:,.0f} | {cpu:.2f} "
                f"| {row['errors_per_job']:.2f} |"
            )
    finally:
        stack.close()
        logs.cleanup()
    if args.json:
        out = {"part": args.part, "commands_per_job": per_job, "rows": results}
        Path(args.json).write_text(json.dumps(out, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="what", required=True)
    c = sub.add_parser("count", help="Redis commands and S3 requests per job, and a trace")
    c.add_argument("--jobs", type=int, default=20)
    c.add_argument("--idle", type=float, default=20.0)
    c.add_argument("--poll", type=float, default=1.0)
    c.add_argument("--clip", default="../shared/audio/dev/en_jfk.flac")
    c.add_argument("--device", default="cpu")
    c.add_argument("--trace", type=Path)
    c.add_argument("--json", type=Path)
    p = sub.add_parser("replay", help="one traced job again and again: what one Redis carries")
    p.add_argument("--trace", type=Path, required=True)
    p.add_argument("--clients", default="1,4,16,64")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--redis-server", default="redis-server")
    p.add_argument(
        "--part", choices=("job", "queue"), default="job", help="the whole job, or Celery's queue"
    )
    p.add_argument("--json", type=Path)
    args = parser.parse_args()
    count(args) if args.what == "count" else replay(args)


if __name__ == "__main__":
    main()
