from __future__ import annotations

import logging

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from api.deps import StorageDep, StoreDep
from api.schemas import Health
from worker.contract.jobs import QUEUES
from worker.contract.presence import Presence

log = logging.getLogger(__name__)
router = APIRouter(tags=["health"])
_away: dict[str, str] = {}  # the parts found unavailable, with why: logged when it changes


@router.get("/healthz")
def healthz() -> Health:
    """The process is up."""
    return Health(status="ok")


@router.get("/readyz", response_model=Health, responses={503: {"model": Health}})
async def readyz(store: StoreDep, storage: StorageDep) -> JSONResponse:
    """Redis and object storage answer (the bucket is created if missing), and a worker takes
    jobs from each queue: `ok` or `unavailable` for each part; why is logged, not answered
    (it names hosts and ports). A job submitted while only `workers` is unavailable is kept
    and waits in its queue."""
    presence = Presence(store.redis, store.prefix)

    def workers() -> None:
        idle = [q for q, n in presence.workers(list(QUEUES)).items() if not n]
        if idle:
            raise LookupError(f"no worker takes jobs from {', '.join(idle)}")

    checks = {}
    probes = (("redis", store.redis.ping), ("storage", storage.ensure_bucket), ("workers", workers))
    for name, probe in probes:
        try:
            await run_in_threadpool(probe)
            checks[name] = "ok"
            if _away.pop(name, None) is not None:
                log.info("readyz: %s available again", name)
        except Exception as e:  # any failure means not ready
            checks[name] = "unavailable"
            if _away.get(name) != str(e):  # said once, not at every probe
                log.warning("readyz: %s unavailable: %s", name, e)
                _away[name] = str(e)
    ready = all(v == "ok" for v in checks.values())
    body = Health(status="ready" if ready else "unavailable", checks=checks)
    return JSONResponse(status_code=200 if ready else 503, content=body.model_dump())
