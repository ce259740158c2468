"""compose.yaml: every service comes back when it dies, and whisperfleet's services get settings
it reads (an unknown WHISPERFLEET_ variable would be ignored silently) and the storage's keys."""

from pathlib import Path

import yaml

from worker.contract.settings import Settings

SERVICES = yaml.safe_load((Path(__file__).parent.parent / "compose.yaml").read_text())["services"]
WHISPERFLEET = ("api", "webhooks", "scanner", "beat", "worker", "worker-cpu")


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
