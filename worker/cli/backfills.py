"""`whisperfleet backfill`: start, follow, list, cancel and retry backfills through the REST API.

A client of the API (`/v1/backfills`), nothing more: it runs wherever the API is reachable,
with the standard library's HTTP (no torch, no httpx), and the key in WHISPERFLEET_API_KEY.
Errors are one line on stderr, `whisperfleet backfill: <message>`; the exit status is 2 for a
usage error (a bad option value, a 400 or 422 from the API) and 1 for any other (an unknown id,
a missing or wrong key, an API that does not answer).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from datetime import datetime
from typing import IO, Any

from worker.cli.flags import add_voice_flags, voice_fields
from worker.contract.options import Mode, Task, values

PROG = "whisperfleet backfill"
DEFAULT_API_URL = "http://127.0.0.1:8000"
FORMATS = ("json", "srt", "vtt", "text")  # json is always written
FINISHED = ("done", "cancelled")  # and `waiting`, for a scheduled backfill: its run is over
LATEST_FAILURES = 5  # shown by `status`; all are in the manifest
POLL_S = 1.0  # between reads while following
LINE_EVERY_S = 5.0  # without a progress bar: a line this often at most, as files end
QUIET_LINE_EVERY_S = 60.0  # ... and at least this often, if nothing moved
TIMEOUT_S = 30.0  # one HTTP request
OUTAGE_S = 60.0  # while following: how long the API may be away before we give up
USAGE_STATUSES = (400, 422)  # the API judged what was given: a usage error


class CliError(Exception):
    """What the user is told, on one line, and the exit status."""

    def __init__(self, message: str, status: int = 1, transient: bool = False):
        super().__init__(message)
        self.status, self.transient = status, transient


class Client:
    """JSON over HTTP to the API, with the standard library."""

    def __init__(self, base_url: str, key: str | None, timeout: float = TIMEOUT_S):
        parsed = urllib.parse.urlsplit(base_url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise CliError(f"--api-url {base_url!r}: expected http://host:port", 2)
        self.base_url, self.key, self.timeout = base_url.rstrip("/"), key, timeout

    def call(self, method: str, path: str, body: dict | None = None) -> Any:
        url = f"{self.base_url}{path}"
        headers = {"Accept": "application/json", "User-Agent": "whisperfleet-backfill-cli"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        if self.key:
            headers["Authorization"] = f"Bearer {self.key}"
        request = urllib.request.Request(url, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as answer:
                raw = answer.read()
        except urllib.error.HTTPError as e:
            raise self._refusal(e) from None
        except urllib.error.URLError as e:
            raise self._unreachable(e.reason) from None
        except (OSError, http.client.HTTPException) as e:  # reset, timed out, half an answer
            raise self._unreachable(e) from None
        try:
            return json.loads(raw)
        except ValueError:
            raise CliError(f"{url} answered something that is not JSON: is it the API?") from None

    def _unreachable(self, reason: object) -> CliError:
        if isinstance(reason, TimeoutError):
            reason = f"no answer in {self.timeout:g} s"
        elif isinstance(reason, OSError) and reason.strerror:
            reason = reason.strerror
        return CliError(
            f"the API at {self.base_url} did not answer ({reason}); is it running? "
            "(--api-url or WHISPERFLEET_API_URL names it)",
            transient=True,
        )

    def _refusal(self, e: urllib.error.HTTPError) -> CliError:
        try:
            raw = e.read()
        except (OSError, http.client.HTTPException):
            raw = b""
        try:
            error = json.loads(raw)["error"]
            code, message = str(error["code"]), " ".join(str(error["message"]).split())
        except (ValueError, KeyError, TypeError):
            code, message = "", f"{e.code} {e.reason} from {e.url}: is {self.base_url} the API?"
        if e.code == 401:
            if self.key:
                message += " (the key in WHISPERFLEET_API_KEY)"
            else:
                message += "; set WHISPERFLEET_API_KEY to the key"
        elif e.code == 503 and code == "unavailable":
            return CliError(message, transient=True)
        return CliError(message, 2 if e.code in USAGE_STATUSES else 1)

    def backfill(self, backfill_id: str, action: str = "") -> str:
        path = f"/v1/backfills/{urllib.parse.quote(backfill_id, safe='')}"
        return f"{path}/{action}" if action else path


# -- what is shown


def _hours(record: dict) -> str:
    return f"{record['audio_hours']:.2f} h"


def _eta(record: dict) -> str:
    if record["status"] in FINISHED or record["status"] == "waiting":
        return "0:00:00"
    eta = record.get("eta_s")
    if eta is None:
        return "?" if record["status"] != "scanning" else "? (listing)"
    seconds = max(0, round(eta))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def _rate(record: dict) -> str:
    return f"{record['files_per_s']:.2f} files/s, {record['audio_s_per_s']:.1f} audio s/s"


def _when(value: str | None) -> str:
    if not value:
        return "-"
    try:
        moment = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return value
    return moment.strftime("%Y-%m-%d %H:%M:%S %Z").strip()


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def figures(record: dict) -> str:
    """The current run's figures, short: files ended of files made, failures, audio hours,
    rate, ETA, status."""
    run, counts = record["run"], record["counts"]
    eta = _eta(record).removesuffix(" (listing)")
    return (
        f"{run['ended']}/{run['created']} files, {counts['failed']} failed, "
        f"{_hours(record)} audio, {record['files_per_s']:.2f} files/s, ETA {eta} "
        f"[{record['status']}]"
    )


def progress_line(record: dict) -> str:
    """Where the current run stands, on one line (without a progress bar)."""
    run = record["run"]
    over = record["status"] in ("done", "waiting")
    percent = 100 if over else _percent(run["ended"], run["created"])
    line = f"run {run['number']} {percent:3d}%: {figures(record)}"
    return f"{line}; {record['problem']}" if record.get("problem") else line


def _percent(done: int, total: int) -> int:
    return min(100, done * 100 // total) if total else 0


def screen(record: dict, base_url: str) -> str:
    """`status`: the backfill on one screen."""
    spec, run, counts = record["spec"], record["run"], record["counts"]
    rows = [f"backfill {record['id']}: {record['status']}"]
    if record.get("problem"):
        rows.append(f"  problem   {record['problem']}")
    rows.append(f"  source    {spec['source']}")
    what = [f"model {spec.get('model') or 'default'}"]
    if spec.get("language"):
        what.append(f"language {spec['language']}")
    if spec.get("task") and spec["task"] != "transcribe":
        what.append(f"task {spec['task']}")
    what.append("formats " + ", ".join(spec.get("formats") or ["json"]))
    rows.append(f"  output    {record['output']} ({'; '.join(what)})")
    if spec.get("schedule"):
        skipped = record.get("runs_skipped", 0)
        extra = f" ({skipped} scheduled times skipped: a run was still listing)" if skipped else ""
        rows.append(f"  schedule  {spec['schedule']}{extra}")
    rows.append(
        f"  created   {_when(record['created_at'])}"
        + (f", finished {_when(record['finished_at'])}" if record.get("finished_at") else "")
    )
    listed = f"listed to the end {_when(run['scanned_at'])}" if run["scanned_at"] else "listing"
    rows.append(
        f"  run {run['number']:<5} started {_when(run['started_at'])}, {listed}: "
        f"{run['listed']} keys, {run['excluded']} left out, {run['skipped']} done before; "
        f"{run['created']} jobs made, {run['ended']} ended"
    )
    rows.append(
        f"  jobs      {counts['created']} made: {counts['in_flight']} in flight, "
        f"{counts['succeeded']} succeeded, {counts['failed']} failed, "
        f"{counts['cancelled']} cancelled, {counts['retried']} retried"
    )
    rows.append(f"  audio     {_hours(record)} transcribed")
    rows.append(f"  rate      {_rate(record)}; ETA {_eta(record)}")
    by_code = record.get("failed_by_code") or {}
    if by_code:
        codes = ", ".join(f"{code} {n}" for code, n in sorted(by_code.items(), key=_most))
        rows.append(f"  failed    {codes}")
    failures = record.get("failures") or []
    if failures and counts["failed"]:
        rows.append("  latest failures (newest first):")
        for f in failures[:LATEST_FAILURES]:
            rows.append(
                f"    {f.get('source') or f['job_id']}: {f['code']}: {_one_line(f['message'])}"
            )
        if counts["failed"] > min(len(failures), LATEST_FAILURES):
            rows.append(
                f"    ... all {counts['failed']} are in the manifest: "
                f"{base_url}/v1/backfills/{record['id']}/manifest"
            )
        if record["status"] != "cancelled":
            rows.append(f"  run them again: {PROG} retry {record['id']}")
    return "\n".join(rows)


def _most(item: tuple[str, int]) -> tuple[int, str]:
    return (-item[1], item[0])


class Progress:
    """The current run's progress while following: a tqdm bar on a terminal, where tqdm is
    installed; otherwise lines: one at each change of status, one at most every LINE_EVERY_S
    as files end, one every QUIET_LINE_EVERY_S while nothing moves."""

    def __init__(self, backfill_id: str, out: IO[str] = sys.stderr, bar: bool | None = None):
        self.out, self.backfill_id = out, backfill_id
        if bar is None:
            bar = out.isatty()
        self.bar = None
        if bar:
            try:
                from tqdm import tqdm
            except ImportError:
                pass
            else:
                self.bar = tqdm(
                    total=0,
                    file=out,
                    bar_format="{percentage:3.0f}%|{bar:24}| {desc}",
                    dynamic_ncols=True,
                )
        self.last: tuple = ("",)  # what the last line showed: status, ended, made, failed
        self.last_at = 0.0

    def show(self, record: dict, final: bool = False) -> None:
        run, counts = record["run"], record["counts"]
        if self.bar is not None:
            done, total = int(run["ended"]), int(run["created"])
            if final and record["status"] in ("done", "waiting"):
                done, total = (total, total) if total else (1, 1)  # the run is over: 100%
            self.bar.total = total
            self.bar.n = min(done, total)
            self.bar.set_description_str(f"run {run['number']}: {figures(record)}", refresh=False)
            self.bar.refresh()
            return
        now = time.monotonic()
        moved = (record["status"], run["ended"], run["created"], counts["failed"])
        since = now - self.last_at
        if (
            final
            or moved[0] != self.last[0]
            or (moved != self.last and since >= LINE_EVERY_S)
            or since >= QUIET_LINE_EVERY_S
        ):
            print(f"{self.backfill_id} {progress_line(record)}", file=self.out, flush=True)
            self.last, self.last_at = moved, now

    def note(self, message: str) -> None:
        """A line of its own, above the bar."""
        if self.bar is not None:
            self.bar.write(f"{PROG}: {message}", file=self.out)
        else:
            print(f"{PROG}: {message}", file=self.out, flush=True)

    def close(self) -> None:
        """Leave the bar where it stands; what is printed next starts on a fresh line."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def finished(record: dict) -> bool:
    return record["status"] in FINISHED or record["status"] == "waiting"


