"""Every command the README gives runs from a clone (issue 19): the two set-up commands in CI
(.ci/run, verbatim), the usage lines that need no service here, and the rest each named with
the test that runs it."""

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from worker.cli.main import build_parser

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()
BIN = Path(sys.executable).parent  # whisperfleet, as the set-up commands install it

# Commands that start services or need Docker, with where they are run instead. Their options
# are still parsed here, so that none names an option the command lacks.
ELSEWHERE = {
    "whisperfleet stack --port 8000": "examples/quickstart.sh (.ci/run); tests/test_end_to_end.py",
    "whisperfleet api --port 8000": "tests/test_end_to_end.py",
    "whisperfleet worker": "tests/test_end_to_end.py",
    "whisperfleet worker --gpus all": "tests/faults/test_processes.py (--gpus 0,1); test_cli.py",
    "whisperfleet worker --processes 8": "tests/faults/test_processes.py (--processes 2)",
    "whisperfleet worker --queues interactive": "tests/faults/test_processes.py",
    "celery -A worker.app worker": "tests/faults/test_restarts.py, a plain Celery worker",
    "scripts/compose_env.sh": "Docker: scripts/compose_check.sh; tests/test_compose.py",
    "docker compose up -d": "Docker: scripts/compose_check.sh",
    "docker compose --profile cpu up -d --scale worker=0": "Docker: scripts/compose_check.sh",
    "docker compose exec api whisperfleet keys create --tenant me": "Docker; keys: tests/api",
    "scripts/compose_check.sh --cpu": "Docker: it is the check",
    "scripts/docker_install.sh": "Docker: .ci/run",
    "scripts/compose_images.sh": "Docker: scripts/compose_check.sh --local (.ci/run)",
    "export COMPOSE_FILE=compose.yaml:compose.local.yaml": "scripts/compose_check.sh --local",
    "COMPOSE_PARALLEL_LIMIT=1 docker compose --profile cpu build api worker-cpu storage": (
        "Docker: scripts/compose_check.sh --local"
    ),
    "scripts/compose_check.sh --local": "Docker: .ci/run",
    "curl -F file=@tests/data/en_jfk.flac -F model=tiny.en http://127.0.0.1:8000/v1/jobs": (
        "examples/quickstart.sh (.ci/run)"
    ),
    "curl http://127.0.0.1:8000/v1/jobs/5f0c...": "examples/quickstart.sh (.ci/run)",
    "curl http://127.0.0.1:8000/v1/jobs/5f0c.../result": "tests/test_end_to_end.py",
    "curl 'http://127.0.0.1:8000/v1/jobs/5f0c.../result?format=text'": "examples/quickstart.sh",
}
# Run here with more than the README gives: transformers' side of eval takes minutes on the
# CPU (tests/engine/test_evaluate.py runs it on tiny.en).
EXTRA = {"whisperfleet eval tests/data/manifest.jsonl --model base": ["--no-reference"]}


def readme_command(label: str) -> str:
    match = re.search(rf"\*\*\({label}\)[^`]*```bash\n(.+?)\n```", README, re.S)
    assert match, f"README has no command ({label})"
    return match.group(1)


def commands() -> list[str]:
    """Every command line of the README's bash blocks, its comment cut off."""
    lines = []
    for block in re.findall(r"```bash\n(.+?)\n```", README, re.S):
        for line in block.splitlines():
            command = re.split(r"\s+#\s", line, maxsplit=1)[0].strip()
            if command and not command.startswith("#"):
                lines.append(command)
    return lines


SETUP = [readme_command("a"), readme_command("b")]
HERE = [c for c in commands() if c not in ELSEWHERE and c not in SETUP]


def test_ci_runs_both_setup_commands_verbatim():
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "examples/quickstart.sh" in SETUP[0]
    assert (ROOT / "examples" / "quickstart.sh").stat().st_mode & 0o111
    assert all(command in ci_lines for command in SETUP)


def test_commands_run_elsewhere_are_ones_the_readme_gives_with_options_that_exist():
    assert set(ELSEWHERE) <= set(commands()), set(ELSEWHERE) - set(commands())
    for command in ELSEWHERE:
        argv = shlex.split(command)
        if argv[0] == "whisperfleet":
            build_parser().parse_args(argv[1:])  # exits 2 on an unknown option


@pytest.mark.parametrize("command", HERE)
def test_a_usage_line_runs_from_the_clone(command):
    argv = shlex.split(command) + EXTRA.get(command, [])
    assert argv[0] == "whisperfleet", f"{command}: run it here, or say in ELSEWHERE where"
    needs_gpu = argv[1] == "bench"
    if needs_gpu and torch.cuda.is_available():
        pytest.skip("minutes on a GPU: docs/benchmarks.md and docs/accuracy.md record its runs")
    done = subprocess.run(
        [str(BIN / "whisperfleet"), *argv[1:]],
        cwd=ROOT,
        env={**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    if needs_gpu:  # its options accepted, then refused in one line on a machine without one
        assert done.returncode == 2, done.stderr
        assert done.stderr == "whisperfleet bench: needs a CUDA GPU, and none is visible\n"
        return
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stdout.strip(), command


def test_the_engine_example_runs():
    [example] = re.findall(r"```python\n(.+?)\n```", README, re.S)
    done = subprocess.run(
        [sys.executable, "-c", example], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert "ask not what your country can do for you" in done.stdout
