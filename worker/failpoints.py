"""Named points where the fault tests make a worker die: `WHISPERFLEET_FAILPOINT=name` kills
the process with SIGKILL the first time it passes `failpoint(name)` (as a crash or an OOM kill
would), so a test can stop it exactly between two durable steps. Unset, a check of one
environment variable."""

from __future__ import annotations

import os
import signal


def failpoint(name: str) -> None:
    if os.environ.get("WHISPERFLEET_FAILPOINT") == name:
        os.kill(os.getpid(), signal.SIGKILL)