class Detached(Exception):
    """Ctrl-C while following: the backfill goes on."""


def follow(client: Client, backfill_id: str, out: IO[str] = sys.stderr) -> dict:
    """Read the backfill until its run is over (done, cancelled, or waiting for its next
    scheduled time), showing its progress; the last record read. A short outage of the API is
    waited out (OUTAGE_S)."""
    view = Progress(backfill_id, out)
    away_since = None
    try:
        while True:
            try:
                record = client.call("GET", client.backfill(backfill_id))
            except CliError as e:
                if not e.transient:
                    raise
                if away_since is None:
                    away_since = time.monotonic()
                    view.note(f"{e}; trying again for {OUTAGE_S:g} s")
                elif time.monotonic() - away_since > OUTAGE_S:
                    raise
                time.sleep(POLL_S * 2)
                continue
            away_since = None
            if finished(record):
                view.show(record, final=True)
                return record
            view.show(record)
            time.sleep(POLL_S)
    except KeyboardInterrupt:
        raise Detached from None
    finally:
        view.close()


# -- the subcommands


def _client(args: argparse.Namespace) -> Client:
    url = args.api_url or os.environ.get("WHISPERFLEET_API_URL") or DEFAULT_API_URL
    return Client(url, os.environ.get("WHISPERFLEET_API_KEY") or None)


