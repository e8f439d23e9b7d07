"""TLS connections, renewal timing rules and pool ownership rules."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import socket
import ssl
import struct
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest

from celery_dflock import (
    AsyncConnectionPool,
    AsyncDistributedLock,
    ConnectionPool,
    DflockError,
    DistributedLock,
    ServerUnavailable,
)
from celery_dflock.client._connection import SocketTransport
from celery_dflock.client._core import LockCore
from celery_dflock.client._settings import MAX_RENEW_INTERVAL_S, ClientSettings, Endpoint
from dflockd_server import constants
from dflockd_server.testing import ServerThread


def test_tls_sync_and_pooled(
    dflock_server_factory: Callable[..., ServerThread],
    tls_files: tuple[str, str],
    pool: ConnectionPool,
) -> None:
    cert, key = tls_files
    server = dflock_server_factory(tls_cert=cert, tls_key=key)
    context = ssl.create_default_context(cafile=cert)
    for _ in range(2):
        with DistributedLock(
            "tls", servers=[server.address], ssl_context=context, pool=pool
        ) as lock:
            assert lock.owned() and lock.renew()
    assert (pool.opened, pool.reused) == (1, 1)  # reuse of a TLS connection is checked by ping
    with pytest.raises(ServerUnavailable, match="TLS"):
        DistributedLock(
            "tls", servers=[server.address], ssl_context=ssl.create_default_context()
        ).acquire()


async def test_tls_async(
    dflock_server_factory: Callable[..., ServerThread], tls_files: tuple[str, str]
) -> None:
    cert, key = tls_files
    server = dflock_server_factory(tls_cert=cert, tls_key=key)
    context = ssl.create_default_context(cafile=cert)
    async with AsyncDistributedLock("tls", servers=[server.address], ssl_context=context) as lock:
        assert lock.owned() and await lock.renew()
    with pytest.raises(ServerUnavailable, match=r"127\.0\.0\.1.*certificate"):
        await AsyncDistributedLock(
            "tls", servers=[server.address], ssl_context=ssl.create_default_context()
        ).acquire()


async def test_tls_to_a_plain_server_says_it_answers_without_tls(
    dflock_server: ServerThread, tls_files: tuple[str, str]
) -> None:
    """Both faces said "start it or check the server list" of a server that answered, in
    plain TCP; the hint is now the setting to change (or the server's TLS flags)."""
    context = ssl.create_default_context(cafile=tls_files[0])
    said = "answers without TLS.*ssl_context=None.*dflock_ssl.*--tls-cert"
    with pytest.raises(ServerUnavailable, match=said):
        DistributedLock("tls", servers=[dflock_server.address], ssl_context=context).acquire()
    with pytest.raises(ServerUnavailable, match=said):
        await AsyncDistributedLock(
            "tls", servers=[dflock_server.address], ssl_context=context
        ).acquire()


async def test_plain_to_a_tls_server_says_it_may_require_tls(
    dflock_server_factory: Callable[..., ServerThread], tls_files: tuple[str, str]
) -> None:
    """A TLS server closes a plain client's connection at its hello: both faces said only
    "restarted, shutting down, or an idle/auth timeout"; the setting to give is named now."""
    cert, key = tls_files
    server = dflock_server_factory(tls_cert=cert, tls_key=key)
    said = "closed the connection during a hello.*requires TLS.*ssl_context=.*dflock_ssl"
    with pytest.raises(ServerUnavailable, match=said):
        DistributedLock("plain", servers=[server.address]).acquire()
    with pytest.raises(ServerUnavailable, match=said):
        await AsyncDistributedLock("plain", servers=[server.address]).acquire()


class _PausingContext(ssl.SSLContext):
    """A real client context whose holder pauses between its connect and its TLS handshake
    (a paused or busy process) while the peer resets that connection: ``connected`` is
    released once the connect has returned, and the handshake waits for ``resets``. (A reset
    the peer sends before the client's connect returns makes the connect fail instead, which
    a loaded CI run saw with a fixed 50 ms pause.)"""

    connected: threading.Semaphore
    resets: threading.Semaphore

    def wrap_socket(self, *args: Any, **kwargs: Any) -> ssl.SSLSocket:  # type: ignore[override]
        self.connected.release()
        assert self.resets.acquire(timeout=10), "the peer never reset the connection"
        return super().wrap_socket(*args, **kwargs)


def test_a_connection_reset_before_the_tls_handshake_leaves_no_socket_open(
    tls_files: tuple[str, str],
) -> None:
    """A server that dies (or resets the connection) between the client's connect and its TLS
    handshake: the client says it cannot reach the server and leaves no socket for the garbage
    collector. (CPython's ``SSLSocket`` raises there without closing the socket it made: on a
    lock server killed during a reconnection, the client leaked it, and a test saw the
    ``ResourceWarning``.)"""
    cert, _ = tls_files
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def reset_each() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                if not context.connected.acquire(timeout=10):
                    return
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.close()  # a reset, not a close
                context.resets.release()

    context = _PausingContext(ssl.PROTOCOL_TLS_CLIENT)
    context.connected = threading.Semaphore(0)
    context.resets = threading.Semaphore(0)
    context.load_verify_locations(cert)
    threading.Thread(target=reset_each, daemon=True).start()
    unraisable: list[str] = []
    hook = sys.unraisablehook
    sys.unraisablehook = lambda raised: unraisable.append(repr(raised.exc_value))
    said: list[str] = []
    try:
        for _ in range(5):
            with pytest.raises(ServerUnavailable) as raised:
                SocketTransport.open(Endpoint("127.0.0.1", port, ssl_context=context))
            said.append(str(raised.value))
            gc.collect()
    finally:
        sys.unraisablehook = hook
        listener.close()
    assert all("TLS setup" in message for message in said), said  # (reset after the connect)
    assert unraisable == []


def _core(lease_ttl_s: int, renew_ratio: float = 0.5) -> LockCore:
    settings = ClientSettings.checked([("127.0.0.1", 1)], renew_ratio=renew_ratio)
    core = LockCore("k", settings, acquire_timeout_s=0, lease_ttl_s=lease_ttl_s)
    core.grant.lease = lease_ttl_s  # as the server would grant it
    return core


def test_renew_interval_is_lease_times_ratio_below_the_read_timeout() -> None:
    assert _core(2).renew_interval() == 1.0
    assert _core(10, 0.3).renew_interval() == pytest.approx(3.0)
    assert _core(constants.DEFAULT_LEASE_TTL_S).renew_interval() == 16.5
    # a long lease must still renew before the server's idle read timeout closes the connection
    assert _core(3600).renew_interval() == MAX_RENEW_INTERVAL_S
    assert MAX_RENEW_INTERVAL_S < constants.DEFAULT_READ_TIMEOUT_S


async def test_async_pool_belongs_to_one_event_loop(dflock_server: ServerThread) -> None:
    pool = AsyncConnectionPool()
    async with AsyncDistributedLock("loop", servers=[dflock_server.address], pool=pool):
        pass
    errors: list[BaseException] = []

    async def elsewhere() -> None:
        await AsyncDistributedLock("loop", servers=[dflock_server.address], pool=pool).acquire()

    def other_thread() -> None:
        try:
            asyncio.run(elsewhere())
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=other_thread)
    thread.start()
    await asyncio.to_thread(thread.join, 10)
    assert len(errors) == 1 and isinstance(errors[0], DflockError)
    assert "create one pool per event loop" in str(errors[0])
    opened = pool.opened
    await pool.aclose()
    async with AsyncDistributedLock("loop", servers=[dflock_server.address], pool=pool):
        assert pool.opened == opened + 1  # none kept after the close
    await pool.aclose()
