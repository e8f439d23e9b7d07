"""Shared fixtures: a real dflockd-compatible server on 127.0.0.1, port 0, in a thread."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dflockd_server import Config
from dflockd_server.testing import ServerThread

_TEST_DEFAULTS: dict[str, Any] = {
    "host": "127.0.0.1",
    "port": 0,
    # Tests that restart a server on the port it was given test reconnects, not the restart
    # grace (tests/server/test_grace.py and tests/faults do).
    "restart_grace_s": 0.0,
    # A test that ends with a waiter still in flight should not hold teardown for 30 s.
    "shutdown_timeout_s": 2.0,
}

ServerFactory = Callable[..., ServerThread]


@pytest.fixture
def dflock_server_factory() -> Iterator[ServerFactory]:
    """``make(config=None, **overrides)`` -> a started ``ServerThread``; all stopped at teardown."""
    started: list[ServerThread] = []

    def make(config: Config | None = None, **overrides: Any) -> ServerThread:
        if config is None:
            config = Config(**{**_TEST_DEFAULTS, **overrides})
        elif overrides:
            config = dataclasses.replace(config, **overrides)
        server = ServerThread(config)
        started.append(server)
        return server.start()

    yield make
    for server in reversed(started):
        server.stop()


@pytest.fixture
def dflock_server(dflock_server_factory: ServerFactory) -> ServerThread:
    """A running server with default settings on 127.0.0.1 (ephemeral port)."""
    return dflock_server_factory()


REQUIRE_REDIS_ENV = "CELERY_DFLOCK_REQUIRE_REDIS"


@pytest.fixture
def redis_required() -> None:
    """Skip when Redis at 127.0.0.1:6379 does not answer; fail instead under
    CELERY_DFLOCK_REQUIRE_REDIS=1 (CI), so a Redis test never silently stops running."""
    import redis

    try:
        with redis.Redis(host="127.0.0.1", port=6379, socket_connect_timeout=0.5) as client:
            client.ping()
    except redis.RedisError as exc:
        message = f"Redis at 127.0.0.1:6379 is not reachable ({exc})"
        if os.environ.get(REQUIRE_REDIS_ENV) == "1":
            pytest.fail(f"{message}, and {REQUIRE_REDIS_ENV}=1 requires it")
        pytest.skip(message)


@pytest.fixture(scope="session")
def built_dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both distributions of this checkout (wheels and sdists), built once per session."""
    from venvs import build_dist

    return build_dist(tmp_path_factory.mktemp("dist"))


@pytest.fixture
def tls_files(tmp_path: Path) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 (made with the openssl command), as paths in
    strings (tests/server has its own, as Path objects)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("the openssl command is needed to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
            "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
            "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=30,
    )  # fmt: skip
    return str(cert), str(key)
