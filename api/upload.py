"""Stream a multipart upload straight into object storage, enforcing the size cap as it goes.

Starlette's own form parsing spools the whole body to disk before a handler runs; here the
`file` part flows chunk by chunk into an S3 upload, and an oversized or non-audio upload is
refused as soon as it shows itself.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from fastapi import Request
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool

from api.errors import ApiError
from worker.contract.options import PROMPT_MAX_CHARS, JobCreate
from worker.contract.uploads import Head, Inspector

FORM_FIELDS = frozenset(JobCreate.model_fields)  # besides `file`; each at most once
MAX_FIELD_BYTES = 4 * PROMPT_MAX_CHARS  # a whole prompt in UTF-8: its length is checked later
# the body beyond the file: multipart framing, part headers and the small fields
BODY_ALLOWANCE = 64 * 1024
MAX_BOUNDARY = 70  # characters (RFC 2046)
MAX_PART_HEADERS = 8  # per part; a browser sends 2
MAX_PART_HEADER_BYTES = 4096  # one header line: a file name of 255 characters fits


@dataclass
class Upload:
    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    size: int = 0
    head: Head | None = None  # what the file's first bytes say about it
    digest: str = ""  # the file's SHA-256: with the fields, what makes two requests the same


class _Parts:
    """python-multipart callbacks, collecting what the current part is and its data."""

    def __init__(self) -> None:
        self.headers: dict[bytes, bytes] = {}
        self.header_field = b""
        self.header_value = b""
        # What happened during one `write`: ("begin", (name, filename)), ("data", bytes),
        # ("end", None). Several parts can begin and end within one chunk.
        self.events: list[tuple[str, object]] = []
        self.ended = False  # the closing boundary was seen

    def callbacks(self) -> dict:
        return {
            "on_part_begin": self._begin,
            "on_header_field": lambda d, s, e: self._add("header_field", d[s:e]),
            "on_header_value": lambda d, s, e: self._add("header_value", d[s:e]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": lambda d, s, e: self.events.append(("data", bytes(d[s:e]))),
            "on_part_end": lambda: self.events.append(("end", None)),
            "on_end": lambda: setattr(self, "ended", True),
        }

    def _add(self, attr: str, data: bytes) -> None:
        setattr(self, attr, getattr(self, attr) + data)

    def _begin(self) -> None:
        self.headers = {}

    def _header_end(self) -> None:
        self.headers[self.header_field.lower()] = self.header_value
        self.header_field, self.header_value = b"", b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self.headers.get(b"content-disposition", b""))
        name = options.get(b"name", b"").decode("utf-8", "replace")
        filename = options.get(b"filename")
        filename = filename.decode("utf-8", "replace")[:255] if filename else None
        self.events.append(("begin", (name, filename)))


class Sink(Protocol):
    """Where the file's bytes go: an ObjectWriter, or `Discard` (a retry already stored)."""

    def append(self, data: bytes) -> bool: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class Discard:
    def append(self, data: bytes) -> bool:
        return False

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


