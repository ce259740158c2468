"""Stream a multipart upload straight into object storage, enforcing the size cap as it goes.

Starlette's own form parsing spools the whole body to disk before a handler runs; here the
`file` part flows chunk by chunk into an S3 upload, and an oversized or non-audio upload is
refused as soon as it shows itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool

from api.errors import ApiError
from worker.inputs import EXPECTED, Sniffed, sniff
from worker.storage import ObjectWriter

FORM_FIELDS = {"model", "language", "task", "priority", "input"}
SNIFF_BYTES = 16
MAX_FIELD_BYTES = 1024


@dataclass
class Upload:
    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    size: int = 0
    sniffed: Sniffed | None = None


class _Parts:
    """python-multipart callbacks, collecting what the current part is and its data."""

    def __init__(self) -> None:
        self.headers: dict[bytes, bytes] = {}
        self.header_field = b""
        self.header_value = b""
        # What happened during one `write`: ("begin", (name, filename)), ("data", bytes),
        # ("end", None). Several parts can begin and end within one chunk.
        self.events: list[tuple[str, object]] = []

    def callbacks(self) -> dict:
        return {
            "on_part_begin": self._begin,
            "on_header_field": lambda d, s, e: self._add("header_field", d[s:e]),
            "on_header_value": lambda d, s, e: self._add("header_value", d[s:e]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": lambda d, s, e: self.events.append(("data", bytes(d[s:e]))),
            "on_part_end": lambda: self.events.append(("end", None)),
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


async def receive_upload(request: Request, writer: ObjectWriter, max_bytes: int) -> Upload:
    """Parse the multipart body: the `file` part goes to `writer`, small fields are returned.

    Raises ApiError (413 too_large, 422 invalid_audio / invalid_request) and aborts the
    storage upload on any failure.
    """
    content_type, params = parse_options_header(request.headers.get("content-type", ""))
    if content_type != b"multipart/form-data" or b"boundary" not in params:
        raise ApiError(
            422, "invalid_request", "expected multipart/form-data with the audio in `file`"
        )
    declared = int(request.headers.get("content-length") or 0)
    if declared > max_bytes + 64 * 1024:  # room for the multipart framing and small fields
        raise ApiError(
            413, "too_large", f"the upload is {declared} bytes; the limit is {max_bytes}"
        )

    parts = _Parts()
    parser = MultipartParser(params[b"boundary"], parts.callbacks())
    upload = Upload()
    current: str | None = None
    value = bytearray()
    head = bytearray()
    seen_file = False
    try:
        async for chunk in request.stream():
            parser.write(chunk)
            for kind, data in parts.events:
                if kind == "begin":
                    (current, filename), value = data, bytearray()
                    if current == "file":
                        if seen_file:
                            raise ApiError(422, "invalid_request", "send one `file` per job")
                        seen_file, upload.filename = True, filename
                    elif current not in FORM_FIELDS:
                        known = ", ".join(sorted(FORM_FIELDS | {"file"}))
                        raise ApiError(
                            422,
                            "invalid_request",
                            f"unknown form field {current!r}; expected {known}",
                        )
                elif kind == "data" and current == "file":
                    upload.size += len(data)
                    if upload.size > max_bytes:
                        raise ApiError(
                            413, "too_large", f"the file is over the limit of {max_bytes} bytes"
                        )
                    if upload.sniffed is None:
                        head += data[: SNIFF_BYTES - len(head)]
                        if len(head) >= SNIFF_BYTES:
                            upload.sniffed = _check_sniffed(bytes(head))
                    await run_in_threadpool(writer.write, data)
                elif kind == "data":
                    value += data
                    if len(value) > MAX_FIELD_BYTES:
                        raise ApiError(
                            422, "invalid_request", f"form field {current!r} is too long"
                        )
                elif kind == "end" and current != "file" and current is not None:
                    upload.fields[current] = value.decode("utf-8", "replace").strip()
            parts.events.clear()
        parser.finalize()
        if not seen_file:
            raise ApiError(
                422, "invalid_request", "no `file` part: send the audio as form field `file`"
            )
        if upload.size == 0:
            raise ApiError(422, "invalid_audio", f"the file is empty; {EXPECTED}")
        if upload.sniffed is None:
            upload.sniffed = _check_sniffed(bytes(head))
        await run_in_threadpool(writer.close)
    except BaseException:
        await run_in_threadpool(writer.abort)
        raise
    return upload


def _check_sniffed(head: bytes) -> Sniffed:
    sniffed = sniff(head)
    if sniffed.format == "npy":
        raise ApiError(
            422, "invalid_spectrogram", "spectrogram (.npy) input is not supported yet; send audio"
        )
    if not sniffed.supported:
        found = f"a {sniffed.format.upper()} file" if sniffed.format else "not audio"
        raise ApiError(422, "invalid_audio", f"the file is {found}; {EXPECTED}")
    return sniffed
