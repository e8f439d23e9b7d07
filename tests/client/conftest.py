"""Fixtures for the client tests (the servers come from tests/conftest.py)."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from celery_dflock import ConnectionPool


@pytest.fixture
def closed_port() -> int:
    """A local TCP port nothing listens on (bound, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def pool() -> Iterator[ConnectionPool]:
    """A connection pool, closed at teardown."""
    with ConnectionPool() as connection_pool:
        yield connection_pool
