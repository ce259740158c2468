"""`whisperfleet worker --gpus all` counts the GPUs without touching CUDA itself."""

import os
import subprocess
import sys


def test_gpus_all_with_no_gpu_visible_says_so():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run(
        [sys.executable, "-m", "worker.cli", "worker", "--gpus", "all"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 1
    assert "--gpus all, but no GPU is visible" in result.stderr


def test_tenants_set_and_show_their_settings(settings):
    """`whisperfleet tenants set` changes some settings and keeps the others; `show` prints
    them with the configuration's defaults filled in, and the webhook secret."""
    import json

    env = {**os.environ, "WHISPERFLEET_REDIS_URL": settings.redis_url}

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "worker.cli", "tenants", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    made = cli("set", "acme", "--source", "s3://archive/acme/", "--jobs-per-minute", "5")
    assert made.returncode == 0, made.stderr
    again = cli("set", "acme", "--jobs-in-flight", "7")
    shown = json.loads(again.stdout)
    assert shown["sources"] == ["s3://archive/acme/"] and shown["jobs_per_minute"] == 5
    assert shown["jobs_in_flight"] == 7 and shown["webhook_secret"].startswith("whsec_")
    assert json.loads(cli("show", "acme").stdout) == shown
    assert cli("list").stdout.split() == ["acme"]
    back = json.loads(cli("set", "acme", "--default-sources").stdout)
    assert back["sources"] == [] and back["jobs_per_minute"] == 5
    for bad in (["--source", "http://x/y"], ["--jobs-per-minute", "0"]):
        refused = cli("set", "acme", *bad)
        assert refused.returncode == 2 and "whisperfleet tenants" in refused.stderr
