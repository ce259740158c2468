"""JSON request bodies, read within a small cap and only once the caller is known.

FastAPI reads a route's body parameter before the route's dependencies run, so a body
parameter would let a caller without a key make the API buffer any body before its 401. No
route declares one (tests/security): each reads its body itself, after its dependencies have
authenticated the caller: JSON here, an upload streamed into storage by `api.upload`.
"""

from __future__ import annotations

import json
from typing import TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from api.errors import ApiError

MAX_JSON_BYTES = 64 * 1024  # a job naming an object, a backfill's spec: a few hundred bytes
Model = TypeVar("Model", bound=BaseModel)


def _too_large() -> ApiError:
    return ApiError(413, "too_large", f"a JSON body is at most {MAX_JSON_BYTES} bytes")


async def read_json(request: Request) -> object:
    """The request's JSON body: 413 `too_large` past MAX_JSON_BYTES, before reading any of
    it where its Content-Length says so, else as soon as the bytes received pass it; 422
    `invalid_request` for a body that is not JSON, or is nested too deeply to parse."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > MAX_JSON_BYTES):
        raise _too_large()
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_JSON_BYTES:
            raise _too_large()
    try:
        return json.loads(body)
    except RecursionError as e:
        raise ApiError(422, "invalid_request", "the JSON body is nested too deeply") from e
    except ValueError as e:
        raise ApiError(422, "invalid_request", "the body is not JSON") from e


async def read_model(request: Request, model: type[Model]) -> Model:
    """The JSON body as `model`, its errors answered as those of a body parameter."""
    fields = await read_json(request)
    try:
        return model.model_validate(fields)
    except ValidationError as e:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in e.errors()]
        raise RequestValidationError(errors) from e
