"""Each client address's share of the lock table (``--max-locks-per-ip``): the grants that count
against an address, whatever holds them now (which count, and when a reattach or a take-over is
refused: docs/protocol.md, "Connection limits and shutdown").

An address's load is its grants plus the acquires its open connections have queued; the counts
change as grants are made, moved and freed (``granted``, ``moved``, ``ended``): no table scan."""

from __future__ import annotations

from collections.abc import Callable

from dflockd_server.keys import Client, Holder, MaxLocks

__all__ = ["AddressShares"]


class AddressShares:
    """The grants each client address holds, for a cap of ``cap``."""

    __slots__ = ("cap", "clients", "detached", "held", "ip_of", "refused")

    def __init__(self, cap: int) -> None:
        self.cap = cap  # `--max-locks-per-ip` (> 0)
        self.held: dict[str, int] = {}  # address -> grants counting against it now
        self.ip_of: dict[Client, str] = {}
        """The address of each client whose connection is open, or that still holds a grant."""
        self.clients: dict[str, set[Client]] = {}  # the clients of each address's open connections
        self.detached: dict[str, str] = {}  # token -> address, for grants bound to no connection
        self.refused: Callable[[str, int], None] | None = None  # told of each refusal: (ip, load)

    def opened(self, client: Client, ip: str) -> None:
        self.ip_of[client] = ip
        if (same := self.clients.get(ip)) is None:
            same = self.clients[ip] = set()
        same.add(client)

    def closed(self, client: Client, ip: str) -> None:
        """``client``'s connection is gone (after the table's ``disconnect``); the grants it
        still holds keep counting against ``ip``."""
        if (same := self.clients.get(ip)) is not None:
            same.discard(client)
            if not same:
                del self.clients[ip]
        if not client.n_held:
            self.ip_of.pop(client, None)

    def load(self, ip: str) -> int:
        """The grants counting against ``ip`` plus the acquires its connections have queued."""
        load = self.held.get(ip, 0)
        for client in self.clients.get(ip, ()):
            load += len(client.waiting)
        return load

    def address(self, holder: Holder) -> str | None:
        """The address the live ``holder`` counts against (``None``: none)."""
        ip = self.ip_of.get(holder.client)
        return self.detached.get(holder.token) if ip is None else ip

    def check_rebind(self, holder: Holder, client: Client, n_keys: int) -> None:
        """Before ``holder`` is bound to ``client``: raise ``MaxLocks`` if that adds a grant to
        an address at its cap (only while the table has at least ``cap`` keys)."""
        ip = self.ip_of.get(client)
        if ip is None or n_keys < self.cap or self.address(holder) == ip:
            return
        if self.over_cap(ip):
            raise MaxLocks(holder.key)

    def over_cap(self, ip: str) -> bool:
        """Whether ``ip``'s load reaches the cap; each refusal is told to ``refused``."""
        if (load := self.load(ip)) < self.cap:
            return False
        if (refused := self.refused) is not None:
            refused(ip, load)
        return True

    def granted(self, holder: Holder, taker: Client) -> None:
        """``holder`` was just granted for ``taker``'s request (bound to it, or detached)."""
        ip = self.ip_of.get(taker)
        if ip is None:
            return
        held = self.held
        held[ip] = held.get(ip, 0) + 1
        if holder.client is not taker:
            self.detached[holder.token] = ip

    def ended(self, holder: Holder) -> None:
        """``holder`` ended (its client's ``n_held`` already counts it out)."""
        owner = holder.client
        ip = self.ip_of.get(owner)
        if ip is None:
            ip = self.detached.pop(holder.token, None)
            if ip is None:
                return
        elif owner.closed and not owner.n_held:
            del self.ip_of[owner]
        self._drop(ip)

    def moved(self, old: Holder, new: Holder) -> None:
        """The grant ``old`` was rebound as ``new``: to a connection, it counts against that
        connection's address; detached, the same one."""
        owner = old.client
        if (was := self.ip_of.get(owner)) is None:
            was = self.detached.pop(old.token, None)
        elif owner.closed and not owner.n_held:
            del self.ip_of[owner]
        if (ip := self.ip_of.get(new.client)) is None:  # detached: it keeps its address
            if was is not None:
                self.detached[new.token] = was
            return
        if ip != was:
            held = self.held
            held[ip] = held.get(ip, 0) + 1
            if was is not None:
                self._drop(was)

    def _drop(self, ip: str) -> None:
        held = self.held
        left = held[ip] - 1
        if left:
            held[ip] = left
        else:
            del held[ip]
