"""An id that names another of a record's Redis keys answers as an unknown id (issue #37:
`GET /v1/backfills/<another tenant's id>:counts` was a 500, Redis' WRONGTYPE)."""

import pytest
import redis
from fastapi.testclient import TestClient

from api.main import create_app
from tests.api.test_jobs_api import assert_error
from worker.contract.backfills import BackfillStore, new_backfill_id


@pytest.mark.parametrize("part", ["counts", "inflight", "nothing"])
@pytest.mark.parametrize("route", ["", "/manifest", "/retry"])
def test_a_backfill_id_with_a_part_of_its_keys_is_not_found(settings, part, route):
    client = redis.Redis.from_url(settings.redis_url)
    backfill_id = new_backfill_id()
    store = BackfillStore(client)
    client.hset(store.key(backfill_id, "counts"), "run:1:created", 3)  # as its jobs write it
    client.sadd(store.key(backfill_id, "inflight"), "a-job")
    method = "POST" if route == "/retry" else "GET"
    with TestClient(create_app(settings)) as api:
        for shown in (f"{backfill_id}:{part}", new_backfill_id()):
            answer = api.request(method, f"/v1/backfills/{shown}{route}")
            assert_error(answer, 404, "not_found", f"no backfill {shown}")
        answer = api.delete(f"/v1/backfills/{backfill_id}:{part}")
        assert_error(answer, 404, "not_found")
