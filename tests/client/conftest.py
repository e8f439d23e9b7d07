"""Fixtures for the client tests (the servers come from tests/conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from celery_dflock import ConnectionPool
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
