"""Fixtures for the client tests (the servers come from tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_dflock import ConnectionPool
from dflockd_server.testing import ServerThread
from tests.client.faces import FACES, Face, Maker
from tests.support.ports import free_port


@pytest.fixture
def closed_port() -> int:
    """A local TCP port nothing listens on (bound, then released)."""
    return free_port()


@pytest.fixture
def pool() -> Iterator[ConnectionPool]:
    """A connection pool, closed at teardown."""
    with ConnectionPool() as connection_pool:
        yield connection_pool


@pytest.fixture(params=FACES, ids=lambda face: face.name)
def face(request: pytest.FixtureRequest) -> Face:
    """The blocking face of the client or the asyncio one (a module of one face's tests
    overrides this with its face)."""
    return request.param


@pytest.fixture(params=["lock", "semaphore"])
def make(request: pytest.FixtureRequest, face: Face, dflock_server: ServerThread) -> Maker:
    """Builds a lock of the face, or a semaphore of limit 1 (the same behaviour)."""
    return Maker(face, dflock_server, request.param == "semaphore")
