"""The blocking connection's socket handling: non-blocking socket, replies waited for with poll.

Against the real server: a request costs send, poll, recv; a dead peer is noticed before reuse.
The one path the server cannot produce, a send the kernel only partly takes, is driven from a
socket pair whose buffers are filled first.
"""

from __future__ import annotations

import select
import socket
import threading

import pytest

from celery_dflock import ServerUnavailable
from celery_dflock.client import _replies, _requests
from celery_dflock.client._connection import SocketTransport
from celery_dflock.client._requests import Command, checked_lock, checked_release
from celery_dflock.client._settings import Endpoint
from celery_dflock.client._sync.connection import Connection
from dflockd_server.testing import ServerThread
from tests.support.waiting import wait_until

pytestmark = pytest.mark.skipif(not hasattr(select, "poll"), reason="needs select.poll")


def _endpoint(address: tuple[str, int]) -> Endpoint:
    return Endpoint(address[0], address[1])


def test_requests_on_a_non_blocking_socket(dflock_server: ServerThread) -> None:
    conn = Connection.open(_endpoint(dflock_server.address))
    try:
        sock = conn.transport.sock
        assert sock.gettimeout() == 0.0  # non-blocking: waits are poll's
        grant = conn.request(Command.LOCK, checked_lock("io", 0, None))
        assert isinstance(grant, _replies.Granted)
        assert conn.is_reusable()
        assert conn.request(Command.RELEASE, checked_release("io", grant.token)) == (_replies.Ok())
        assert conn.is_reusable()
    finally:
        conn.close()
    assert not conn.is_reusable()


def test_a_connection_the_server_closed_is_not_reused(
    dflock_server_factory: type[ServerThread],
) -> None:
    server = dflock_server_factory()
    conn = Connection.open(_endpoint(server.address))
    # (a ping first: the server has then surely taken the connection in before it stops)
    assert conn.request(Command.PING, _requests.PING_REQUEST) == _replies.Ok()
    assert conn.is_reusable()
    server.stop()
    wait_until(lambda: not conn.is_reusable(), what="EOF seen by poll")
    with pytest.raises(ServerUnavailable):
        conn.request(Command.PING, _requests.PING_REQUEST)
    assert conn.closed


def _fill(sock: socket.socket) -> int:
    """Write to ``sock`` (non-blocking) until the kernel takes no more; bytes written."""
    total = 0
    chunk = b"x" * 65536
    while True:
        try:
            total += sock.send(chunk)
        except BlockingIOError:
            return total


def test_a_send_the_kernel_takes_in_parts_completes() -> None:
    ours, peer = socket.socketpair()
    with ours, peer:
        pair = Endpoint("pair", 1)
        conn = Connection(pair, SocketTransport(pair, ours))  # made non-blocking by it
        junk = _fill(ours)
        request = _requests.PING_REQUEST
        got = bytearray()

        def serve() -> None:
            # Drain slowly (the connection must wait for room), then answer the ping.
            while len(got) < junk + len(request):
                got.extend(peer.recv(4096))
            peer.sendall(b"ok\n")

        thread = threading.Thread(target=serve)
        thread.start()
        try:
            reply = conn.request(Command.PING, request, timeout=10.0)
        finally:
            thread.join(10.0)
        assert reply == _replies.Ok()
        assert bytes(got[junk:]) == request  # intact, after everything sent before it


def test_a_send_that_never_finds_room_times_out_and_closes() -> None:
    ours, peer = socket.socketpair()
    with ours, peer:
        pair = Endpoint("pair", 1)
        conn = Connection(pair, SocketTransport(pair, ours))
        _fill(ours)  # nobody reads the peer
        with pytest.raises(ServerUnavailable, match="no reply"):
            conn.request(Command.PING, _requests.PING_REQUEST, timeout=0.3)
        assert conn.closed


def test_an_idle_check_says_what_it_saw() -> None:
    # What `idle_breakage` says is what a dropped held connection's log and lost reason show:
    # bytes nobody asked for (left unread), the peer's EOF, this client's close.
    ours, peer = socket.socketpair()
    with ours, peer:
        pair = Endpoint("pair", 1)
        conn = Connection(pair, SocketTransport(pair, ours))
        assert conn.idle_breakage() is None and not conn.broken_while_idle()
        peer.sendall(b"ok 0123456789abcdef0123456789abcdef 3\n" * 2)
        seen = "over 40 byte(s) nobody asked for (b'ok 0123456789abcdef0123456789abcdef 3\\nok')"
        assert conn.idle_breakage() == seen
        assert conn.idle_breakage() == seen  # peeked, not read
        assert not conn.transport.quiet() and conn.broken_while_idle()
        ours.recv(1024)
        peer.shutdown(socket.SHUT_WR)
        assert conn.idle_breakage() == "EOF from the peer"
        conn.close()
        assert conn.idle_breakage() == "closed by this client"
