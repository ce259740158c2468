from __future__ import annotations

import logging

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from api.deps import StorageDep, StoreDep
from api.schemas import Health

log = logging.getLogger(__name__)
router = APIRouter(tags=["health"])


@router.get("/healthz")
def healthz() -> Health:
    """The process is up."""
    return Health(status="ok")


@router.get("/readyz", response_model=Health, responses={503: {"model": Health}})
async def readyz(store: StoreDep, storage: StorageDep) -> JSONResponse:
    """Redis and object storage answer (the bucket is created if missing): `ok` or
    `unavailable` for each; why is logged, not answered (it names hosts and ports)."""
    checks = {}
    for name, probe in (("redis", store.redis.ping), ("storage", storage.ensure_bucket)):
        try:
            await run_in_threadpool(probe)
            checks[name] = "ok"
        except Exception as e:  # any failure means not ready
            log.warning("readyz: %s unavailable: %s", name, e)
            checks[name] = "unavailable"
    ready = all(v == "ok" for v in checks.values())
    body = Health(status="ready" if ready else "unavailable", checks=checks)
    return JSONResponse(status_code=200 if ready else 503, content=body.model_dump())
