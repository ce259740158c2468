"""Log lines of a worker: each says which job it is about. `WHISPERFLEET_LOG_FORMAT=json`
writes one JSON object a line (time, level, logger, process, thread, job_id, message,
exception) for log collectors; `text` (default) the same fields on one readable line.

Celery's start-up banner and its INFO lines (a connection made, a message received, a task
succeeded) are left out: each of our Celery workers says in one line of its own what it takes
from which queues (`ready`), and our jobs' lines say what happened to each."""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
from contextvars import ContextVar
from datetime import UTC, datetime

# the job the current thread works on (Celery's threads pool: one job a thread)
current_job: ContextVar[str | None] = ContextVar("current_job", default=None)

TEXT = "%(asctime)s %(levelname)s %(name)s [%(process)d %(threadName)s] job=%(job_id)s: %(message)s"


class _JobId(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.job_id = current_job.get() or "-"
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "process": record.process,
            "thread": record.threadName,
            "job_id": None if record.job_id == "-" else record.job_id,
            "message": record.getMessage(),
        }
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def configure(fmt: str, level: int = logging.INFO) -> None:
    """Send every logger's records (Celery's too) to stderr in `fmt`."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_JobId())
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    logging.getLogger("celery").setLevel(max(level, logging.WARNING))
    # but beat's own lines: each scheduled run it sends, and which beat holds the lock (not its
    # "Starting...": `ready` says that)
    beat = logging.getLogger("celery.beat")
    beat.setLevel(level)
    beat.filters[:] = [lambda record: record.getMessage() != "beat: Starting..."]


def worker_argv(role: str, queues: str, concurrency: int) -> list[str]:
    """`app.worker_main`'s arguments for one of our Celery workers (`role`: its host name's
    part, "whisperfleet-webhooks"), without Celery's banner, gossip or mingle (our workers
    never ask each other anything)."""
    return [
        "--quiet",
        "worker",
        "--loglevel=INFO",
        f"--queues={queues}",
        f"--concurrency={concurrency}",
        f"--hostname={role}-{os.getpid()}@{socket.gethostname()}",
        "--without-gossip",
        "--without-mingle",
    ]


def ready(consumer, takes: str, more: str = "") -> None:
    """The one line a Celery worker of ours logs at start, from `worker_ready`'s sender."""
    queues = ", ".join(q.name for q in consumer.task_consumer.queues)
    threads = consumer.controller.concurrency
    logging.getLogger(__name__).info(
        "%s ready: takes %s from %s with %d threads%s",
        consumer.hostname,
        takes,
        queues,
        threads,
        more,
    )
