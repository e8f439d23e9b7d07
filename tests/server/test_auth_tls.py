"""Shared-secret ``auth`` and TLS, over real sockets."""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from dflockd_server import Config, constants
from dflockd_server.testing import ServerThread
from tests.support.waiting import wait_until
from tests.support.wire import Wire, unclosed_after_gc

ServerFactory = Callable[..., ServerThread]
SECRET = "correct horse battery staple"


def test_auth_required_before_anything_else(dflock_server_factory: ServerFactory) -> None:
    srv = dflock_server_factory(auth_token=SECRET)
    with Wire(srv.address) as w:
        assert w.req("ping") == "error_auth"
        assert w.closed_by_server()
    with Wire(srv.address) as w:
        assert w.req("bogus", "", "") == "error_auth"  # even a malformed request
        assert w.closed_by_server()
    with Wire(srv.address) as w:
        assert w.req("hello") == "error_auth"  # hello too: auth comes first
        assert w.closed_by_server()


def test_wrong_secret_is_refused_and_closed(dflock_server_factory: ServerFactory) -> None:
    srv = dflock_server_factory(auth_token=SECRET)
    with Wire(srv.address) as holder:
        assert holder.req("auth", "_", SECRET) == "ok"
        token = holder.lock("k")
        with Wire(srv.address) as w:
            assert w.req("auth", "_", SECRET + "x") == "error_auth"
            assert w.closed_by_server()
        with Wire(srv.address) as w:
            assert w.req("auth", "_", "") == "error_auth"
            assert w.closed_by_server()
        assert holder.req("n", "k", f"{token} 5") == "ok 5"


def test_right_secret_then_commands(dflock_server_factory: ServerFactory) -> None:
    srv = dflock_server_factory(auth_token=SECRET)
    with Wire(srv.address) as w:
        assert w.req("auth", "_", SECRET) == "ok"
        token = w.lock("k")
        assert w.req("r", "k", token) == "ok"
        assert w.req("auth", "_", SECRET) == "ok"  # re-authenticating is harmless
        assert w.req("hello").startswith('ok {"server":"dflockd-server"')


def test_auth_without_a_configured_secret_is_an_error(dflock_server: ServerThread) -> None:
    with Wire(dflock_server.address) as w:
        assert w.req("auth", "_", "anything") == "error"
        assert w.req("ping") == "ok"


def test_secret_of_64_kib_and_secret_file(
    dflock_server_factory: ServerFactory, tmp_path: Path
) -> None:
    long_secret = "s" * constants.MAX_AUTH_LINE_BYTES
    path = tmp_path / "secret"
    path.write_text(long_secret + "\n")
    srv = dflock_server_factory(auth_token_file=str(path))
    with Wire(srv.address) as w:
        assert w.req("auth", "_", long_secret) == "ok"
        assert w.req("ping") == "ok"
    with Wire(srv.address) as w:
        w.send("auth", "_", long_secret + "ss")  # over the auth line limit
        assert w.recv() == "error"
        assert w.closed_by_server()


# ---------------------------------------------------------------------------------- TLS
def test_tls_with_auth(dflock_server_factory: ServerFactory, tls_files: tuple[Path, Path]) -> None:
    cert, key = tls_files
    srv = dflock_server_factory(tls_cert=str(cert), tls_key=str(key), auth_token=SECRET)
    ctx = ssl.create_default_context(cafile=str(cert))
    with Wire(srv.address, ssl_context=ctx) as w:
        assert w.req("auth", "_", SECRET) == "ok"
        token = w.lock("k")
        assert w.req("r", "k", token) == "ok"
    # A plain-text client gets nowhere.
    with Wire(srv.address) as plain:
        plain.send("ping")
        try:
            reply = plain.reader.readline()
        except ConnectionResetError:
            reply = b""
        assert not reply.startswith(b"ok")
    # A client that does not trust the certificate fails its handshake.
    with pytest.raises(ssl.SSLError):
        Wire(srv.address, ssl_context=ssl.create_default_context())


