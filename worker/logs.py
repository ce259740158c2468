"""Log lines of a worker: each says which job it is about. `WHISPERFLEET_LOG_FORMAT=json`
writes one JSON object a line (time, level, logger, process, thread, job_id, message,
exception) for log collectors; `text` (default) the same fields on one readable line."""

from __future__ import annotations

import json
import logging
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