def _extensions(given: list[str] | None) -> list[str] | None:
    if given is None:
        return None
    return [e.strip() for text in given for e in text.split(",") if e.strip()]


def _start(args: argparse.Namespace, client: Client) -> int:
    body: dict[str, Any] = {"source": args.source}
    optional = {
        "include": args.include,
        "exclude": args.exclude,
        "extensions": _extensions(args.ext),
        "modified_since": args.modified_since,
        "model": args.model,
        "language": args.language,
        "task": args.task,
        "mode": args.mode,
        "prompt": args.prompt,
        "temperature": args.temperature,
        "seed": args.seed,
        **voice_fields(args),
        "output": args.output,
        "formats": args.formats,
        "schedule": args.schedule,
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    if args.timestamps is False:
        body["timestamps"] = False
    record = client.call("POST", "/v1/backfills", body)
    print(record["id"], flush=True)
    spec = record["spec"]
    when = f", again {spec['schedule']}" if spec.get("schedule") else ""
    print(
        f"backfill {record['id']} started: {spec['source']} with {spec.get('model')}{when}; "
        f"outputs under {record['output']}",
        file=sys.stderr,
        flush=True,
    )
    if args.follow:
        return _follow(client, record["id"])
    print(f"follow it: {PROG} status {record['id']} --follow", file=sys.stderr)
    return 0


def _follow(client: Client, backfill_id: str, as_json: bool = False) -> int:
    try:
        record = follow(client, backfill_id)
    except Detached:
        print(
            f"{PROG}: detached; backfill {backfill_id} goes on (not cancelled). "
            f"Follow it again: {PROG} status {backfill_id} --follow; stop it: "
            f"{PROG} cancel {backfill_id}",
            file=sys.stderr,
        )
        return 130
    _show(record, client, as_json)
    return 0


def _show(record: dict, client: Client, as_json: bool) -> None:
    print(json.dumps(record, indent=1) if as_json else screen(record, client.base_url), flush=True)


def _status(args: argparse.Namespace, client: Client) -> int:
    if args.follow:
        return _follow(client, args.id, args.json)
    _show(client.call("GET", client.backfill(args.id)), client, args.json)
    return 0


def _list(args: argparse.Namespace, client: Client) -> int:
    records: list[dict] = []
    cursor = None
    while len(records) < args.limit:
        query = {"limit": min(100, args.limit - len(records))}
        if cursor:
            query["cursor"] = cursor
        page = client.call("GET", f"/v1/backfills?{urllib.parse.urlencode(query)}")
        records += page["data"]
        cursor = page.get("next_cursor")
        if not cursor:
            break
    if args.json:
        print(json.dumps(records, indent=1))
        return 0
    if not records:
        print("no backfills", file=sys.stderr)
        return 0
    print(
        f"{'id':<28}{'status':<11}{'run':>4}{'files':>14}{'failed':>8}{'audio h':>9}  "
        f"{'created':<21}source"
    )
    for r in records:
        run = r["run"]
        files = f"{run['ended']}/{run['created']}"
        created = _when(r["created_at"]).removesuffix(" UTC")
        print(
            f"{r['id']:<28}{r['status']:<11}{run['number']:>4}{files:>14}"
            f"{r['counts']['failed']:>8}{r['audio_hours']:>9.2f}  {created:<21}"
            f"{r['spec']['source']}"
        )
    if cursor:
        print(f"(newest {len(records)} shown; more with --limit)", file=sys.stderr)
    return 0


def _cancel(args: argparse.Namespace, client: Client) -> int:
    record = client.call("DELETE", client.backfill(args.id))
    if record["status"] == "done":
        print(f"backfill {record['id']} was done already; nothing to cancel")
    else:
        print(
            f"backfill {record['id']} cancelled: no more jobs or scheduled runs; its queued "
            "jobs are cancelled, running ones finish"
        )
    return 0


def _retry(args: argparse.Namespace, client: Client) -> int:
    record = client.call("POST", client.backfill(args.id, "retry"))
    failed = record["counts"]["failed"]
    if failed:
        print(
            f"backfill {record['id']}: {failed} failed objects are run again; follow it: "
            f"{PROG} status {record['id']} --follow"
        )
    else:
        print(f"backfill {record['id']}: no failed jobs to run again")
    return 0


ACTIONS = {
    "start": _start,
    "status": _status,
    "list": _list,
    "cancel": _cancel,
    "retry": _retry,
}


def run(args: argparse.Namespace) -> int:
    try:
        return ACTIONS[args.action](args, _client(args))
    except CliError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return e.status
    except KeyboardInterrupt:
        print(f"\n{PROG}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `... | head`: the rest is not wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


# -- the parser


def _limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError("at least 1")
    return value


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """`backfill` and its subcommands, under `whisperfleet`."""
    api_help = (
        f"the API (default: WHISPERFLEET_API_URL, else {DEFAULT_API_URL}); the key is read "
        "from WHISPERFLEET_API_KEY"
    )
    common = argparse.ArgumentParser(add_help=False)
    # given after the subcommand: set only when given, so one given before it stays
    common.add_argument("--api-url", default=argparse.SUPPRESS, help=api_help)

    p = subparsers.add_parser(
        "backfill",
        help="transcribe a storage prefix in the background, through the API: start, "
        "status, list, cancel, retry",
        description=__doc__.split("\n\n")[0],
    )
    p.add_argument("--api-url", default=None, help=api_help)
    p.set_defaults(func=run)
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")

    s = actions.add_parser(
        "start",
        parents=[common],
        help="start a backfill on s3://bucket/prefix/; prints its id",
        description="Transcribe every audio object under the prefix once (and, with "
        "--schedule, the new ones at each scheduled time). Prints the backfill's id.",
    )
    s.add_argument("source", metavar="S3_URI", help="s3://bucket/prefix/")
    s.add_argument(
        "--include",
        action="append",
        metavar="GLOB",
        help="only keys (below the prefix) matching this glob; `*` spans `/` (repeat)",
    )
    s.add_argument(
        "--exclude", action="append", metavar="GLOB", help="leave out matching keys (repeat)"
    )
    s.add_argument(
        "--ext",
        action="append",
        metavar="EXTS",
        help="extensions taken, comma-separated (flac,wav); --ext '' takes any; "
        "default: the audio ones",
    )
    s.add_argument(
        "--modified-since",
        metavar="ISO",
        help="only objects last modified at or after this time (2026-01-31T00:00:00Z)",
    )
    s.add_argument("--model", help="a model the server serves (default: its default)")
    s.add_argument("--language", help="ISO 639-1 code; omitted: detected")
    s.add_argument(
        "--task", choices=values(Task), help="translate: into English (default: transcribe)"
    )
    s.add_argument("--mode", choices=values(Mode), help="for long audio")
    s.add_argument("--prompt", help="text as if it came before the audio (names, spellings)")
    s.add_argument("--temperature", type=float, help="first temperature of the fallback, 0-1")
    s.add_argument("--seed", type=int, help="for sampling")
    s.add_argument(
        "--no-timestamps",
        dest="timestamps",
        action="store_const",
        const=False,
        help="no segment timestamps",
    )
    add_voice_flags(s)
    s.add_argument("--output", metavar="S3_URI", help="s3://bucket/prefix/ for the outputs")
    s.add_argument(
        "--format",
        dest="formats",
        action="append",
        choices=FORMATS,
        help="rendered copies besides json (repeat: --format srt --format vtt)",
    )
    s.add_argument(
        "--schedule",
        metavar="CRON",
        help="run again for new objects: five cron fields (UTC), @hourly, @daily, @nightly, "
        "@weekly, @monthly or '@every 10m'",
    )
    s.add_argument("--follow", action="store_true", help="then follow it, as `status --follow`")

    s = actions.add_parser("status", parents=[common], help="where a backfill stands")
    s.add_argument("id", metavar="ID")
    s.add_argument(
        "--follow",
        action="store_true",
        help="a live progress bar until it is done, cancelled or waiting for its next run; "
        "Ctrl-C detaches (the backfill goes on)",
    )
    s.add_argument("--json", action="store_true", help="the API's record, as JSON")

    s = actions.add_parser("list", parents=[common], help="the backfills, newest first")
    s.add_argument("--limit", type=_limit, default=50, help="at most this many (default 50)")
    s.add_argument("--json", action="store_true", help="the API's records, as a JSON list")

    s = actions.add_parser(
        "cancel",
        parents=[common],
        help="no more jobs or scheduled runs; queued jobs cancelled, running ones finish",
    )
    s.add_argument("id", metavar="ID")

    s = actions.add_parser("retry", parents=[common], help="run its failed objects again")
    s.add_argument("id", metavar="ID")
    return p
