"""`whisperfleet backfill`, the command line for backfills, against a real API and scanner (as
processes, on Redis db 9 and moto's S3 server). No GPU worker: the objects are ones the scanner
refuses at once (not audio, empty, too long by their header) or leaves out, so a backfill ends
`done` without one; the jobs of a retry wait in the queue, which is what `--follow`'s Ctrl-C
and `cancel` need."""

from __future__ import annotations

import io
import json
import os
import re
import select
import signal
import struct
import subprocess
import sys
import time
import uuid
import wave

import pytest
import redis

from tests import conftest
from tests.conftest import free_port, stop, wait_for_port
from worker.cli.backfills import Progress, progress_line, screen
from worker.contract.settings import Settings
from worker.contract.tenants import Tenants
from worker.storage import Storage

pytestmark = pytest.mark.slow
REDIS_URL = f"{conftest.REDIS_URL}/9"
ID = re.compile(r"^bf_[0-9a-f]{24}$")
NOT_AUDIO = b"this is not audio at all " * 4


def long_wav_header(seconds: int) -> bytes:
    """A 44-byte WAV whose header says it lasts `seconds` (16 kHz mono, 16-bit)."""
    rate, data = 16000 * 2, 16000 * 2 * seconds
    fmt = struct.pack("<HHIIHH", 1, 1, 16000, rate, 2, 16)
    return (
        b"RIFF"
        + struct.pack("<I", 36 + data)
        + b"WAVEfmt "
        + struct.pack("<I", 16)
        + fmt
        + (b"data" + struct.pack("<I", data))
    )


