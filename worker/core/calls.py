"""What a call to the engine core can end in, and the one-load-at-a-time rule, shared by both
ends of its pipe (`worker.core.process`) and by the batchers and models behind it
(`worker.core.batching`, `worker.core.engines`): down-hill of all three, so none imports
another for them. The errors pickle: they cross from the core to the job processes."""

from __future__ import annotations

from concurrent.futures import Future


class Cancelled(Exception):
    """The input was taken out before its result (its job was cancelled)."""


class EngineFailed(RuntimeError):
    """The engine failed while this input was in flight; the input itself may be fine.
    `retry`: whether running it again can succeed (false: out of memory at one slot);
    `oom`: it ran out of device memory (the pool was halved: run it again at once)."""

    def __init__(self, message: str, retry: bool, oom: bool = False):
        super().__init__(message)
        self.retry, self.oom = retry, oom

    def __reduce__(self):  # it crosses from the engine core to the worker
        return type(self), (self.args[0], self.retry, self.oom)


class UnknownModel(ValueError):
    """A model the worker's settings do not name."""


def single_flight(under_way: dict[str, Future], key: str) -> tuple[Future, bool]:
    """The future of the work on `key` under way, or a new one, and whether it is new (the
    caller then does the work and sets it). Called under the lock that guards `under_way`."""
    if key in under_way:
        return under_way[key], False
    under_way[key] = Future()
    return under_way[key], True
