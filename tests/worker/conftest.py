"""Fixtures the worker's tests share."""

from collections.abc import Callable, Iterator

import pytest

from engine.runner import Runner
from worker.core.process import EngineCore


@pytest.fixture
def core() -> Iterator[Callable[..., EngineCore]]:
    """Start engine cores (EngineCore's arguments) that end with the test: a core left
    running would go on sending its reports into this process's metrics."""
    started: list[EngineCore] = []

    def start(*args, **kwargs) -> EngineCore:
        started.append(EngineCore(*args, **kwargs))
        return started[-1]

    yield start
    for engines in started:
        engines.close()


@pytest.fixture
def encoded(monkeypatch) -> list[int]:
    """The size of every encoder batch the engine runs."""
    sizes, encode = [], Runner.encode

    def spy(self, mels):
        sizes.append(len(mels))
        return encode(self, mels)

    monkeypatch.setattr(Runner, "encode", spy)
    return sizes
