"""Run processes, start again the ones that die, stop them all on Ctrl-C, SIGTERM or SIGHUP: what
`whisperfleet stack` (Redis, storage, API, worker) and `whisperfleet worker --gpus` (a worker
per GPU) run. A worker that dies (a GPU fault ends one on purpose) is started again and its
jobs are taken over by lease; a service that dies stops everything.

Each child runs in a process group of its own, so that Ctrl-C in a terminal reaches the
supervisor alone, which stops each child once: a child in the terminal's group got SIGINT from
it and then SIGTERM from here (Celery said "Warm shutdown" twice), and Redis or storage stopped
before the workers that drain into them.

    with Supervisor(stop_timeout=15) as processes:
        processes.add(Child("worker", [...]))
        return processes.watch()
    return 0  # stopped by Ctrl-C or SIGTERM
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass


@dataclass
class Child:
    name: str
    argv: list[str] | None = None  # None: `proc` was started elsewhere and is only watched
    env: dict[str, str] | None = None
    restart: bool = True  # start it again when it dies; else its death stops everything
    proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=self.env, process_group=0)


STOPS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # Ctrl-C, a stop, a closed terminal


def _interrupt(*_: object) -> None:
    raise KeyboardInterrupt


class Supervisor:
    def __init__(self, stop_timeout: float | None):
        """stop_timeout: seconds the children have to stop after SIGTERM (a worker finishes
        the jobs it holds) before SIGKILL; None: wait for them."""
        self.stop_timeout = stop_timeout
        self.children: list[Child] = []

    def __enter__(self) -> Supervisor:
        # Each stops it, also when started in the background (where SIGINT is inherited
        # ignored); SIGHUP too, a closed terminal, which no longer reaches the children.
        for sig in STOPS:
            signal.signal(sig, _interrupt)
        return self

    def add(self, child: Child) -> None:
        if child.proc is None:
            child.start()
        self.children.append(child)

    def watch(self) -> int:
        """Until a child that must not die dies (1); Ctrl-C or SIGTERM ends the `with`."""
        while True:
            for child in self.children:
                code = child.proc.poll()
                if code is None:
                    continue
                again = "; restarting it" if child.restart else ""
                print(f"whisperfleet: {child.name} exited with {code}{again}", file=sys.stderr)
                if not child.restart:
                    return 1
                child.start()
            time.sleep(0.5)

    def __exit__(self, kind, error, traceback) -> bool:
        """Stop every child, once, in reverse order, even if Ctrl-C is pressed again."""
        for sig in STOPS:
            signal.signal(sig, signal.SIG_IGN)
        running = [c.proc for c in reversed(self.children) if c.proc.poll() is None]
        for proc in running:
            proc.terminate()
        for proc in running:
            try:
                proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return kind is KeyboardInterrupt  # a stop asked for: not an error
