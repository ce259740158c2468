"""What a tenant may read and write in storage (issue #37): a grant ends at a `/`, and reading
a prefix is no grant to write it (tenant A, reading a prefix B reads too, could put its
backfill's output, and overwrite B's manifest, there)."""

import uuid

import pytest
import redis
from fastapi.testclient import TestClient

from api.main import create_app
from tests.api.test_jobs_api import assert_error
from worker.contract.tenants import TenantError, Tenants
from worker.storage import Storage


@pytest.fixture
def shared(settings, clips):
    """A bucket of archives that tenants `a` and `b` may both read, with a clip in it."""
    bucket = f"shared-{uuid.uuid4().hex[:8]}"
    storage = Storage(settings)
    storage.ensure_bucket()
    storage.client.create_bucket(Bucket=bucket)
    for key in ("imports/0.flac", "imports-old/0.flac", "b/out/_manifest/000000000.jsonl"):
        storage.client.put_object(Bucket=bucket, Key=key, Body=clips["en_jfk"].bytes)
    keyed = settings.model_copy(update={"auth": "keys"})
    tenants = Tenants(redis.Redis.from_url(settings.redis_url), keyed)
    keys = {}
    for name in ("a", "b"):
        tenants.update(name, sources=[f"s3://{bucket}/"])
        keys[name] = {"authorization": f"Bearer {tenants.create_key(name)[0]}"}
    with TestClient(create_app(keyed)) as client:
        yield client, bucket, tenants, keys, storage


@pytest.mark.parametrize("how", ["tenant", "configuration"])
def test_a_source_without_its_last_slash_grants_that_folder_not_its_siblings(settings, shared, how):
    client, bucket, tenants, keys, _ = shared
    grant = f"s3://{bucket}/imports"
    if how == "tenant":
        tenants.update("a", sources=[grant])
    else:  # WHISPERFLEET_TENANT_SOURCES, for a tenant with no sources of its own
        tenants.update("a", sources=None)
        client.app.state.tenants = Tenants(
            client.app.state.store.redis,
            client.app.state.settings.model_copy(update={"tenant_sources": [grant]}),
        )
    ok = client.post("/v1/jobs", json={"source": f"{grant}/0.flac"}, headers=keys["a"])
    assert ok.status_code == 202, ok.text
    for refused in (f"{grant}-old/0.flac", f"{grant}x", f"s3://{bucket}/b/out/x"):
        answer = client.post("/v1/jobs", json={"source": refused}, headers=keys["a"])
        assert_error(answer, 403, "source_not_allowed")
        answer = client.post("/v1/backfills", json={"source": refused + "/"}, headers=keys["a"])
        assert_error(answer, 403, "source_not_allowed")


def test_a_prefix_a_tenant_may_read_is_no_place_to_write_its_outputs(shared):
    client, bucket, tenants, keys, storage = shared
    manifest = "b/out/_manifest/000000000.jsonl"
    before = storage.get(manifest, bucket)
    spec = {"source": f"s3://{bucket}/imports/", "output": f"s3://{bucket}/b/out/"}
    answer = client.post("/v1/backfills", json=spec, headers=keys["a"])
    assert_error(answer, 403, "output_not_allowed", "may write", "tenants set --output")
    assert storage.get(manifest, bucket) == before  # b's manifest as it was

    # a write grant of its own: there, and only there
    tenants.update("a", outputs=[f"s3://{bucket}/a-out"])
    refused = client.post("/v1/backfills", json=spec, headers=keys["a"])
    assert_error(refused, 403, "output_not_allowed")
    sibling = {**spec, "output": f"s3://{bucket}/a-out-old/"}
    assert_error(
        client.post("/v1/backfills", json=sibling, headers=keys["a"]), 403, "output_not_allowed"
    )
    mine = {**spec, "output": f"s3://{bucket}/a-out/run1/"}
    started = client.post("/v1/backfills", json=mine, headers=keys["a"])
    assert started.status_code == 201, started.text
    assert started.json()["output"] == f"s3://{bucket}/a-out/run1/"

    # omitted, the output is the service's, under the tenant's own prefix
    plain = client.post(
        "/v1/backfills", json={"source": f"s3://{bucket}/imports-old/"}, headers=keys["b"]
    )
    assert plain.status_code == 201, plain.text
    service = client.app.state.settings.s3_bucket
    assert plain.json()["output"].startswith(f"s3://{service}/backfills/b/")


def test_the_stack_lets_webhooks_reach_loopback_only_while_its_api_is_open():
    """A caller with a key must not make the stack post to services of its own host (issue
    #37: the stack allowed loopback webhooks with keys on)."""
    from worker.cli.main import stack_defaults
    from worker.contract.settings import Settings
    from worker.webhooks.delivery import WebhookRefused, destination

    open_stack, keyed = {}, {"WHISPERFLEET_AUTH": "keys"}
    stack_defaults(open_stack)
    stack_defaults(keyed)
    assert open_stack["WHISPERFLEET_AUTH"] == "none"
    assert open_stack["WHISPERFLEET_WEBHOOK_ALLOW_NETWORKS"] == "127.0.0.0/8,::1/128"
    assert keyed == {"WHISPERFLEET_AUTH": "keys"}
    for env, allowed in ((open_stack, True), (keyed, False)):
        networks = Settings(**{k[13:].lower(): v for k, v in env.items()}).webhook_allow_networks
        if allowed:
            assert destination("http://127.0.0.1:9/hook", networks)
        else:
            with pytest.raises(WebhookRefused):
                destination("http://127.0.0.1:9/hook", networks)


def test_each_tenant_posts_webhooks_only_where_its_own_networks_allow(settings, clips):
    """The fleet's allow-list is every tenant's unless one has its own (issue #37: it was
    global, so a tenant could post to another's receivers on a private network)."""
    keyed = settings.model_copy(update={"auth": "keys", "webhook_allow_networks": ["10.0.0.0/8"]})
    tenants = Tenants(redis.Redis.from_url(settings.redis_url), keyed)
    tenants.update("own", webhook_networks=["127.0.0.1/8"])  # normalised: 127.0.0.0/8
    tenants.update("public", webhook_networks=[])
    assert tenants.limits("own").webhook_networks == ["127.0.0.0/8"]
    assert tenants.limits("fleet").webhook_networks == ["10.0.0.0/8"]
    assert tenants.limits("public").webhook_networks == []
    reaches = {
        "own": {"http://127.0.0.1:9/hook"},
        "fleet": {"http://10.1.2.3/hook"},
        "public": set(),
    }
    with TestClient(create_app(keyed)) as client:
        for tenant, allowed in reaches.items():
            key = {"authorization": f"Bearer {tenants.create_key(tenant)[0]}"}
            for hook in ("http://127.0.0.1:9/hook", "http://10.1.2.3/hook", "http://[::1]/h"):
                answer = client.post(
                    "/v1/jobs",
                    files={"file": ("a.flac", clips["en_jfk"].bytes)},
                    data={"webhook": hook},
                    headers=key,
                )
                if hook in allowed:
                    assert answer.status_code == 202, (tenant, hook, answer.text)
                else:
                    assert_error(answer, 422, "invalid_webhook", "non-public")
    with pytest.raises(TenantError, match="webhook network"):
        tenants.update("own", webhook_networks=["10.0.0.0/33"])
    assert tenants.limits("own").webhook_networks == ["127.0.0.0/8"]