def test_stalled_tls_handshakes_are_dropped_after_the_read_timeout(
    tls_files: tuple[Path, Path], loop_factory: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    """TLS works on both loops; a connection that never finishes its handshake is dropped
    after the read timeout (not asyncio's 60 s), and the server goes on serving."""
    ctx = ssl.create_default_context(cafile=str(tls_files[0]))
    config = _tls_config(tls_files, read_timeout_s=1.0)
    with ServerThread(config, loop_factory=loop_factory) as srv:
        with Wire(srv.address, ssl_context=ctx) as w:
            token = w.lock("k")
            assert w.req("r", "k", token) == "ok"
        stalled = [socket.create_connection(srv.address) for _ in range(3)]
        try:
            for sock in stalled:
                sock.settimeout(10)  # far below asyncio's own 60 s handshake timeout
                assert sock.recv(1) == b""
            with Wire(srv.address, ssl_context=ctx) as w:
                assert w.req("ping") == "ok"
        finally:
            for sock in stalled:
                sock.close()


HALF_HELLO = b"\x16\x03\x01"
"""The first bytes of a TLS ClientHello: a handshake begun and never finished."""


@contextmanager
def _half_handshakes(address: tuple[str, int], n: int) -> Iterator[list[socket.socket]]:
    """``n`` connections that start a TLS handshake and stall in it; closed on the way out."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            sock = socket.create_connection(address, timeout=5)
            sock.sendall(HALF_HELLO)
            socks.append(sock)
        yield socks
    finally:
        for sock in socks:
            sock.close()


def _closed_by_the_server(sock: socket.socket) -> bool:
    """True once the server has closed ``sock`` (EOF or a reset within 5 s), False if it is
    still open then."""
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _tls_config(tls_files: tuple[Path, Path], **overrides: Any) -> Config:
    """A TLS server on 127.0.0.1, any port, that stops within a second."""
    cert, key = tls_files
    return Config(
        host="127.0.0.1",
        port=0,
        tls_cert=str(cert),
        tls_key=str(key),
        shutdown_timeout_s=1,
        **overrides,
    )


@pytest.mark.parametrize("cap", ["max_connections", "max_connections_per_ip"])
def test_tls_handshakes_count_against_the_connection_caps(
    tls_files: tuple[Path, Path],
    loop_factory: Callable[[], asyncio.AbstractEventLoop],
    cap: str,
) -> None:
    # A connection holds a slot from the moment it is accepted, handshake or not: connections
    # that never finish theirs cannot pile up past the caps for the handshake timeout.
    ctx = ssl.create_default_context(cafile=str(tls_files[0]))
    with (
        ServerThread(_tls_config(tls_files, **{cap: 4}), loop_factory=loop_factory) as srv,
        _half_handshakes(srv.address, 4) as stalled,
    ):
        wait_until(
            lambda: len(srv.server.admission.connections) == 4,
            what="4 connections in their handshake",
        )
        with _half_handshakes(srv.address, 1) as (extra,):
            assert _closed_by_the_server(extra), "a connection past the cap was kept open"
        stalled.pop().close()
        wait_until(lambda: len(srv.server.admission.connections) == 3, what="a slot freed")
        with Wire(srv.address, ssl_context=ctx) as w:
            assert w.req("ping") == "ok"
        assert srv.server.admission.connections_refused == 1


def test_stop_closes_the_connections_in_their_tls_handshake(
    tls_files: tuple[Path, Path], loop_factory: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    srv = ServerThread(_tls_config(tls_files), loop_factory=loop_factory).start()
    with _half_handshakes(srv.address, 20) as stalled:
        wait_until(
            lambda: len(srv.server.admission.connections) == 20,
            what="20 connections in their handshake",
        )
        srv.stop()
        assert srv.server.admission.connections == set()
        still_open = [sock for sock in stalled if not _closed_by_the_server(sock)]
        assert not still_open, f"{len(still_open)} of 20 left open by stop()"
    unclosed = unclosed_after_gc()
    assert not unclosed, f"{len(unclosed)} left for the garbage collector, e.g. {unclosed[:2]}"


def test_past_max_tls_handshakes_the_oldest_handshake_is_dropped(
    tls_files: tuple[Path, Path], loop_factory: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    # Connections that never finish their handshake take no more than the cap: a new one
    # pushes the oldest out, so they cannot lock real clients out while they last.
    ctx = ssl.create_default_context(cafile=str(tls_files[0]))
    config = _tls_config(tls_files, max_tls_handshakes=4)
    with (
        ServerThread(config, loop_factory=loop_factory) as srv,
        _half_handshakes(srv.address, 4) as stalled,
    ):
        wait_until(
            lambda: len(srv.server.admission.handshaking) == 4, what="4 handshakes under way"
        )
        with _half_handshakes(srv.address, 1):
            assert _closed_by_the_server(stalled[0]), "the oldest handshake was kept"
            assert all(_still_open_now(sock) for sock in stalled[1:])
            with Wire(srv.address, ssl_context=ctx) as w:  # pushes out the next oldest
                assert w.req("ping") == "ok"
            assert len(srv.server.admission.handshaking) <= 4


def _still_open_now(sock: socket.socket) -> bool:
    """True while the server has not closed ``sock`` (nothing to read right now)."""
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True
    except ConnectionResetError:
        return False
    finally:
        sock.setblocking(True)


def test_a_handshake_that_drips_is_dropped_at_the_handshake_timeout(
    tls_files: tuple[Path, Path], loop_factory: Callable[[], asyncio.AbstractEventLoop]
) -> None:
    # A client that keeps sending handshake bytes is never idle, so the read timeout alone
    # would keep it: the handshake has a deadline of its own.
    ctx = ssl.create_default_context(cafile=str(tls_files[0]))
    config = _tls_config(tls_files, tls_handshake_timeout_s=0.5, read_timeout_s=30)
    with ServerThread(config, loop_factory=loop_factory) as srv:
        with socket.create_connection(srv.address, timeout=5) as sock:
            sock.sendall(HALF_HELLO + b"\x40\x00")  # a ClientHello record of 16 KiB to come
            assert _drips_until_closed(sock, 5.0), "a dripping handshake outlived 5 s"
        with Wire(srv.address, ssl_context=ctx) as w:
            assert w.req("ping") == "ok"


def _drips_until_closed(sock: socket.socket, seconds: float) -> bool:
    """Send a byte every 50 ms until the server closes ``sock`` (True) or ``seconds`` pass."""
    deadline = time.monotonic() + seconds
    sock.settimeout(0.05)
    while time.monotonic() < deadline:
        try:
            sock.sendall(b"\x01")
            if sock.recv(1) == b"":
                return True
        except TimeoutError:
            continue
        except (BrokenPipeError, ConnectionResetError):
            return True
    return False


def test_a_close_notify_ends_the_connection_at_once(
    dflock_server_factory: ServerFactory, tls_files: tuple[Path, Path]
) -> None:
    """A client that ends its TLS session (``close_notify``, which asyncio's TLS transport
    sends on close and then waits for the server's) is answered at once, not at the server's
    read timeout (23 s), when only the idle connection's timer closed it."""
    cert, key = tls_files
    srv = dflock_server_factory(tls_cert=str(cert), tls_key=str(key))
    ctx = ssl.create_default_context(cafile=str(cert))

    async def ping_then_close() -> None:
        reader, writer = await asyncio.open_connection(*srv.address, ssl=ctx)
        writer.write(b"ping\n_\n_\n")
        await writer.drain()
        assert await reader.readline() == b"ok\n"
        writer.close()
        await asyncio.wait_for(writer.wait_closed(), constants.DEFAULT_READ_TIMEOUT_S / 4)

    asyncio.run(ping_then_close())


def test_a_close_notify_during_a_wait_frees_the_connections_grants_at_once(
    dflock_server_factory: ServerFactory, tls_files: tuple[Path, Path]
) -> None:
    """A TLS client that ends its session while one of its acquires waits closed the
    connection itself, as a plain client's FIN does then: the locks it holds are freed at once
    (auto-release), not kept to the end of their lease as after a close by the server."""
    cert, key = tls_files
    srv = dflock_server_factory(tls_cert=str(cert), tls_key=str(key))
    ctx = ssl.create_default_context(cafile=str(cert))

    async def hold_wait_then_close() -> None:
        reader, writer = await asyncio.open_connection(*srv.address, ssl=ctx)
        writer.write(b"l\nheld\n0 60\n")
        await writer.drain()
        assert (await reader.readline()).startswith(b"ok ")
        writer.write(b"l\nbusy\n30\n")  # waits: another connection holds it
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.close()
        await asyncio.wait_for(writer.wait_closed(), constants.DEFAULT_READ_TIMEOUT_S / 4)

    with Wire(srv.address, ssl_context=ctx) as other:
        other.lock("busy", lease=60)
        asyncio.run(hold_wait_then_close())
        wait_until(lambda: other.req("l", "held", "0").startswith("ok "), timeout=5)
