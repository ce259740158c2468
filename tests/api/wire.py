"""Requests built and sent byte for byte: a multipart body by hand, streamed into the app in
chunks of our choosing (the TestClient sends a body in one piece)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import httpx
from fastapi import FastAPI

BOUNDARY = "wf-boundary-7d3c"
MULTIPART = f"multipart/form-data; boundary={BOUNDARY}"


def multipart(file: bytes, filename: str = "upload", **fields: str) -> bytes:
    """A multipart body: the form `fields` first, then `file`."""
    parts = [
        f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'.encode()
        for name, value in fields.items()
    ]
    head = f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="{filename}"\r\n'
    parts.append(f"{head}Content-Type: application/octet-stream\r\n\r\n".encode() + file + b"\r\n")
    return b"".join(parts) + f"--{BOUNDARY}--\r\n".encode()


def chunked(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)] or [b""]


def post(app: FastAPI, chunks: Iterable[bytes], content_type: str = MULTIPART) -> httpx.Response:
    """POST /v1/jobs with the body as `chunks`, each one ASGI message (no Content-Length).
    The app's lifespan must be running (inside `with TestClient(app)`)."""

    async def body():
        for chunk in chunks:
            yield chunk

    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            return await client.post(
                "/v1/jobs", content=body(), headers={"content-type": content_type}
            )

    return asyncio.run(send())
