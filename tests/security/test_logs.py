"""The API's access log keeps which query parameters a request sent, never their values (issue
#37: it logged whole query strings, a presigned URL's signature or a token among them)."""

import subprocess
import sys

import httpx

from api.logs import without_values
from tests.conftest import free_port, stop, wait_for_port

SECRETS = {"X-Amz-Signature": "5ec7e7519a7", "token": "hunter2", "download": "url"}


def test_the_api_process_logs_no_query_values(stack_env):
    port = free_port()
    api = subprocess.Popen(
        [sys.executable, "-m", "worker.cli", "api", "--port", str(port)],
        env={**stack_env, "WHISPERFLEET_AUTH": "keys"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        wait_for_port(port, api)
        answer = httpx.get(f"http://127.0.0.1:{port}/v1/jobs/job_x/result", params=SECRETS)
        assert answer.status_code == 401
    finally:
        stop(api)
    log = api.stdout.read()
    line = next(line for line in log.splitlines() if "/v1/jobs/job_x/result" in line)
    assert "X-Amz-Signature=…&token=…&download=…" in line and "401" in line
    assert not [value for value in SECRETS.values() if value in log], log


def test_a_path_keeps_its_parameters_names_alone():
    assert without_values("/v1/jobs") == "/v1/jobs"
    assert without_values("/v1/jobs?") == "/v1/jobs?"
    assert without_values("/r?a=1&a=2&flag&b=%2F") == "/r?a=…&a=…&flag=…&b=…"
