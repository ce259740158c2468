"""What the API's server logs. Its access log keeps no query string's values: a presigned
URL's signature, a token or a key sent in a query would otherwise sit in every log collector
that reads it. Its start says one line (uvicorn's "running on"), not five."""

from __future__ import annotations

import logging
from urllib.parse import parse_qsl

ACCESS_LOGGER = "uvicorn.access"
SERVER_LOGGER = "uvicorn.error"  # uvicorn's name for its server's own lines
# the server's steps at start and stop, each a line of its own, that say nothing amiss
STEPS = (
    "Started server process",
    "Waiting for application startup",
    "Application startup complete",
    "Waiting for application shutdown",
    "Application shutdown complete",
    "Finished server process",
)


def without_values(path: str) -> str:
    """`/v1/jobs/x?download=url&sig=abc` → `/v1/jobs/x?download=…&sig=…`: which parameters a
    request sent, not what."""
    path, sep, query = path.partition("?")
    names = [name for name, _ in parse_qsl(query, keep_blank_values=True)]
    return path + sep + "&".join(f"{name}=…" for name in names) if sep else path


class RedactQuery(logging.Filter):
    """On uvicorn's access log, whose record's args are (client, method, path, HTTP version,
    status)."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 5 and isinstance(args[2], str):
            record.args = (*args[:2], without_values(args[2]), *args[3:])
        return True


class WithoutSteps(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (isinstance(record.msg, str) and record.msg.startswith(STEPS))


def configure() -> None:
    """Installed once on uvicorn's loggers (create_app may run more than once)."""
    for name, kind in ((ACCESS_LOGGER, RedactQuery), (SERVER_LOGGER, WithoutSteps)):
        logger = logging.getLogger(name)
        if not any(isinstance(f, kind) for f in logger.filters):
            logger.addFilter(kind())
