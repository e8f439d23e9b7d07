"""The simulated network: TCP connections between client processes and a server process.

Each direction of a connection delivers its messages in order, each after a delay drawn from
the run's generator (now and then a long one: a congested link). A partition cuts a client off:
what either side sends meanwhile waits (TCP retransmits) and arrives, in order, once it heals.
A close is a FIN (after the data sent before it) and a reset an RST (what a killed process's
kernel sends: it drops what was still on its way to the side that reset).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from tests.sim.loop import Loop
from tests.sim.process import Process

__all__ = ["Conn", "Endpoint", "Network"]


class Endpoint(Protocol):
    """One side of a connection, as the network calls it."""

    def received(self, conn: Conn, data: bytes) -> None: ...

    def closed(self, conn: Conn, *, reset: bool) -> None: ...


class Network:
    """The links of the run: delays, partitions."""

    def __init__(self, loop: Loop) -> None:
        self.loop = loop
        self.cut: set[str] = set()
        """Names of the client processes cut off from the server (a partition)."""
        self._held: dict[str, list[Callable[[], None]]] = {}
        self._ids = 0

    def delay(self) -> float:
        rng = self.loop.rng
        if rng.random() < 0.02:
            return rng.uniform(0.05, 1.5)
        return rng.uniform(0.0002, 0.005)

    def partition(self, name: str, seconds: float) -> None:
        """Cut ``name`` off for ``seconds``."""
        if name in self.cut:
            return
        self.cut.add(name)
        self.loop.note(f"partition {name} for {seconds:.2f} s")
        self.loop.later(seconds, lambda: self.heal(name))

    def heal(self, name: str) -> None:
        if name not in self.cut:
            return
        self.cut.discard(name)
        self.loop.note(f"heal {name}")
        for deliver in self._held.pop(name, []):
            deliver()

    def connect(self, client: Process, server: Process, client_side: Endpoint) -> Conn:
        self._ids += 1
        return Conn(self, self._ids, client, server, client_side)

    def send(self, conn: Conn, to_server: bool, deliver: Callable[[], None]) -> None:
        """Carry one message of ``conn`` one way, in order with the ones before it."""
        if conn.client.name in self.cut:
            self._held.setdefault(conn.client.name, []).append(
                lambda: self.send(conn, to_server, deliver)
            )
            return
        at = self.loop.now + self.delay()
        if to_server:
            at = conn.c2s_at = max(at, conn.c2s_at)
        else:
            at = conn.s2c_at = max(at, conn.s2c_at)
        self.loop.at(at, deliver)


class Conn:
    """One TCP connection between a client process and the server process."""

    def __init__(
        self, net: Network, conn_id: int, client: Process, server: Process, client_side: Endpoint
    ) -> None:
        self.net = net
        self.id = conn_id
        self.client = client
        self.server = server
        self.client_side = client_side
        self.server_side: Endpoint | None = None
        self.c2s_at = 0.0
        self.s2c_at = 0.0
        self.client_open = True
        self.server_open = True
        self.server_life = server.life
        self.client_life = client.life

    # what each side does
    def to_server(self, data: bytes) -> None:
        if self.client_open:
            self.net.send(self, True, lambda: self._at_server(data))

    def to_client(self, data: bytes) -> None:
        if self.server_open:
            self.net.send(self, False, lambda: self._at_client(data))

    def close_by_client(self, *, reset: bool = False) -> None:
        if not self.client_open:
            return
        self.client_open = False
        self.net.send(self, True, lambda: self._server_sees_close(reset))

    def close_by_server(self, *, reset: bool = False) -> None:
        if not self.server_open:
            return
        self.server_open = False
        self.net.send(self, False, lambda: self._client_sees_close(reset))

    # deliveries (checked again in the process: a paused one takes them later)
    def _at_server(self, data: bytes) -> None:
        if self.server.life == self.server_life:
            self.server.run(lambda: self._server_receives(data))

    def _server_receives(self, data: bytes) -> None:
        side = self.server_side
        if side is not None and self.server_open and self.server.life == self.server_life:
            side.received(self, data)

    def _at_client(self, data: bytes) -> None:
        if self.client.life == self.client_life:
            self.client.run(lambda: self._client_receives(data))

    def _client_receives(self, data: bytes) -> None:
        if self.client_open and self.client.life == self.client_life:
            self.client_side.received(self, data)

    def _server_sees_close(self, reset: bool) -> None:
        if self.server.life == self.server_life:
            self.server.run(lambda: self._server_closes(reset))

    def _server_closes(self, reset: bool) -> None:
        side = self.server_side
        if side is not None and self.server_open and self.server.life == self.server_life:
            self.server_open = False
            side.closed(self, reset=reset)

    def _client_sees_close(self, reset: bool) -> None:
        if self.client.life == self.client_life:
            self.client.run(lambda: self._client_closes(reset))

    def _client_closes(self, reset: bool) -> None:
        if self.client_open and self.client.life == self.client_life:
            self.client_open = False
            self.client_side.closed(self, reset=reset)
