"""``transport.SocketTransport``, the compiled transport of the connections a server on its own
asyncio loop (``loops.TurnLoop``) accepts, against asyncio's own socket transport.

Each scenario runs twice on real sockets: a server on asyncio's selector loop with its own
transport, and the same server on a loop that hands every accepted connection a
``SocketTransport``. What the protocol sees (its calls, in order, with their arguments), what
the client reads and what reaches the loop's exception handler must be the same, and each
scenario also checks the part it is about, so that two transports that both did nothing could
not pass. Under ``test_compiled`` these run against the compiled transport.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from dflockd_server import Config
from dflockd_server.loops import TurnLoop
from dflockd_server.testing import ServerThread
from dflockd_server.transport import SocketTransport
from tests.support.wire import Wire

BIG = 16 * 1024 * 1024
"""More than a loopback socket's buffers take: the transport has to buffer and pause."""
WAIT_S = 10.0


class OursLoop(asyncio.SelectorEventLoop):
    """asyncio's selector loop whose accepted connections get a ``SocketTransport``."""

    def _make_socket_transport(  # pyright: ignore[reportIncompatibleMethodOverride]
        self,
        sock: socket.socket,
        protocol: asyncio.Protocol,
        waiter: asyncio.Future[None] | None = None,
        *,
        extra: dict[str, Any] | None = None,
        server: Any = None,
    ) -> asyncio.Transport:
        return SocketTransport(self, sock, protocol, waiter=waiter, extra=extra, server=server)


class Recorder(asyncio.Protocol):
    """Records every call the transport makes; ``on_*`` hooks let a scenario act."""

    def __init__(self) -> None:
        self.events: list[tuple[Any, ...]] = []
        self.transport: asyncio.Transport | None = None
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.paused: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.on_made: Callable[[asyncio.Transport], None] = lambda t: None
        self.on_data: Callable[[asyncio.Transport, bytes], None] = lambda t, d: None
        self.keep_open_on_eof = False
        self.on_eof: Callable[[asyncio.Transport], None] = lambda t: None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.events.append(("made", isinstance(peer, tuple)))
        self.on_made(transport)

    def data_received(self, data: bytes) -> None:
        self.events.append(("data", data))
        assert self.transport is not None
        self.on_data(self.transport, data)

    def eof_received(self) -> bool | None:
        self.events.append(("eof",))
        assert self.transport is not None
        self.on_eof(self.transport)
        return self.keep_open_on_eof

    def pause_writing(self) -> None:
        self.events.append(("pause_writing",))
        if not self.paused.done():
            self.paused.set_result(None)

    def resume_writing(self) -> None:
        self.events.append(("resume_writing",))

    def connection_lost(self, exc: Exception | None) -> None:
        self.events.append(("lost", type(exc).__name__ if exc is not None else None))
        if not self.lost.done():
            self.lost.set_result(None)


Scenario = Callable[
    [asyncio.AbstractEventLoop, asyncio.Server, Recorder, socket.socket], Awaitable[Any]
]


