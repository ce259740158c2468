"""Fixtures the worker's tests share."""

import pytest

from engine.runner import Runner


@pytest.fixture
def encoded(monkeypatch) -> list[int]:
    """The size of every encoder batch the engine runs."""
    sizes, encode = [], Runner.encode

    def spy(self, mels):
        sizes.append(len(mels))
        return encode(self, mels)

    monkeypatch.setattr(Runner, "encode", spy)
    return sizes
