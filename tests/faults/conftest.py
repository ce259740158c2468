"""The fault tests' fixtures: a storage server and a fleet of their own for each test."""

from __future__ import annotations

import pytest

from tests.faults.fleet import StorageServer, make_fleet, speech


@pytest.fixture
def storage_server():
    server = StorageServer()
    yield server
    server.close()


@pytest.fixture
def fleet(tmp_path, storage_server):
    fleet = make_fleet(tmp_path, storage_server)
    yield fleet
    fleet.close()
    print(fleet.logs()[-15000:])


@pytest.fixture(scope="module")
def inputs(clips) -> list[bytes]:
    """Short real speech, a few seconds each."""
    english = [c for c in clips.values() if c.language == "en"]
    return [speech(c.bytes, 2.0 + i % 3) for i, c in enumerate(english)]
