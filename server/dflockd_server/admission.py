"""Admission: which connections a ``Server`` takes, and their counts.

A ``net.Server`` has an ``Admission``: it counts transports and connections, refuses a new one
past the caps (``max_connections``, ``max_connections_per_ip``, or while the server drains),
and keeps the TLS handshakes under way to ``max_tls_handshakes`` (the oldest dropped).

It also keeps one client address from taking every key ([Caps](../server.md#caps)): an acquire
from an address that holds or waits for ``--max-locks-per-ip`` locks and slots (the table's
``shares.AddressShares``) is refused ``error_max_locks``. The load is read only while the table
has at least the cap's number of keys (``Session`` compares): the usual path reads nothing."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from dflockd_server.config import Config
from dflockd_server.connection import Connection
from dflockd_server.dispatch import Session
from dflockd_server.shares import AddressShares
from dflockd_server.stream import Stream
from dflockd_server.table import LockTable

__all__ = ["Admission"]

log = logging.getLogger("dflockd_server")

IP_CAP_LOG_INTERVAL_S = 60.0


class Admission:
    """Connection caps and counts (see the module's doc)."""

    def __init__(self, config: Config, draining: Callable[[], bool]) -> None:
        self.config = config
        self._draining = draining
        self.connections: set[Connection] = set()
        self.per_ip: dict[str, int] = {}  # the admitted connections of each client address
        self.ip_cap_logged: dict[str, float] = {}
        self.open_transports = 0  # transports made and not yet lost, admitted or refused
        self.connections_accepted = 0
        self.connections_refused = 0
        self.handshaking: dict[Stream, None] = {}
        """Connections in their TLS handshake, oldest first (``max_tls_handshakes``)."""

    def admit(self, conn: Connection) -> str | None:
        """Count a new connection's transport; register it, or say why it is refused."""
        self.open_transports += 1
        cfg = self.config
        ip = conn.stream.ip
        count = self.per_ip.get(ip, 0)
        if self._draining():
            refusal = "server draining"
        elif cfg.max_connections and len(self.connections) >= cfg.max_connections:
            refusal = f"max_connections ({cfg.max_connections}) reached"
        elif cfg.max_connections_per_ip and count >= cfg.max_connections_per_ip:
            refusal = f"max_connections_per_ip ({cfg.max_connections_per_ip}) reached"
        else:
            self.connections_accepted += 1
            self.per_ip[ip] = count + 1
            self.connections.add(conn)
            return None
        self.connections_refused += 1
        return refusal

    def share_table(self, table: LockTable) -> None:
        if cap := self.config.locks_per_ip:
            shares = table.grants.shares = AddressShares(cap)
            shares.refused = self._refused

    def over_ip_share(self, session: Session) -> bool:
        """Whether ``session``'s address holds or waits for its ``--max-locks-per-ip`` (the
        caller saw the table hold at least that many keys)."""
        shares = session.grants.shares
        return shares is not None and shares.over_cap(session.ip)

    def _refused(self, ip: str, load: int) -> None:
        """An acquire from ``ip`` refused by the cap: logged once a minute per address."""
        now = time.monotonic()
        if now - self.ip_cap_logged.get(ip, -math.inf) >= IP_CAP_LOG_INTERVAL_S:
            self.ip_cap_logged[ip] = now
            log.warning(
                "%s holds or waits for %d locks and slots, --max-locks-per-ip "
                "(DFLOCKD_MAX_LOCKS_PER_IP) is %d: its new acquires, reattaches and take-overs get "
                "error_max_locks (logged once a minute per address)",
                ip,
                load,
                self.config.locks_per_ip,
            )

    def transport_lost(self) -> None:
        self.open_transports -= 1

    def forget(self, conn: Connection) -> None:
        if conn in self.connections:
            self.connections.discard(conn)
            if (count := self.per_ip.get(conn.stream.ip, 0) - 1) > 0:
                self.per_ip[conn.stream.ip] = count
            else:
                self.per_ip.pop(conn.stream.ip, None)
                self.ip_cap_logged.pop(conn.stream.ip, None)

    def handshake_started(self, stream: Stream) -> None:
        """``stream`` begins its TLS handshake. Past ``max_tls_handshakes`` under way, the
        oldest is dropped: connections that never finish theirs cannot crowd out new ones."""
        cap = self.config.max_tls_handshakes
        if cap and len(self.handshaking) >= cap:
            oldest = next(iter(self.handshaking))
            del self.handshaking[oldest]
            log.debug(
                "connection %s: dropped in its TLS handshake (max_tls_handshakes %d under way)",
                oldest.peer,
                cap,
            )
            oldest.abort()
        self.handshaking[stream] = None

    def handshake_ended(self, stream: Stream) -> None:
        self.handshaking.pop(stream, None)
