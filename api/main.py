"""The FastAPI application: the door of whisperfleet. Never imports torch or the engine."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

import redis
from fastapi import APIRouter, FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.routing import APIRoute

from api import logs
from api.docs_ui import install_docs
from api.errors import install_error_handlers
from api.routes import backfills, health, jobs, openai
from worker.app import create_app as create_celery
from worker.backfills.scanner import create_backfill_app
from worker.contract.backfills import BackfillStore
from worker.contract.jobs import JobStore
from worker.contract.settings import Settings, get_settings
from worker.contract.tenants import Tenants
from worker.storage import Storage

log = logging.getLogger(__name__)
# a Redis that stops answering (frozen, or a network partition) fails a request within this,
# answered 503 `unavailable`, instead of holding it forever
REDIS_TIMEOUT_S = 5.0


ROUTERS = (health.router, jobs.router, openai.router, backfills.router)
API_THREADS = 40  # anyio's thread pool, where the routes' storage and Redis calls run


def _operation_id(route: APIRoute) -> str:
    return f"{route.tags[0]}-{route.name}"


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    logs.configure()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        app.state.settings = settings
        app.state.store = JobStore(
            redis.Redis.from_url(
                settings.redis_url,
                socket_timeout=REDIS_TIMEOUT_S,
                socket_connect_timeout=REDIS_TIMEOUT_S,
            ),
            retention_s=settings.job_retention_s,
        )
        app.state.tenants = Tenants(app.state.store.redis, settings)
        app.state.storage = Storage(settings, threads=API_THREADS)
        app.state.celery = create_celery(settings)
        app.state.backfills = BackfillStore(app.state.store.redis)
        app.state.backfill_celery = create_backfill_app(settings)  # schedules, for beat
        try:
            app.state.storage.ensure_bucket()
        except Exception as e:  # not fatal: /readyz reports it until storage answers
            log.warning("storage at %s is not reachable yet: %s", settings.s3_endpoint_url, e)
        yield
        app.state.store.redis.close()

    app = FastAPI(
        title="whisperfleet",
        summary="Asynchronous speech-to-text: submit audio, poll the job, read the transcript.",
        version="0.1.0",
        lifespan=lifespan,
        generate_unique_id_function=_operation_id,
        docs_url=None,  # FastAPI's pages load their assets from a CDN: api.docs_ui's do not
        redoc_url=None,
    )
    install_error_handlers(app)
    if settings.cors_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=settings.cors_origins,
            allow_methods=["GET", "HEAD", "POST", "DELETE"],
            allow_headers=["Authorization", "Content-Type", "Idempotency-Key"],
            expose_headers=["Location", "Retry-After"],
        )
    for router in (*ROUTERS, _head_routes(ROUTERS)):
        app.include_router(router)
    install_docs(app)
    return app


def _head_routes(routers: tuple[APIRouter, ...]) -> APIRouter:
    """HEAD on every GET route (FastAPI adds none): the same answer without its body."""
    head = APIRouter()
    for route in (r for router in routers for r in router.routes):
        if isinstance(route, APIRoute) and "GET" in route.methods:
            head.add_api_route(
                route.path,
                route.endpoint,
                methods=["HEAD"],
                response_model=route.response_model,
                status_code=route.status_code,
                responses=route.responses,
                summary=route.summary,
                description=route.description,
                response_class=route.response_class,
                tags=route.tags,
                name=route.name,
                operation_id=f"{route.tags[0]}-{route.name}-head",
            )
    return head


app = create_app()
