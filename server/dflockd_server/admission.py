"""Admission: which connections a ``Server`` takes, and their counts.

``Admission`` is the part of ``net.Server`` that counts transports and connections, refuses
a new one past the caps (``max_connections``, ``max_connections_per_ip``, or while draining),
keeps the TLS handshakes under way to ``max_tls_handshakes`` (the oldest dropped), and tells
the server's stop when no request is in flight (``busy_changed``).
"""

from __future__ import annotations

import asyncio
import logging

from dflockd_server.config import Config
from dflockd_server.connection import Connection
from dflockd_server.stream import Stream

__all__ = ["Admission"]

log = logging.getLogger("dflockd_server")


class Admission:
    """Connection caps and counts (see the module's doc). ``net.Server`` sets the attributes
    below."""

    config: Config
    draining: bool
    connections: set[Connection]
    per_ip: dict[str, int]
    open_transports: int
    """Transports made and not yet lost, admitted or refused."""
    connections_accepted: int
    connections_refused: int
    handshaking: dict[Stream, None]
    """Connections in their TLS handshake, oldest first (``max_tls_handshakes``)."""
    handshakes_evicted: int
    _busy: int
    _idle: asyncio.Event | None

    def admit(self, conn: Connection) -> str | None:
        """Count a new connection's transport, and register the connection or say why it is
        refused."""
        self.open_transports += 1
        refusal = self._refusal(conn)
        if refusal is not None:
            self.connections_refused += 1
            return refusal
        self.connections_accepted += 1
        self.per_ip[conn.ip] = self.per_ip.get(conn.ip, 0) + 1
        self.connections.add(conn)
        return None

    def _refusal(self, conn: Connection) -> str | None:
        cfg = self.config
        if self.draining:
            return "server draining"
        if cfg.max_connections and len(self.connections) >= cfg.max_connections:
            return f"max_connections ({cfg.max_connections}) reached"
        count = self.per_ip.get(conn.ip, 0)
        if cfg.max_connections_per_ip and count >= cfg.max_connections_per_ip:
            return f"max_connections_per_ip ({cfg.max_connections_per_ip}) reached"
        return None

    def transport_lost(self) -> None:
        """A connection's transport is gone (admitted or refused)."""
        self.open_transports -= 1

    def forget(self, conn: Connection) -> None:
        if conn in self.connections:
            self.connections.discard(conn)
            count = self.per_ip.get(conn.ip, 0) - 1
            if count > 0:
                self.per_ip[conn.ip] = count
            else:
                self.per_ip.pop(conn.ip, None)

    def handshake_started(self, stream: Stream) -> None:
        """``stream`` begins its TLS handshake. Past ``max_tls_handshakes`` under way, the
        oldest is dropped: connections that never finish theirs cannot crowd out new ones
        (a real client finishes in a round trip or two), and their memory stays bounded."""
        cap = self.config.max_tls_handshakes
        if cap and len(self.handshaking) >= cap:
            oldest = next(iter(self.handshaking))
            del self.handshaking[oldest]
            self.handshakes_evicted += 1
            log.debug(
                "connection %s: dropped in its TLS handshake (max_tls_handshakes %d under way)",
                oldest.peer,
                cap,
            )
            oldest.abort()
        self.handshaking[stream] = None

    def handshake_ended(self, stream: Stream) -> None:
        """``stream``'s handshake is done, failed or was cut off."""
        self.handshaking.pop(stream, None)

    def busy_changed(self, busy: bool) -> None:
        self._busy += 1 if busy else -1
        if self._idle is not None:
            if self._busy:
                self._idle.clear()
            else:
                self._idle.set()
