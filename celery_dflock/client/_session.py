"""This process's session with a lock server, kept alive by `celery_dflock.client._async.keepalive`
(no I/O here; what the server keeps, and why the client counts from a keep-alive's send time:
docs/protocol.md, "Client sessions").

The server cannot end a session before the send time of its last answered keep-alive plus its
time: until then less `SESSION_MARGIN_S` its grants are surely held. Past that deadline the
session is over for good, whatever a later answer says: a new one (a new id) takes its place."""

from __future__ import annotations

import math
import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import Final, Protocol

from celery_dflock.client._settings import Endpoint

__all__ = ["SESSION_KEEPALIVES", "SESSION_MARGIN_S", "ClientSession", "Holder", "Sessions"]

SESSION_MARGIN_S: Final = 0.75  # off a session's time: clock drift, late scheduling
PRUNE_EVERY_S: Final = 60.0  # how often the keep-alive forgets its session's let-go locks (`idle`)
SESSION_KEEPALIVES: Final = 3  # per session time: a stall for most of it costs nothing


class Holder(Protocol):
    """A lock held or waiting on a session (its holding), as the session sees it."""

    def poke(self) -> None: ...

    def holds(self) -> bool: ...


class ClientSession:
    """One session with one server; ``ttl`` at most the server's ``max_lease_ttl_s``."""

    def __init__(self, ttl: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.id = secrets.token_hex(16)
        self.clock = clock  # tests/sim: a simulated one
        self.ttl = ttl
        # Send times of the last answered request that kept it alive (a keep-alive or a
        # join), and of the last answered keep-alive (which renewed every grant too).
        self.answered_at = -math.inf
        self.renewed_at = -math.inf
        self.renewal_answered_at = math.inf  # when that keep-alive's answer came
        self.ended = ""  # why it is over ("" while it may live)
        # No new connection joins it: it may hold a grant whose reply was lost (`retire`).
        self.retired = False
        self.durable = False  # the server journals leases (not sessions)
        self.run: str | None = None  # the server run it was joined on: its grants renew
        # A durable server found not running ends nothing: only the leases bound the grants.
        self.server_down = False
        self.holders: dict[Holder, None] = {}  # told (`Holder.poke`) once it is over
        """In the order they came: each step goes as the one before, run for run (the
        simulator replays a seed exactly; a set of objects iterates in their addresses' order)."""
        self.keeper: object | None = None  # its keep-alive task or thread, while it runs
        self._pruned_at = -math.inf  # when `idle` last looked at every holder
        self._guard = threading.Lock()  # whether a keep-alive runs is agreed under it

    def deadline(self) -> float:
        """Until when its grants surely stay held, as far as the session goes; -inf once over."""
        return -math.inf if self.ended else self.answered_at + self.ttl - SESSION_MARGIN_S

    def interval(self) -> float:
        return self.ttl / SESSION_KEEPALIVES

    def live(self) -> bool:
        """Not over (a passed deadline ends it)."""
        if self.ended:
            return False
        if self.answered_at > -math.inf and self.clock() >= self.deadline():
            self.end("it was not kept alive in time (no answer from the server)")
            return False
        return True

    def joinable(self) -> bool:
        """Live and not retired: a new connection may join it."""
        return not self.retired and self.live()

    def retire(self) -> None:
        """A request that may grant failed with its reply unread: the server may hold a grant
        on this session that nobody knows the token of, which its keep-alives would keep. New
        connections join a new session from now on; this one lives while the locks on it hold,
        then ends by its time, and that grant with it."""
        self.retired = True

    def answered(self, sent_at: float, *, renewed: bool = False) -> None:
        """The server answered a join or (``renewed``) a keep-alive sent at ``sent_at``; after
        the deadline this changes nothing."""
        self.server_down = False
        if not self.live():
            return
        self.answered_at = max(self.answered_at, sent_at)
        if renewed and sent_at > self.renewed_at:
            self.renewed_at = sent_at
            self.renewal_answered_at = self.clock()

    def hold(self, holder: Holder, start: Callable[[], object]) -> None:
        """``holder`` holds or waits for a grant on it: ``start()`` a keep-alive unless one runs."""
        with self._guard:
            self.holders[holder] = None
            if self.keeper is None and not self.ended:
                self.keeper = start()

    def idle(self) -> bool:
        """For the keep-alive: True (and it counts as stopped) once no held lock is left on
        the session, or it is over. Locks let go are forgotten on the way: all of them every
        ``PRUNE_EVERY_S``, else those before the first that holds."""
        with self._guard:
            holders = self.holders
            if not self.ended:
                now = self.clock()
                if now - self._pruned_at < PRUNE_EVERY_S:
                    gone: list[Holder] = []
                    for holder in holders:
                        if holder.holds():
                            for done in gone:
                                del holders[done]
                            return False
                        gone.append(holder)
                    holders.clear()  # none holds
                self._pruned_at = now
                for done in [h for h in holders if not h.holds()]:
                    del holders[done]
                if holders:
                    return False
            self.keeper = None
            return True

    def stopped(self) -> None:
        """The keep-alive ended while locks were held on it: they are told to renew."""
        with self._guard:
            self.keeper = None
            holders = list(self.holders)
        for holder in holders:
            holder.poke()

    def refused(self) -> None:
        """A keep-alive found nobody listening at the server's address."""
        if self.durable:
            self.server_down = True

    def end(self, why: str) -> None:
        """Over for good: its holders are told."""
        if self.ended:
            return
        self.ended = why
        for holder in list(self.holders):
            holder.poke()

    def __repr__(self) -> str:
        state = f"ended: {self.ended}" if self.ended else "live"
        return f"<ClientSession ttl={self.ttl}s {state} holders={len(self.holders)}>"


class Sessions:
    """The current `ClientSession` per server of a pool (or lock); a fork child forgets them."""

    __slots__ = ("_by_address", "_pid")

    def __init__(self) -> None:
        self._by_address: dict[str, tuple[Endpoint, ClientSession]] = {}
        self._pid = os.getpid()

    def _mine(self) -> dict[str, tuple[Endpoint, ClientSession]]:
        if self._pid != os.getpid():
            self._by_address = {}
            self._pid = os.getpid()
        return self._by_address

    def current(self, endpoint: Endpoint, ttl: int) -> ClientSession:
        mine = self._mine()
        _, session = mine.get(endpoint.address, (endpoint, None))
        if session is None or not session.joinable() or session.ttl != ttl:
            session = ClientSession(ttl)
            mine[endpoint.address] = (endpoint, session)
        return session

    def retire(self, endpoint: Endpoint) -> None:
        """`ClientSession.retire` the current session with ``endpoint``, if any."""
        _, session = self._mine().get(endpoint.address, (endpoint, None))
        if session is not None:
            session.retire()

    def unheld(self) -> list[tuple[Endpoint, ClientSession]]:
        """The live sessions that hold no lock of this process, forgotten here (to end)."""
        mine = self._mine()
        out: list[tuple[Endpoint, ClientSession]] = []
        for address, (endpoint, session) in list(mine.items()):
            if session.idle() and session.live():
                out.append((endpoint, session))
                del mine[address]
        return out
