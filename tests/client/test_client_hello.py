"""What the client learns from ``hello``, once per server (issue 13, points 11 and 12)."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest

from celery_dflock import (
    AsyncConnectionPool,
    AsyncDistributedLock,
    AuthError,
    ConnectionPool,
    DistributedLock,
    InvalidValueError,
    ProtocolError,
    ServerDraining,
)
from celery_dflock.client._core import LockCore
from celery_dflock.client._replies import ErrorReply, Granted, JsonReply, Ok
from celery_dflock.client._requests import Command
from celery_dflock.client._servers import LEGACY_SERVER, ServerInfo, server_info
from celery_dflock.client._settings import ClientSettings, Endpoint
from dflockd_server import constants
from dflockd_server.testing import ServerThread

TOKEN = "0000018f2b3c4d5e" + "a1b2c3d4e5f60718"
ENDPOINT = Endpoint("127.0.0.1", 1)


def test_server_info_from_each_reply_to_hello() -> None:
    ours = server_info(
        ENDPOINT,
        JsonReply({"server": "dflockd-server", "version": "0.2.0", "features": ["fence", "ping"]}),
    )
    assert (ours.name, ours.version, ours.legacy, ours.fences) == (
        "dflockd-server",
        "0.2.0",
        False,
        True,
    )
    assert ours.supports("ping") and not ours.supports("stats")
    assert server_info(ENDPOINT, ErrorReply("error")) == LEGACY_SERVER
    assert LEGACY_SERVER.legacy and not LEGACY_SERVER.fences
    with pytest.raises(AuthError, match="auth_token"):
        server_info(ENDPOINT, ErrorReply("error_auth"))
    with pytest.raises(ServerDraining, match="shutting down"):
        server_info(ENDPOINT, ErrorReply("error_draining"))
    with pytest.raises(ProtocolError, match="hello"):
        server_info(ENDPOINT, Ok())


def _core() -> LockCore:
    settings = ClientSettings.checked([(ENDPOINT.host, ENDPOINT.port)], connect_timeout_s=1)
    return LockCore("k", settings, acquire_timeout_s=0, lease_ttl_s=None)


@pytest.mark.parametrize(
    ("server", "fence"),
    [
        (
            ServerInfo("dflockd-server", "0.2.0", frozenset({constants.FEATURE_FENCE})),
            0x18F2B3C4D5E,
        ),
        (LEGACY_SERVER, None),
        (ServerInfo("other", "1", frozenset({"ping"})), None),
        (None, None),
    ],
)
def test_fence_only_from_a_server_that_lists_fence(
    server: ServerInfo | None, fence: int | None
) -> None:
    core = _core()
    assert core.on_grant_reply(Command.LOCK, Granted(TOKEN, 33), time.monotonic(), server)
    assert core.grant.token == TOKEN and core.grant.fence == fence


def test_a_pool_asks_our_server_hello_once(dflock_server: ServerThread) -> None:
    with ConnectionPool() as pool:
        assert pool.server_info(*dflock_server.address) is None
        for _ in range(3):
            with DistributedLock("hello:once", servers=[dflock_server.address], pool=pool) as lk:
                assert lk.token is not None and lk.fence == int(lk.token[:16], 16)
        info = pool.server_info(*dflock_server.address)
        assert info is not None and info.name == constants.SERVER_NAME and info.fences
        assert set(constants.FEATURES) <= info.features
        assert (pool.opened, pool.reused) == (1, 2)


def test_an_async_pool_learns_our_server_too(dflock_server: ServerThread) -> None:
    async def main() -> tuple[int | None, ServerInfo | None]:
        async with (
            AsyncConnectionPool() as pool,
            AsyncDistributedLock("hello:async", servers=[dflock_server.address], pool=pool) as lock,
        ):
            return lock.fence, pool.server_info(*dflock_server.address)

    fence, info = asyncio.run(main())
    assert fence is not None and info is not None and info.fences


def test_hello_tells_the_longest_lease_and_a_longer_one_is_refused_before_asking(
    dflock_server_factory: Any,
) -> None:
    """The server's --max-lease-ttl is learned from hello (issue 29); a lease above it is
    refused by the client with what to change, instead of the server's bare ``error``."""
    server: ServerThread = dflock_server_factory(max_lease_ttl_s=30, default_lease_ttl_s=10)
    servers = [server.address]
    lock = DistributedLock("max:lease", lease_ttl_s=31, servers=servers)
    with pytest.raises(InvalidValueError) as refused:
        lock.acquire()
    message = str(refused.value)
    assert "(31 s) is above the longest lease server" in message
    assert "grants (30 s, its --max-lease-ttl" in message
    assert "Ask for a shorter lease (lease_ttl_s)" in message  # the argument it was given as
    with pytest.raises(InvalidValueError, match="--max-lease-ttl"):
        DistributedLock("max:lease", lease_ttl_s=31, servers=servers).enqueue()
    ok = DistributedLock("max:lease", lease_ttl_s=30, servers=servers)
    assert ok.acquire()
    assert ok.release()


def test_a_hello_without_the_limit_leaves_the_lease_to_the_server(
    dflock_server: ServerThread,
) -> None:
    """A server whose hello does not say its limit (another dflockd-compatible server) is
    asked as before: its own answer decides."""
    body = {"server": "other", "version": "1", "features": ["fence", "ping"]}
    hello = f"ok {json.dumps(body)}\n".encode()
    dflock_server.call(lambda: setattr(dflock_server.server, "_hello", hello))
    servers = [dflock_server.address]
    lock = DistributedLock("no:limit", lease_ttl_s=60, servers=servers)
    assert lock.acquire()
    assert lock.release()
    with pytest.raises(ProtocolError, match="--max-lease-ttl"):  # the server's own refusal
        DistributedLock("no:limit", lease_ttl_s=301, servers=servers).acquire()


def test_server_info_reads_only_a_positive_whole_limit() -> None:
    def limit(value: object) -> int | None:
        data = {"server": "s", "version": "1", "features": [], "max_lease_ttl_s": value}
        return server_info(ENDPOINT, JsonReply(data)).max_lease_ttl_s

    assert limit(300) == 300
    assert limit(0) is None
    assert limit("300") is None
    assert limit(True) is None
    assert server_info(ENDPOINT, JsonReply({"server": "s"})).max_lease_ttl_s is None
