"""Redis, RabbitMQ, PostgreSQL and MariaDB on this machine: where they are, whether they answer,
and the rule for a test that needs one: skip without it, fail instead when
``CELERY_DFLOCK_REQUIRE_REDIS=1`` (Redis, RabbitMQ) or ``CELERY_DFLOCK_REQUIRE_POSTGRES=1``
(PostgreSQL, MariaDB: CI sets both), so a service-dependent test never silently stops
running."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Final, NoReturn
from urllib.parse import urlsplit

import pytest

REDIS_URL_BASE = os.environ.get("CELERY_DFLOCK_TEST_REDIS_URL", "redis://127.0.0.1:6379")
"""Redis server of the ``redis`` tests (no database number: ``redis_url`` gives one)."""
REDIS_DBS: Final[Mapping[str, int]] = MappingProxyType(
    {
        "workers": 11,  # tests/support/workers' rigs, and docs' queue-once sizing page
        "beats": 12,  # tests/support/beats
        "queue_once_edges": 13,
        "fenced_stores": 10,  # tests/fencing and docs/fencing.md's examples (keys, not emptied)
        # Each of these empties its database (FLUSHDB): it must have it alone.
        "packaging_demo": 7,
        "examples": 8,
        "getting_started": 9,
        "demo": 14,
        "compose": 15,
    }
)
"""The one table of Redis database numbers: every test's database comes from here
(tests/test_support_redis_dbs.py checks that none is shared and none is written elsewhere);
each test also uses its own queue name."""
RABBITMQ_URL = os.environ.get(
    "CELERY_DFLOCK_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//"
)
POSTGRES_URL = os.environ.get(
    "CELERY_DFLOCK_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)
"""PostgreSQL of the fenced-store tests (each test makes a schema of its own in it)."""
MARIADB_URL = os.environ.get("CELERY_DFLOCK_TEST_MARIADB_URL", "mysql://root@127.0.0.1:3306/test")
"""MariaDB (or MySQL) of the fenced upsert's tests (each test makes a database of its own)."""
REQUIRE_POSTGRES_ENV = "CELERY_DFLOCK_REQUIRE_POSTGRES"
"""Set to 1 (as CI does), a test that needs PostgreSQL fails instead of skipping."""
REQUIRE_SERVICES_ENV = "CELERY_DFLOCK_REQUIRE_REDIS"
"""Set to 1 (as CI does), a test that needs Redis or RabbitMQ fails instead of skipping."""


def redis_url(purpose: str) -> str:
    """The Redis URL of ``purpose``'s database (a key of ``REDIS_DBS``)."""
    return f"{REDIS_URL_BASE}/{REDIS_DBS[purpose]}"


def services_required() -> bool:
    """True when a missing service fails the test instead of skipping it."""
    return os.environ.get(REQUIRE_SERVICES_ENV) == "1"


def _answers(url: str, default_port: int, hello: bytes, reply: bytes, timeout: float) -> bool:
    """True if the service at ``url`` answers ``hello`` with bytes starting with ``reply``."""
    address = urlsplit(url)
    try:
        with socket.create_connection(
            (address.hostname or "127.0.0.1", address.port or default_port), timeout=timeout
        ) as sock:
            sock.sendall(hello)
            return sock.recv(16).startswith(reply)
    except OSError:
        return False


def redis_reachable(timeout: float = 0.5) -> bool:
    """True if Redis answers PING."""
    return _answers(REDIS_URL_BASE, 6379, b"PING\r\n", b"+PONG", timeout)


def rabbitmq_reachable(timeout: float = 0.5) -> bool:
    """True if RabbitMQ answers the AMQP protocol header (with its connection.start frame)."""
    return _answers(RABBITMQ_URL, 5672, b"AMQP\x00\x00\x09\x01", b"\x01", timeout)


def postgres_reachable(timeout: float = 0.5) -> bool:
    """True if PostgreSQL answers an SSLRequest (``S`` or ``N``: it speaks the protocol)."""
    ssl_request = b"\x00\x00\x00\x08\x04\xd2\x16\x2f"
    return _answers(POSTGRES_URL, 5432, ssl_request, b"N", timeout) or _answers(
        POSTGRES_URL, 5432, ssl_request, b"S", timeout
    )


def mariadb_reachable(timeout: float = 0.5) -> bool:
    """True if MariaDB (or MySQL) greets a connection with its handshake (protocol 10)."""
    address = urlsplit(MARIADB_URL)
    try:
        with socket.create_connection(
            (address.hostname or "127.0.0.1", address.port or 3306), timeout=timeout
        ) as sock:
            return sock.recv(5)[4:5] == b"\x0a"
    except OSError:
        return False


def unavailable(message: str, *, required: bool | None = None, because: str = "") -> NoReturn:
    """Skip the calling test saying ``message``, or fail it when ``required`` (default: when
    CI's variable is set), saying ``because`` (default: that variable)."""
    if services_required() if required is None else required:
        pytest.fail(
            f"{message}; {because}"
            if because
            else f"{message}, and {REQUIRE_SERVICES_ENV}=1 requires it"
        )
    pytest.skip(message)


def require_service(name: str, reachable: Callable[[], bool]) -> None:
    """Skip the calling test when ``reachable()`` is False; fail it under CI's variable."""
    if not reachable():
        unavailable(f"{name} is not reachable")


def require_redis() -> None:
    require_service(f"Redis at {REDIS_URL_BASE}", redis_reachable)


def require_rabbitmq() -> None:
    require_service(f"RabbitMQ at {RABBITMQ_URL}", rabbitmq_reachable)


def require_postgres() -> None:
    """Skip the calling test without PostgreSQL; fail it under CI's variable for it."""
    if not postgres_reachable():
        unavailable(
            f"PostgreSQL at {POSTGRES_URL} is not reachable",
            required=os.environ.get(REQUIRE_POSTGRES_ENV) == "1",
            because=f"{REQUIRE_POSTGRES_ENV}=1 requires it",
        )


def require_mariadb() -> None:
    """Skip the calling test without MariaDB; fail it under CI's variable for the fenced
    stores' databases (``CELERY_DFLOCK_REQUIRE_POSTGRES``: CI's machine runs both)."""
    if not mariadb_reachable():
        unavailable(
            f"MariaDB at {MARIADB_URL} is not reachable",
            required=os.environ.get(REQUIRE_POSTGRES_ENV) == "1",
            because=f"{REQUIRE_POSTGRES_ENV}=1 requires it",
        )
