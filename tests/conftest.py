"""Shared fixtures: a real dflockd-compatible server on 127.0.0.1, port 0, in a thread."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from dflockd_server import Config
from dflockd_server.testing import ServerThread
from tests.support.certificates import key_of, make_certificate
from tests.support.etcd import EtcdServer, etcd_or_skip
from tests.support.ports import free_ports
from tests.support.schedule import longest_first
from tests.support.servers import LOCK_SERVER_LEASE_S
from tests.support.services import require_redis
from tests.support.workers import WorkerFactory

_TEST_DEFAULTS: dict[str, Any] = {
    "host": "127.0.0.1",
    "port": 0,
    # A test that ends with a waiter still in flight should not hold teardown for 30 s.
    "shutdown_timeout_s": 2.0,
}

ServerFactory = Callable[..., ServerThread]
WORKER_OUTPUT_CHARS = 6000
"""How much of each worker's output a failed test's report shows (its end)."""

settings.register_profile("suite", deadline=None)
settings.load_profile("suite")
"""Hypothesis's per-example deadline (200 ms) is a timing assertion: on CI's 2 loaded cores an
example of ``test_initial_map_is_even`` took longer and failed the suite. The examples'
count bounds each property test; their speed is not what they test."""


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The suite's longest files first (``tests/support/schedule.py``)."""
    longest_first(items)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test's report carries the output of each Celery worker its fixtures started
    (a ``WorkerFactory``, or a rig's ``factory``): CI keeps only the report."""
    outcome: Any = yield
    report: pytest.TestReport = outcome.get_result()
    if not report.failed:
        return
    funcargs: dict[str, object] = getattr(item, "funcargs", {})
    for name, value in funcargs.items():
        factory = getattr(value, "factory", value)
        if isinstance(factory, WorkerFactory):
            for worker in factory.workers:
                tail = worker.output()[-WORKER_OUTPUT_CHARS:]
                report.sections.append((f"worker {worker.name} (fixture {name})", tail))


@pytest.fixture(autouse=True)
def _state_home(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test keeps the lock servers' state directories (by default under
    ``$XDG_STATE_HOME/dflockd/<host>-<port>``) in a directory of its own, as a machine of its
    own would: a server a test starts on a port another test used never restores that test's
    leases. Servers started as subprocesses inherit it."""
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path_factory.mktemp("state-home")))


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


@pytest.fixture
def lock_server(dflock_server_factory: ServerFactory) -> ServerThread:
    """A running server whose default lease is ``LOCK_SERVER_LEASE_S`` (tests/beat has its own
    ``lock_server``: one that a test restarts on its port)."""
    return dflock_server_factory(default_lease_ttl_s=LOCK_SERVER_LEASE_S)


@pytest.fixture
def static_fleet() -> Iterator[list[ServerThread]]:
    """Three real servers started with the same ``--members`` list, each advertising itself
    (static members: each serves only the keys the list's crc32 strategy gives it)."""
    ports = free_ports(3)
    members = tuple(f"127.0.0.1:{port}" for port in ports)
    servers = [
        ServerThread(Config(host="127.0.0.1", port=port, members=members, advertise=member)).start()
        for port, member in zip(ports, members, strict=True)
    ]
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture
def private_etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """A real etcd of the test's own (Debian's ``etcd-server``), stopped after it; skips
    without one, except on CI (see ``tests.support.etcd``)."""
    yield from etcd_or_skip(tmp_path_factory.mktemp("etcd"))


@pytest.fixture
def redis_required() -> None:
    """Skip when Redis does not answer; fail instead under CELERY_DFLOCK_REQUIRE_REDIS=1 (CI),
    so a Redis test never silently stops running."""
    require_redis()


@pytest.fixture(scope="session")
def built_dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Both distributions of this checkout (wheels and sdists, the server's wheel compiled),
    built once per session, for all its pytest-xdist workers (a test that uses it may wait for
    the C build: give it ``BUILD_TIMEOUT_S``)."""
    from tests.support.venvs import build_dist_once

    return build_dist_once(tmp_path_factory.getbasetemp())


@pytest.fixture
def tls_files(tmp_path: Path) -> tuple[str, str]:
    """A self-signed certificate for 127.0.0.1 and its key, as paths in strings (tests/server
    overrides it with the same files as Path objects)."""
    cert = make_certificate(tmp_path)
    return str(cert), str(key_of(cert))
