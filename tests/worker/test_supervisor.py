"""The supervisor of `whisperfleet stack` and `worker --gpus`: Ctrl-C stops each child once."""

import os
import signal
import subprocess
import sys
import time

import pytest

CHILD = """
import signal, sys, time
log = open(sys.argv[1], "a", buffering=1)
signal.signal(signal.SIGINT, lambda *_: log.write("SIGINT\\n"))
signal.signal(signal.SIGTERM, lambda *_: (log.write("SIGTERM\\n"), sys.exit(0)))
log.write("ready\\n")
while True:
    time.sleep(0.05)
"""

SUPERVISOR = """
import sys
from worker.cli.supervisor import Child, Supervisor

with Supervisor(stop_timeout=10) as processes:
    processes.add(Child("child", [sys.executable, "-c", sys.argv[1], sys.argv[2]]))
    sys.exit(processes.watch())
"""


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGHUP])  # Ctrl-C, a closed terminal
def test_ctrl_c_in_a_terminal_stops_each_child_once(tmp_path, sig):
    """The terminal signals its whole foreground group; the child hears only the supervisor's
    SIGTERM (a Celery worker printed "Warm shutdown" for each of SIGINT and SIGTERM)."""
    log = tmp_path / "child.log"
    supervisor = subprocess.Popen(
        [sys.executable, "-c", SUPERVISOR, CHILD, str(log)],
        process_group=0,  # the terminal's foreground group, in miniature
    )
    deadline = time.monotonic() + 60
    while not (log.exists() and "ready" in log.read_text()):
        assert time.monotonic() < deadline and supervisor.poll() is None
        time.sleep(0.05)
    os.killpg(supervisor.pid, sig)
    assert supervisor.wait(timeout=30) == 0
    assert log.read_text().splitlines() == ["ready", "SIGTERM"]
