"""Redis and RabbitMQ on this machine: where they are, whether they answer, and the rule for a
test that needs one: skip without it, fail instead when ``CELERY_DFLOCK_REQUIRE_REDIS=1`` (CI),
so a service-dependent test never silently stops running."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import NoReturn
from urllib.parse import urlsplit

import pytest

REDIS_URL_BASE = os.environ.get("CELERY_DFLOCK_TEST_REDIS_URL", "redis://127.0.0.1:6379")
"""Redis server of the ``redis`` tests (no database number; each test directory picks its
own database and each test its own queue name)."""
RABBITMQ_URL = os.environ.get(
    "CELERY_DFLOCK_TEST_RABBITMQ_URL", "amqp://guest:guest@127.0.0.1:5672//"
)
REQUIRE_SERVICES_ENV = "CELERY_DFLOCK_REQUIRE_REDIS"
"""Set to 1 (as CI does), a test that needs Redis or RabbitMQ fails instead of skipping."""


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
