"""The API's access log keeps no query string's values: a presigned URL's signature, a token
or a key sent in a query would otherwise sit in every log collector that reads it."""

from __future__ import annotations

import logging
from urllib.parse import parse_qsl

ACCESS_LOGGER = "uvicorn.access"


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


def redact_access_log() -> None:
    logger = logging.getLogger(ACCESS_LOGGER)
    if not any(isinstance(f, RedactQuery) for f in logger.filters):
        logger.addFilter(RedactQuery())
