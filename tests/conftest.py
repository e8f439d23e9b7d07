"""Shared fixtures: a real dflockd-compatible server on 127.0.0.1, port 0, in a thread."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from dflockd_server import Config
from dflockd_server.testing import ServerThread

_TEST_DEFAULTS: dict[str, Any] = {
    "host": "127.0.0.1",
    "port": 0,
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
