"""compose.yaml: every service comes back when it dies, and whisperfleet's services get settings
it reads (an unknown WHISPERFLEET_ variable would be ignored silently) and the storage's keys;
its images can be named otherwise, and compose.local.yaml needs no image registry."""

import re
from pathlib import Path

import yaml

from worker.contract.settings import Settings

ROOT = Path(__file__).parent.parent
SERVICES = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
WHISPERFLEET = ("api", "webhooks", "scanner", "beat", "worker", "worker-cpu")


def merged(base: dict, override: dict) -> dict:
    """Compose's merge of an override file, as far as these tests read: mappings key by key,
    anything else replaced."""
    out = dict(base)
    for key, value in override.items():
        both = isinstance(value, dict) and isinstance(base.get(key), dict)
        out[key] = merged(base[key], value) if both else value
    return out


LOCAL = merged(SERVICES, yaml.safe_load((ROOT / "compose.local.yaml").read_text())["services"])


def test_every_service_is_restarted_when_it_dies():
    for name, service in SERVICES.items():
        assert service.get("restart") in ("always", "unless-stopped"), name


def test_whisperfleet_services_get_settings_it_reads():
    known = {f"WHISPERFLEET_{name.upper()}" for name in Settings.model_fields}
    for name in WHISPERFLEET:
        env = SERVICES[name]["environment"]
        assert set(env) <= known, f"{name}: {sorted(set(env) - known)}"
        assert env["WHISPERFLEET_REDIS_URL"] == "redis://redis:6379/0"
        assert env["WHISPERFLEET_S3_ENDPOINT_URL"].startswith("http://storage:")


def test_storage_keys_are_the_ones_whisperfleet_uses():
    storage = SERVICES["storage"]["environment"]
    for name in WHISPERFLEET:
        env = SERVICES[name]["environment"]
        assert env["WHISPERFLEET_S3_ACCESS_KEY_ID"] == storage["AWS_ACCESS_KEY_ID"]
        assert env["WHISPERFLEET_S3_SECRET_ACCESS_KEY"] == storage["AWS_SECRET_ACCESS_KEY"]


def test_the_gpu_worker_asks_for_gpus_and_the_cpu_one_runs_only_on_request():
    devices = SERVICES["worker"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices[0]["capabilities"] == ["gpu"]
    assert "deploy" not in SERVICES["worker-cpu"]
    assert SERVICES["worker-cpu"]["profiles"] == ["cpu"]


def test_the_storage_keys_have_no_default_and_the_api_asks_for_keys():
    """Compose refuses to start without .env's keys (`${VAR:?...}`), and no service opens the
    API (WHISPERFLEET_AUTH stays `keys`)."""
    storage = SERVICES["storage"]["environment"]
    for value in (storage["AWS_ACCESS_KEY_ID"], storage["AWS_SECRET_ACCESS_KEY"]):
        assert value.startswith("${STORAGE_") and ":?" in value and ":-" not in value
    for name in WHISPERFLEET:
        assert "WHISPERFLEET_AUTH" not in SERVICES[name]["environment"]


def test_webhooks_are_posted_by_their_own_light_service():
    webhooks = SERVICES["webhooks"]
    assert webhooks["command"] == ["whisperfleet", "webhooks"]
    assert webhooks["build"]["target"] == "api" and "deploy" not in webhooks


def test_backfills_run_in_their_own_light_services_with_the_shared_settings():
    """The scanner and beat exist, run from the API's image (no torch, no GPU), and get the
    settings every whisperfleet service gets (the `x-settings` block), as the webhooks do."""
    for name in ("scanner", "beat"):
        service = SERVICES[name]
        assert service["command"] == ["whisperfleet", name]
        assert service["build"]["target"] == "api" and "deploy" not in service
        assert service["environment"] == SERVICES["webhooks"]["environment"]
        assert "redis" in service["depends_on"]
    assert "storage" in SERVICES["scanner"]["depends_on"]  # it lists and writes objects


def test_images_from_a_registry_can_be_named_otherwise():
    """Redis's and the storage's images are `${VARIABLE:-today's}`, and every build of ours gets
    its base as PYTHON_IMAGE, by default the Dockerfile's."""
    assert SERVICES["redis"]["image"] == "${REDIS_IMAGE:-redis:7}"
    assert SERVICES["storage"]["image"].startswith("${STORAGE_IMAGE:-chrislusf/seaweedfs:")
    dockerfile = (ROOT / "Dockerfile").read_text()
    default = re.search(r"^ARG PYTHON_IMAGE=(\S+)$", dockerfile, re.M).group(1)
    for name in WHISPERFLEET:
        assert SERVICES[name]["build"]["args"]["PYTHON_IMAGE"] == f"${{PYTHON_IMAGE:-{default}}}"


def test_the_local_override_needs_no_registry():
    """compose.local.yaml: Redis and our images' base are made by scripts/compose_images.sh, the
    rest built here with the same arguments (so one build's layers serve the others), the
    worker without Triton (no GPU); the API still listens on this host alone."""
    script = (ROOT / "scripts" / "compose_images.sh").read_text()
    args = LOCAL["api"]["build"]["args"]
    for name, service in LOCAL.items():
        if "build" in service:
            assert service["build"]["args"] == args, name
        else:
            assert re.search(rf"^[A-Z]+={re.escape(service['image'])}$", script, re.M), name
    assert re.search(rf"^[A-Z]+={re.escape(args['PYTHON_IMAGE'])}$", script, re.M)
    assert args["WORKER_EXTRAS"] == "engine"
    assert LOCAL["storage"]["build"]["target"] == "storage"
    assert LOCAL["api"]["ports"] == SERVICES["api"]["ports"] == ["127.0.0.1:8000:8000"]


def test_the_local_storage_is_the_stacks_own_server_keeping_objects_on_its_volume():
    """The stand-in for SeaweedFS serves whisperfleet's storage key (no default), on the port the
    services use, keeps its objects on the storage volume, and its healthcheck asks that port."""
    storage = LOCAL["storage"]
    command = storage["command"]
    assert command[:3] == ["python3", "-m", "worker.local.s3_server"]
    port = command[command.index("-p") + 1]
    assert SERVICES["api"]["environment"]["WHISPERFLEET_S3_ENDPOINT_URL"].endswith(f":{port}")
    assert f"storage:{command[command.index('--data') + 1]}" in storage["volumes"]
    assert f"('127.0.0.1', {port})" in storage["healthcheck"]["test"][-1]
    for key in ("WHISPERFLEET_S3_ACCESS_KEY_ID", "WHISPERFLEET_S3_SECRET_ACCESS_KEY"):
        value = storage["environment"][key]
        assert value.startswith("${STORAGE_") and ":?" in value and ":-" not in value
        assert all(LOCAL[name]["environment"][key] == value for name in WHISPERFLEET), key
