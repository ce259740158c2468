"""Errors as `{"error": {"code": ..., "message": ...}}`, with codes a program can branch on.

Every answer is JSON, whatever failed: Redis or storage out of reach is 503 `unavailable` with
`Retry-After`; anything unforeseen is 500 `internal`, its detail in the log, not the answer.
"""

from __future__ import annotations

import logging

import botocore.exceptions
import kombu.exceptions
import redis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from worker.contract.options import OptionError

log = logging.getLogger(__name__)

RETRY_AFTER_S = 5
# Redis (records and queue) or storage did not answer: the request may succeed later
UNAVAILABLE: dict[type[Exception], str] = {
    redis.ConnectionError: "the job store",
    redis.TimeoutError: "the job store",
    kombu.exceptions.OperationalError: "the job queue",
    botocore.exceptions.ConnectionError: "object storage",  # refused, connect timeout, DNS
    botocore.exceptions.HTTPClientError: "object storage",  # read timeout, connection reset
    botocore.exceptions.ClientError: "object storage",  # only 5xx: see _unreachable
}


def _unreachable(e: Exception) -> str | None:
    """The dependency that `e` says is out of reach, or None: an answer of storage is a fault
    of storage only when it is a 5xx (503 SlowDown, 500 InternalError, after boto's retries)."""
    if isinstance(e, botocore.exceptions.ClientError):
        if e.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) < 500:
            return None
    return next((what for kind, what in UNAVAILABLE.items() if isinstance(e, kind)), None)


class ErrorDetail(BaseModel):
    code: str
    message: str


class ErrorBody(BaseModel):
    error: ErrorDetail


def error_answers(*statuses: int) -> dict[int, dict]:
    """OpenAPI `responses` for these statuses, each answered with an ErrorBody."""
    return {status: {"model": ErrorBody} for status in statuses}


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.headers = headers or {}


def _body(status: int, code: str, message: str, **headers: str) -> JSONResponse:
    content = {"error": {"code": code, "message": message}}
    return JSONResponse(status_code=status, content=content, headers=headers or None)


class _Internal:
    """The last resort: an exception nothing else answered is logged with its traceback and
    answered 500 `internal` in JSON (Starlette's own answer is plain text, and it hands the
    exception on to the server, which would log it a second time)."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watch(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception:
            log.exception("%s %s failed", scope["method"], scope["path"])
            if started:  # too late for an answer of our own
                raise
            message = "the server failed on this request; the failure is logged"
            await _body(500, "internal", message)(scope, receive, send)


METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


def _allowed(request: Request) -> list[str]:
    """The methods some route answers at this request's path."""
    routes = request.app.router.routes
    return [
        method
        for method in METHODS
        if any(r.matches({**request.scope, "method": method})[0] is Match.FULL for r in routes)
    ]


def install_error_handlers(app: FastAPI) -> None:
    app.add_middleware(_Internal)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return _body(e.status, e.code, e.message, **e.headers)

    @app.exception_handler(OptionError)
    async def _option(request: Request, e: OptionError) -> JSONResponse:
        return _body(e.status, e.code, str(e))

    async def _unavailable(request: Request, e: Exception) -> JSONResponse:
        if (what := _unreachable(e)) is None:
            raise e  # not an outage: answered as `internal`
        log.warning("%s %s: %s unavailable: %s", request.method, request.url.path, what, e)
        message = f"{what} is not answering; try again in {RETRY_AFTER_S} s"
        return _body(503, "unavailable", message, **{"Retry-After": str(RETRY_AFTER_S)})

    for kind in UNAVAILABLE:
        app.add_exception_handler(kind, _unavailable)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        loc = [str(p) for p in first["loc"]]
        where = ".".join(loc[1:] if loc[:1] == ["body"] else loc) or "the body"
        message = first["msg"]
        if first["type"] == "value_error" and "error" in first.get("ctx", {}):
            message = str(first["ctx"]["error"])  # our validators' words, not pydantic's
        if not message.startswith(where.rpartition(".")[2]):
            message = f"{where}: {message}"
        return _body(422, "invalid_request", message)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(e.status_code, "http_error")
        headers = dict(e.headers or {})
        if e.status_code == 405:  # Starlette names only the first route's methods
            headers["Allow"] = ", ".join(_allowed(request))
        return _body(e.status_code, code, str(e.detail), **headers)