async def receive_upload(
    request: Request,
    writer: Sink,
    max_bytes: int,
    max_audio_s: float,
    fields: frozenset[str] = FORM_FIELDS,
    before_file: Callable[[dict[str, str]], None] | None = None,
) -> Upload:
    """Parse the multipart body: the `file` part goes to `writer`, small fields are returned.
    `before_file` checks the fields sent before the file, before a byte of it is stored.

    The whole body is capped (the file's `max_bytes` + BODY_ALLOWANCE), with or without a
    Content-Length, and so are the parts: each known field at most once, so at most
    len(FORM_FIELDS) + 1 of them, each with at most MAX_PART_HEADERS headers of at most
    MAX_PART_HEADER_BYTES. Raises ApiError (413 too_large, 422 invalid_request) or, from the
    Inspector, OptionError (413 too_large, 422 invalid_audio / invalid_spectrogram /
    too_long); on any failure the caller undoes what `writer` stored (`ObjectWriter.abort`).
    """
    content_type, params = parse_options_header(request.headers.get("content-type", ""))
    if content_type != b"multipart/form-data" or b"boundary" not in params:
        raise ApiError(
            422, "invalid_request", "expected multipart/form-data with the audio in `file`"
        )
    boundary = params[b"boundary"]
    if not 0 < len(boundary) <= MAX_BOUNDARY:
        raise ApiError(
            422,
            "invalid_request",
            f"the multipart boundary must be 1 to {MAX_BOUNDARY} characters long",
        )
    limit = max_bytes + BODY_ALLOWANCE
    declared = int(request.headers.get("content-length") or 0)
    if declared > limit:
        raise ApiError(
            413, "too_large", f"the upload is {declared} bytes; the limit is {max_bytes}"
        )

    parts = _Parts()
    parser = MultipartParser(
        boundary,
        parts.callbacks(),
        max_header_count=MAX_PART_HEADERS,
        max_header_size=MAX_PART_HEADER_BYTES,
    )
    upload = Upload()
    inspector = Inspector(max_bytes, max_audio_s)
    digest = hashlib.sha256()
    current: str | None = None
    value = bytearray()
    # a field twice is ambiguous (which one counts?): refused, except a list (`name[]`, sent
    # as repeated parts, as the openai client sends them), whose values are joined with ","
    seen: set[str] = set()
    received = 0
    async for chunk in request.stream():
        received += len(chunk)
        if received > limit:
            raise ApiError(
                413,
                "too_large",
                f"the request body is over {limit} bytes (the file's limit is {max_bytes})",
            )
        try:
            parser.write(chunk)
        except MultipartParseError as e:
            raise ApiError(422, "invalid_request", _malformed(e)) from e
        for kind, data in parts.events:
            if kind == "begin":
                (current, filename), value = data, bytearray()
                if current in seen and not current.endswith("[]"):
                    raise ApiError(
                        422,
                        "invalid_request",
                        f"form field {current!r} was sent twice; send each field once "
                        "(one `file` per job)",
                    )
                seen.add(current)
                if current == "file":
                    upload.filename = filename
                    if before_file:
                        before_file(upload.fields)
                elif current not in fields:
                    known = ", ".join(sorted(fields | {"file"}))
                    raise ApiError(
                        422,
                        "invalid_request",
                        f"unknown form field {current!r}; expected {known}",
                    )
            elif kind == "data" and current == "file":
                inspector.feed(data)
                digest.update(data)
                if writer.append(data):
                    await run_in_threadpool(writer.flush)
            elif kind == "data":
                value += data
                if len(value) > MAX_FIELD_BYTES:
                    raise ApiError(
                        422,
                        "invalid_request",
                        f"form field {current!r} is over {MAX_FIELD_BYTES} bytes",
                    )
            elif kind == "end" and current != "file" and current is not None:
                if text := value.decode("utf-8", "replace").strip():  # empty: omitted
                    before = upload.fields.get(current)
                    joined = f"{before},{text}" if before else text
                    if len(joined) > MAX_FIELD_BYTES:  # a list, all its parts together
                        raise ApiError(
                            422,
                            "invalid_request",
                            f"form field {current!r} is over {MAX_FIELD_BYTES} bytes",
                        )
                    upload.fields[current] = joined
        parts.events.clear()
    if "file" not in seen:
        raise ApiError(
            422, "invalid_request", "no `file` part: send the audio as form field `file`"
        )
    if not parts.ended:
        raise ApiError(
            422,
            "invalid_request",
            "the multipart body ends before its closing boundary: the upload is cut short",
        )
    upload.head, upload.size = inspector.finish(), inspector.size
    upload.digest = digest.hexdigest()
    await run_in_threadpool(writer.close)
    return upload


def _malformed(e: MultipartParseError) -> str:
    """What python-multipart found wrong with a body, in the API's words."""
    if "header count" in str(e):
        return f"a multipart part has more than {MAX_PART_HEADERS} headers"
    if "header size" in str(e):
        return f"a multipart part header is over {MAX_PART_HEADER_BYTES} bytes"
    return "the multipart body does not follow the boundary its Content-Type names"
