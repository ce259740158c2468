"""A tenant's limit of jobs in flight holds for submissions made at once (issue #37: six
parallel uploads with a limit of two were all accepted, each checked before any was
counted)."""

import asyncio

import httpx
import redis
from fastapi.testclient import TestClient

from api.main import create_app
from tests.api import wire
from worker.contract.jobs import JobStore
from worker.contract.tenants import Tenants


def test_parallel_uploads_past_the_limit_of_jobs_in_flight_are_refused(settings, clips):
    """Six uploads at once, each streamed slowly (so that all six are being received
    together), against a limit of two: two jobs, four 429s, and the places of the refused
    and of a failed upload free again."""
    client = redis.Redis.from_url(settings.redis_url)
    Tenants(client, settings).update("default", jobs_in_flight=2)
    body = wire.multipart(clips["en_jfk"].bytes, "jfk.flac")
    app = create_app(settings)

    async def slow():
        for chunk in wire.chunked(body, len(body) // 8):
            await asyncio.sleep(0.1)
            yield chunk

    async def six() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as api:
            post = lambda: api.post(  # noqa: E731
                "/v1/jobs", content=slow(), headers={"content-type": wire.MULTIPART}
            )
            return await asyncio.gather(*(post() for _ in range(6)))

    with TestClient(app) as api:
        answers = asyncio.run(six())
        # one place more: an upload that fails gives its place back, the next takes it
        Tenants(client, settings).update("default", jobs_in_flight=3)
        noise = wire.multipart(b"not audio at all" * 64, "x.flac")
        for status in (422, 202, 429):
            answer = api.post(
                "/v1/jobs",
                content=noise if status == 422 else body,
                headers={"content-type": wire.MULTIPART},
            )
            assert answer.status_code == status, answer.text
    codes = sorted(a.status_code for a in answers)
    assert codes == [202, 202, 429, 429, 429, 429], [a.text for a in answers]
    assert all(
        a.json()["error"]["code"] == "too_many_jobs" for a in answers if a.status_code == 429
    )
    store = JobStore(client)
    assert store.in_flight("default") == 3
    assert client.zcard("whisperfleet:tenant:default:reserved") == 0