class Stack:
    def __init__(self, url: str, keyed_url: str, source: str, env: dict, key: str, storage):
        self.url, self.keyed_url, self.source, self.env, self.key = url, keyed_url, source, env, key
        self.storage = storage

    def cli(self, *args: str, url: str | None = None, key: str | None = None, timeout=60):
        env = {k: v for k, v in self.env.items() if k != "WHISPERFLEET_API_KEY"}
        env["WHISPERFLEET_API_URL"] = url or self.url
        if key:
            env["WHISPERFLEET_API_KEY"] = key
        return subprocess.run(
            [sys.executable, "-m", "worker.cli", "backfill", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def record(self, backfill_id: str) -> dict:
        shown = self.cli("status", backfill_id, "--json")
        assert shown.returncode == 0, shown.stderr
        return json.loads(shown.stdout)


@pytest.fixture(scope="module")
def stack(s3_endpoint, tmp_path_factory):
    redis.Redis.from_url(REDIS_URL).flushdb()
    run = uuid.uuid4().hex[:10]
    source = f"bfcli-src-{run}"
    env = {
        "WHISPERFLEET_REDIS_URL": REDIS_URL,
        "WHISPERFLEET_S3_ENDPOINT_URL": s3_endpoint,
        "WHISPERFLEET_S3_BUCKET": f"bfcli-svc-{run}",
        "WHISPERFLEET_TENANT_SOURCES": f"s3://{source}/",
        "WHISPERFLEET_MAX_AUDIO_S": "60",
        "WHISPERFLEET_METRICS_PORT": "0",
        "WHISPERFLEET_AUTH": "none",
    }
    settings = Settings(**{k.removeprefix("WHISPERFLEET_").lower(): v for k, v in env.items()})
    storage = Storage(settings)
    storage.ensure_bucket()
    storage.client.create_bucket(Bucket=source)
    objects = {
        "calls/a.flac": NOT_AUDIO,
        "calls/sub/x.wav": b"",
        "calls/long.wav": long_wav_header(3600),
        "calls/notes.txt": b"not a sound",  # not an audio extension: left out
        "calls/skip/y.flac": NOT_AUDIO,  # left out by --exclude
        "retry/b.flac": NOT_AUDIO,
        "retry/c.wav": b"",
        "sched/d.flac": NOT_AUDIO,
    }
    for key, body in objects.items():
        storage.client.put_object(Bucket=source, Key=key, Body=body)
    key, _ = Tenants(redis.Redis.from_url(REDIS_URL), settings).create_key("acme")

    logs = tmp_path_factory.mktemp("backfill-cli")
    full = {**os.environ, **env}
    cli = [sys.executable, "-m", "worker.cli"]
    port, keyed_port = free_port(), free_port()
    procs = {}
    with (
        open(logs / "api.log", "w") as alog,
        open(logs / "keyed-api.log", "w") as klog,
        open(logs / "scanner.log", "w") as slog,
    ):
        procs["api"] = subprocess.Popen(
            [*cli, "api", "--port", str(port)], env=full, stdout=alog, stderr=alog
        )
        procs["keyed-api"] = subprocess.Popen(
            [*cli, "api", "--port", str(keyed_port)],
            env={**full, "WHISPERFLEET_AUTH": "keys"},
            stdout=klog,
            stderr=klog,
        )
        procs["scanner"] = subprocess.Popen([*cli, "scanner"], env=full, stdout=slog, stderr=slog)
    try:
        wait_for_port(port, procs["api"])
        wait_for_port(keyed_port, procs["keyed-api"])
        urls = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{keyed_port}"
        yield Stack(*urls, source, full, key, storage)
    finally:
        for proc in procs.values():
            stop(proc)
        for name in procs:
            text = (logs / f"{name}.log").read_text()
            sys.stderr.write(f"--- {name}.log (tail)\n{text[-3000:]}\n")


def one_error_line(result: subprocess.CompletedProcess, status: int) -> str:
    """The command failed with `status`, saying why on one line of stderr."""
    assert result.returncode == status, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("whisperfleet backfill: ")
    return lines[0]


@pytest.fixture(scope="module")
def finished(stack) -> str:
    """A backfill started without --follow, then followed to its end by `status --follow`."""
    started = stack.cli(
        "start", f"s3://{stack.source}/calls/", "--exclude", "skip/*", "--format", "srt"
    )
    assert started.returncode == 0, started.stderr
    backfill_id = started.stdout.strip()
    assert ID.match(backfill_id), started.stdout
    assert f"s3://{stack.source}/calls/" in started.stderr  # the one-line summary
    return backfill_id


def test_status_follow_ends_and_shows_the_failures_with_reasons(stack, finished):
    followed = stack.cli("status", finished, "--follow")
    assert followed.returncode == 0, followed.stderr
    assert "Traceback" not in followed.stderr
    progress = followed.stderr.strip().splitlines()
    assert progress[-1].startswith(f"{finished} run 1 100%: 3/3 files, 3 failed"), progress
    assert progress[-1].endswith("ETA 0:00:00 [done]")
    out = followed.stdout
    assert f"backfill {finished}: done" in out
    assert "5 keys, 2 left out" in out  # notes.txt and skip/y.flac
    assert "invalid_audio 2, too_long 1" in out
    src = f"s3://{stack.source}/calls"
    assert f"{src}/sub/x.wav: invalid_audio: the file is empty" in out
    assert f"{src}/a.flac: invalid_audio: the file is not audio" in out
    assert f"{src}/long.wav: too_long: the WAV header says 3600.0 s; the limit is 60 s" in out
    assert f"whisperfleet backfill retry {finished}" in out

    plain = stack.cli("status", finished)  # the same screen, at once
    assert plain.returncode == 0 and plain.stdout.strip() == out.strip()
    record = stack.record(finished)
    assert record["status"] == "done" and record["counts"]["failed"] == 3


def second_of_wav() -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(b"\0\0" * 16000)
    return out.getvalue()


def test_list_shows_it(stack, finished):
    assert stack.cli("status", finished, "--follow").returncode == 0  # it is done
    listed = stack.cli("list")
    assert listed.returncode == 0, listed.stderr
    header, *rows = listed.stdout.splitlines()
    assert header.split()[:3] == ["id", "status", "run"]
    [row] = [r for r in rows if r.startswith(finished)]
    assert row.split()[1:5] == ["done", "1", "3/3", "3"]
    assert row.endswith(f"s3://{stack.source}/calls/")
    as_json = json.loads(stack.cli("list", "--json").stdout)
    assert finished in [r["id"] for r in as_json]


def test_start_follow_retry_detach_and_cancel(stack):
    """start --follow to the end; retry (its jobs then wait in the queue: no worker);
    Ctrl-C on `status --follow` detaches and leaves it running; cancel; no retry after that."""
    started = stack.cli("start", f"s3://{stack.source}/retry/", "--follow")
    assert started.returncode == 0, started.stderr
    backfill_id = started.stdout.splitlines()[0]
    assert ID.match(backfill_id)
    assert f"backfill {backfill_id}: done" in started.stdout
    assert "invalid_audio 2" in started.stdout

    for key in ("retry/b.flac", "retry/c.wav"):  # the objects fixed: a retry inspects them again
        stack.storage.client.put_object(Bucket=stack.source, Key=key, Body=second_of_wav())
    retried = stack.cli("retry", backfill_id)
    assert retried.returncode == 0, retried.stderr
    assert "2 failed objects are run again" in retried.stdout
    deadline = time.monotonic() + 20
    while (record := stack.record(backfill_id))["counts"]["retried"] < 2:
        assert time.monotonic() < deadline, record
        time.sleep(0.3)
    assert record["status"] == "running" and record["counts"]["in_flight"] == 2

    env = {**stack.env, "WHISPERFLEET_API_URL": stack.url}
    env.pop("WHISPERFLEET_API_KEY", None)
    following = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "backfill", "status", backfill_id, "--follow"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # Ctrl-C reaches it even where this test runs with SIGINT ignored (in the background)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        ready, _, _ = select.select([following.stderr], [], [], 30)
        assert ready, "no progress line in 30 s"
        first = following.stderr.readline()
        assert first.startswith(f"{backfill_id} run 1  50%: 2/4 files"), first
        following.send_signal(signal.SIGINT)
        out, err = following.communicate(timeout=15)
    finally:
        stop(following)
    assert following.returncode == 130, err
    assert "Traceback" not in err
    assert "detached" in err and "not cancelled" in err
    assert stack.record(backfill_id)["status"] == "running"

    cancelled = stack.cli("cancel", backfill_id)
    assert cancelled.returncode == 0, cancelled.stderr
    assert f"backfill {backfill_id} cancelled" in cancelled.stdout
    record = stack.record(backfill_id)
    assert record["status"] == "cancelled" and record["counts"]["in_flight"] == 0
    assert record["counts"]["cancelled"] == 2
    refused = one_error_line(stack.cli("retry", backfill_id), 1)
    assert "cancelled backfill is not retried" in refused


def test_cancel_a_scheduled_backfill(stack):
    started = stack.cli(
        "start", f"s3://{stack.source}/sched/", "--schedule", "@every 10s", "--follow"
    )
    assert started.returncode == 0, started.stderr
    backfill_id = started.stdout.splitlines()[0]
    assert f"backfill {backfill_id}: waiting" in started.stdout  # its run is over
    assert "schedule  @every 10s" in started.stdout
    assert "100%" in started.stderr.splitlines()[-1]

    cancelled = stack.cli("cancel", backfill_id)
    assert cancelled.returncode == 0, cancelled.stderr
    assert "cancelled" in cancelled.stdout
    assert stack.record(backfill_id)["status"] == "cancelled"
    assert "cancelled" in stack.cli("status", backfill_id).stdout.splitlines()[0]
    again = stack.cli("cancel", backfill_id)  # answered as it is
    assert again.returncode == 0 and stack.record(backfill_id)["status"] == "cancelled"


def test_an_unknown_id_is_one_line_and_status_1(stack):
    for action in ("status", "cancel", "retry"):
        line = one_error_line(stack.cli(action, "bf_" + "0" * 24), 1)
        assert line == f"whisperfleet backfill: no backfill bf_{'0' * 24}"


def test_usage_errors_are_status_2(stack):
    bad_source = one_error_line(stack.cli("start", "s3://Not_A_Bucket!/x/"), 2)
    assert "not a valid bucket name" in bad_source
    often = stack.cli("start", f"s3://{stack.source}/x/", "--schedule", "@every 1s")
    assert "at least every 10 s" in one_error_line(often, 2)
    hot = one_error_line(stack.cli("start", f"s3://{stack.source}/x/", "--temperature", "3"), 2)
    assert "temperature" in hot
    bad_url = one_error_line(stack.cli("list", url="localhost:8000"), 2)
    assert "expected http://host:port" in bad_url
    not_a_number = stack.cli("start", f"s3://{stack.source}/x/", "--temperature", "warm")
    assert not_a_number.returncode == 2 and "invalid float value" in not_a_number.stderr


def test_a_key_is_asked_for_where_the_api_wants_one(stack):
    anonymous = one_error_line(stack.cli("list", url=stack.keyed_url), 1)
    assert "API key" in anonymous and "WHISPERFLEET_API_KEY" in anonymous
    wrong = one_error_line(stack.cli("list", url=stack.keyed_url, key="wf_nope_nope"), 1)
    assert "unknown or revoked" in wrong
    # acme's key: acme has no backfills (the others are tenant `default`'s)
    mine = stack.cli("list", url=stack.keyed_url, key=stack.key)
    assert mine.returncode == 0, mine.stderr
    assert mine.stdout == "" and "no backfills" in mine.stderr


def test_an_api_that_does_not_answer_is_named(stack):
    url = f"http://127.0.0.1:{free_port()}"
    for args in (["list"], ["status", "bf_" + "0" * 24], ["start", "s3://b/p/"]):
        line = one_error_line(stack.cli(*args, url=url), 1)
        assert f"the API at {url} did not answer" in line


# -- what the progress shows, in process


def record(status="running", ended=2, created=4, failed=1, hours=0.1 + 0.2, eta=-3.0):
    return {
        "id": "bf_" + "1" * 24,
        "status": status,
        "run": {"number": 2, "ended": ended, "created": created},
        "counts": {"failed": failed},
        "audio_hours": hours,
        "files_per_s": 0.5,
        "audio_s_per_s": 12.345,
        "eta_s": eta,
    }


def test_progress_is_rounded_never_negative_and_ends_at_100():
    line = progress_line(record())
    assert line == (
        "run 2  50%: 2/4 files, 1 failed, 0.30 h audio, 0.50 files/s, ETA 0:00:00 [running]"
    )
    assert "ETA ? [scanning]" in progress_line(record("scanning", eta=None))
    assert progress_line(record("done", ended=0, created=0)).startswith("run 2 100%: 0/0 files")

    out = io.StringIO()
    bar = Progress("bf_x", out, bar=True)
    bar.show(record(eta=7261.4))
    bar.show(record("done", ended=0, created=0), final=True)  # nothing to do: still 100%
    bar.close()
    shown = out.getvalue()
    assert "ETA 2:01:01 [running]" in shown and "0.30000" not in shown
    assert shown.rstrip("\n").rsplit("\r", 1)[-1].startswith("100%|")
    assert shown.endswith("\n")  # what comes next starts on a fresh line

    lines = io.StringIO()
    plain = Progress("bf_x", lines, bar=False)
    for _ in range(3):
        plain.show(record())  # nothing moved: one line
    plain.show(record("done", ended=4, created=4), final=True)
    shown = [s.split(":")[0] for s in lines.getvalue().splitlines()]
    assert shown == ["bf_x run 2  50%", "bf_x run 2 100%"]


def test_without_tqdm_the_progress_is_lines(monkeypatch):
    """Where only the API's dependencies are installed (tqdm comes with the engine)."""
    monkeypatch.setitem(sys.modules, "tqdm", None)
    out = io.StringIO()
    progress = Progress("bf_x", out, bar=True)
    progress.show(record("done", ended=4, created=4), final=True)
    progress.close()
    assert out.getvalue() == (
        "bf_x run 2 100%: 4/4 files, 1 failed, 0.30 h audio, 0.50 files/s, ETA 0:00:00 [done]\n"
    )


def test_the_status_screen_without_failures_says_nothing_of_them():
    full = {
        **record("done", ended=0, created=0, failed=0),
        "spec": {"source": "s3://b/p/", "model": "tiny.en", "formats": ["json"]},
        "output": "s3://svc/out/",
        "created_at": "2026-01-02T03:04:05Z",
        "finished_at": None,
        "counts": {
            k: 0 for k in ("created", "in_flight", "succeeded", "failed", "cancelled", "retried")
        },
        "failed_by_code": {},
        "failures": [{"source": "s3://b/p/a", "job_id": "j", "code": "x", "message": "old"}],
    }
    started = {"started_at": "2026-01-02T03:04:05Z", "scanned_at": None}
    full["run"] = {**full["run"], **started, "listed": 0, "excluded": 0, "skipped": 0}
    text = screen(full, "http://api")
    assert text.splitlines()[0] == f"backfill {full['id']}: done"
    assert "created   2026-01-02 03:04:05 UTC" in text
    assert "failure" not in text and "retry" not in text


def test_a_backfill_held_up_says_why():
    problem = "storage answered NoSuchBucket to ListObjectsV2; tried again"
    assert progress_line({**record("scanning"), "problem": problem}).endswith(f"; {problem}")
    full = {
        **record("scanning", ended=0, created=0, failed=0),
        "problem": problem,
        "spec": {"source": "s3://gone/p/", "model": "tiny.en", "formats": ["json"]},
        "output": "s3://svc/out/",
        "created_at": "2026-01-02T03:04:05Z",
        "finished_at": None,
        "counts": {
            k: 0 for k in ("created", "in_flight", "succeeded", "failed", "cancelled", "retried")
        },
    }
    started = {"started_at": "2026-01-02T03:04:05Z", "scanned_at": None}
    full["run"] = {**full["run"], **started, "listed": 0, "excluded": 0, "skipped": 0}
    assert screen(full, "http://api").splitlines()[1] == f"  problem   {problem}"