async def _read_all(loop: asyncio.AbstractEventLoop, client: socket.socket) -> bytes:
    """What the client reads until EOF (or a reset, which ends the read)."""
    chunks: list[bytes] = []
    while True:
        try:
            chunk = await asyncio.wait_for(loop.sock_recv(client, 1 << 20), WAIT_S)
        except ConnectionResetError:
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _run(loop_factory: Callable[[], asyncio.AbstractEventLoop], scenario: Scenario) -> Any:
    """Serve one connection on a loop from ``loop_factory`` and run ``scenario`` on it; the
    result: what the scenario returned, the protocol's calls, the exception handler's
    messages."""
    loop = loop_factory()
    handled: list[str] = []
    loop.set_exception_handler(lambda _loop, context: handled.append(context["message"]))

    async def main() -> Any:
        protocols: list[Recorder] = []

        def factory() -> Recorder:
            protocols.append(Recorder())
            return protocols[-1]

        server = await loop.create_server(factory, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        client = socket.socket()
        client.setblocking(False)
        try:
            await loop.sock_connect(client, ("127.0.0.1", port))
            while not protocols or protocols[0].transport is None:
                await asyncio.sleep(0.001)
            got = await asyncio.wait_for(scenario(loop, server, protocols[0], client), WAIT_S)
        finally:
            client.close()
            server.close()
        if protocols[0].transport is not None:
            protocols[0].transport.close()
        await asyncio.wait_for(protocols[0].lost, WAIT_S)
        await asyncio.wait_for(server.wait_closed(), WAIT_S)
        return got, protocols[0].events

    try:
        got, events = loop.run_until_complete(main())
    finally:
        loop.close()
    return got, events, handled


# ------------------------------------------------------------------ the scenarios
async def echo_then_half_close(
    loop: asyncio.AbstractEventLoop, server: asyncio.Server, proto: Recorder, client: socket.socket
) -> Any:
    """Requests answered; the client's EOF kept open for a last reply, then closed."""
    proto.on_data = lambda t, d: t.write(b"pong:" + d)
    proto.keep_open_on_eof = True

    def last_reply(t: asyncio.Transport) -> None:
        t.write(b"bye")
        t.close()

    def reply_later(t: asyncio.Transport) -> None:
        loop.call_later(0.01, last_reply, t)  # the transport stays open meanwhile

    proto.on_eof = reply_later
    await loop.sock_sendall(client, b"ping")
    first = await loop.sock_recv(client, 100)
    client.shutdown(socket.SHUT_WR)
    rest = await _read_all(loop, client)
    await proto.lost
    assert first + rest == b"pong:pingbye"
    return first + rest


async def eof_closes(
    loop: asyncio.AbstractEventLoop, server: asyncio.Server, proto: Recorder, client: socket.socket
) -> Any:
    """The client's EOF, not kept open: the transport closes."""
    client.shutdown(socket.SHUT_WR)
    rest = await _read_all(loop, client)
    await proto.lost
    assert rest == b""
    return rest


async def backpressure_then_close(
    loop: asyncio.AbstractEventLoop, server: asyncio.Server, proto: Recorder, client: socket.socket
) -> Any:
    """A write larger than the socket takes: buffered, the protocol paused; close waits for
    the buffer to drain, and every byte arrives in order."""
    payload = bytes(range(256)) * (BIG // 256)
    sizes: list[int] = []

    def big_reply(t: asyncio.Transport, _data: bytes) -> None:
        t.write(payload)
        sizes.append(t.get_write_buffer_size())
        t.close()
        sizes.append(int(t.is_closing()))

    proto.on_data = big_reply
    await loop.sock_sendall(client, b"go")
    await proto.paused  # the client has read nothing yet
    received = await _read_all(loop, client)
    await proto.lost
    assert sizes[0] > 0 and sizes[1] == 1
    assert received == payload
    return len(received)


async def abort_drops_the_buffer(
    loop: asyncio.AbstractEventLoop, server: asyncio.Server, proto: Recorder, client: socket.socket
) -> Any:
    """``abort`` with bytes buffered: the connection is lost at once, the rest never sent."""

    def write_then_abort(t: asyncio.Transport, _data: bytes) -> None:
        t.write(b"x" * BIG)
        t.abort()

    proto.on_data = write_then_abort
    await loop.sock_sendall(client, b"go")
    await proto.lost
    received = await _read_all(loop, client)
    assert len(received) < BIG
    return "short"


async def data_received_raises(
    loop: asyncio.AbstractEventLoop, server: asyncio.Server, proto: Recorder, client: socket.socket
) -> Any:
    """An error in the protocol goes to the loop's handler, and the connection is dropped."""

    def fail(_t: asyncio.Transport, _d: bytes) -> None:
        raise RuntimeError("the protocol failed")

    proto.on_data = fail
    await loop.sock_sendall(client, b"boom")
    await proto.lost
    return await _read_all(loop, client)


async def peer_resets(
    loop: asyncio.AbstractEventLoop, server: asyncio.Server, proto: Recorder, client: socket.socket
) -> Any:
    """The client resets the connection (SO_LINGER 0): a read error, lost with it."""
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.close()
    await proto.lost
    return None


async def paused_reading(
    loop: asyncio.AbstractEventLoop, server: asyncio.Server, proto: Recorder, client: socket.socket
) -> Any:
    """Nothing is read while reading is paused; all of it once it resumes."""
    transport = proto.transport
    assert transport is not None
    transport.pause_reading()
    paused = (transport.is_reading(), len(proto.events))
    await loop.sock_sendall(client, b"held")
    await asyncio.sleep(0.05)
    seen_while_paused = len(proto.events)
    transport.resume_reading()
    while len(proto.events) == seen_while_paused:
        await asyncio.sleep(0.001)
    assert paused == (False, seen_while_paused) and transport.is_reading()
    assert proto.events[-1] == ("data", b"held")
    return paused


async def writes_after_the_loss(
    loop: asyncio.AbstractEventLoop, server: asyncio.Server, proto: Recorder, client: socket.socket
) -> Any:
    """Writes after the connection was aborted are dropped quietly."""
    transport = proto.transport
    assert transport is not None
    transport.abort()
    for _ in range(3):
        transport.write(b"late")
    await proto.lost
    assert transport.is_closing()
    return await _read_all(loop, client)


async def server_close_waits_for_the_connection(
    loop: asyncio.AbstractEventLoop, server: asyncio.Server, proto: Recorder, client: socket.socket
) -> Any:
    """The listening server is closed with the connection still open: its ``wait_closed``
    behaves as with asyncio's own transport (on CPython 3.12 and later it waits for the
    connection), and it ends once the connection does."""
    transport = proto.transport
    assert transport is not None
    server.close()
    waiting = asyncio.ensure_future(server.wait_closed())
    await asyncio.sleep(0.05)
    done_while_open = waiting.done()
    close_clients = getattr(server, "close_clients", None)
    if close_clients is not None:  # CPython 3.13: the server closes its connections
        close_clients()
    else:
        transport.close()
    await proto.lost
    await asyncio.wait_for(waiting, WAIT_S)
    return done_while_open


SCENARIOS: list[Scenario] = [
    echo_then_half_close,
    eof_closes,
    backpressure_then_close,
    abort_drops_the_buffer,
    data_received_raises,
    peer_resets,
    paused_reading,
    writes_after_the_loss,
    server_close_waits_for_the_connection,
]

EXPECTED_EVENTS: dict[str, list[tuple[Any, ...]]] = {
    "echo_then_half_close": [("made", True), ("data", b"ping"), ("eof",), ("lost", None)],
    "eof_closes": [("made", True), ("eof",), ("lost", None)],
    "backpressure_then_close": [
        ("made", True),
        ("data", b"go"),
        ("pause_writing",),
        ("resume_writing",),
        ("lost", None),
    ],
    "abort_drops_the_buffer": [("made", True), ("data", b"go"), ("pause_writing",), ("lost", None)],
    "data_received_raises": [("made", True), ("data", b"boom"), ("lost", "RuntimeError")],
    "peer_resets": [("made", True), ("lost", "ConnectionResetError")],
    "paused_reading": [("made", True), ("data", b"held"), ("lost", None)],
    "writes_after_the_loss": [("made", True), ("lost", None)],
    "server_close_waits_for_the_connection": [("made", True), ("lost", None)],
}
"""What the protocol must see in each scenario (asyncio's transport sees the same)."""


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.__name__)
def test_the_compiled_transport_behaves_as_asyncios(scenario: Scenario) -> None:
    theirs = _run(asyncio.SelectorEventLoop, scenario)
    ours = _run(OursLoop, scenario)
    assert ours == theirs
    got, events, handled = ours
    assert events == EXPECTED_EVENTS[scenario.__name__], events
    if scenario is data_received_raises:
        assert handled == ["Fatal error: protocol.data_received() call failed."]
        assert got == b""
    else:
        assert handled == []


def test_the_server_on_its_own_loop_serves_through_the_compiled_transport(
    tmp_path: Path,
) -> None:
    """dflockd on asyncio's loop (a ``TurnLoop``) gives its connections a ``SocketTransport``;
    in debug mode they keep asyncio's own (its debug logging)."""

    def debug_loop() -> asyncio.AbstractEventLoop:
        loop = TurnLoop()
        loop.set_debug(True)
        return loop

    kinds: dict[str, str] = {}
    for name, factory in (("turn loop", TurnLoop), ("debug", debug_loop)):
        config = Config(host="127.0.0.1", port=0)
        with ServerThread(config, loop_factory=factory) as server, Wire(server.address) as wire:
            assert wire.req("l", "k", "0").startswith("ok ")

            def transports() -> list[str]:
                conns: Any = server.server.connections  # pyright: ignore[reportUnknownMemberType]
                return [type(c.transport).__name__ for c in conns]

            (kinds[name],) = server.call(transports)
    assert kinds == {"turn loop": "SocketTransport", "debug": "_SelectorSocketTransport"}
