"""This process's session with a lock server (docs/protocol.md, "Client sessions"); no I/O here.

A server that lists ``keepalive`` keeps one session per client: each of the client's
connections joins it (``hello _ session <id> <ttl>``), the grants made on any of them belong to
it, and one keep-alive (``ping _ session <id>``, every third of its time:
`celery_dflock.client._async.keepalive`) keeps it and all its grants alive. Closing a connection
ends nothing; the server ends the session, and its grants, once no keep-alive came for its time.

A `ClientSession` has an id (random, a bearer credential like a token), a time, and the send
time of the last keep-alive answered: the server cannot end it before that plus its time, so
until then less `SESSION_MARGIN_S` its grants are surely held (as far as their leases run).
Once that deadline passed without a fresh answer, the session is over for good, whatever a later
answer says (the server may have given its keys to others): a new session (a new id) takes its
place. `Sessions` keeps the current session with each server of one pool (or of one lock
without a pool); a fork child starts its own.
"""

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

SESSION_MARGIN_S: Final = 0.75
"""Taken off a session's time when counting how long its grants surely stay held after the
last answered keep-alive: room for the two clocks' rates to differ and, mostly, for this process
to be scheduled late at the deadline on a loaded machine."""
PRUNE_EVERY_S: Final = 60.0
"""How often the keep-alive forgets every lock of its session that was let go (`idle`)."""
SESSION_KEEPALIVES: Final = 3
"""A session is kept alive this many times per session time (a 15 s session: every 5 s), so
that a stall of the server, the network or this process for most of its time costs nothing."""


class Holder(Protocol):
    """A lock held or waiting on a session (its holding), as the session sees it."""

    def poke(self) -> None:
        """Renew now, in the background: the renewal finds out whether the grant is lost."""
        ...

    def holds(self) -> bool:
        """Whether it still holds a grant, or waits for one (else the session forgets it)."""
        ...


class ClientSession:
    """One session with one server (see the module's doc); ``ttl``: the client's ask, at most
    the server's ``max_lease_ttl_s``."""

    __slots__ = (
        "_guard",
        "_pruned_at",
        "answered_at",
        "clock",
        "durable",
        "ended",
        "holders",
        "id",
        "keeper",
        "renewal_answered_at",
        "renewed_at",
        "run",
        "server_down",
        "ttl",
    )

    def __init__(self, ttl: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.id = secrets.token_hex(16)
        self.clock = clock
        """The clock its times are on (a simulated process's in tests/sim)."""
        self.ttl = ttl
        self.answered_at = -math.inf
        """time.monotonic() when the last request that kept it alive (a keep-alive, or the
        ``hello`` that joined a connection to it) was sent, of those the server answered."""
        self.renewed_at = -math.inf
        """When the last keep-alive answered was sent: it renewed every grant of the session
        (a join refreshes the session, not its grants)."""
        self.renewal_answered_at = math.inf
        """When the answer to that keep-alive came (a grant counts it only if the answer came
        while its lease surely ran: `HeldGrant.lease_end`)."""
        self.ended = ""
        """Why it is over ("" while it may live): the server said it has no such session, or
        its deadline passed without an answer."""
        self.durable = False
        """The server keeps a lease journal (lists ``durable``): a restart restores each grant
        to its lease, without the session (sessions are not journaled)."""
        self.run: str | None = None
        """The server's start the session was last joined on (``hello``'s ``run``; None: not
        said): a keep-alive renews only the grants made or reattached on that run."""
        self.server_down = False
        """The last keep-alive found nobody listening at a durable server's address (`refused`):
        a server not running ends nothing and its restart restores each grant to its lease, so
        only the leases bound the grants then."""
        self.holders: set[Holder] = set()
        """The held locks on it, each told (`Holder.poke`) once it is over."""
        self.keeper: object | None = None
        """Its keep-alive while it runs (a task or a thread: `_async.keepalive`)."""
        self._pruned_at = -math.inf  # when `idle` last looked at every holder
        self._guard = threading.Lock()
        """`hold` and the keep-alive's `idle` / `stopped` agree under it whether one runs."""

    def deadline(self) -> float:
        """Until when its grants surely stay held, as far as the session goes; -inf once over."""
        if self.ended:
            return -math.inf
        return self.answered_at + self.ttl - SESSION_MARGIN_S

    def interval(self) -> float:
        """Seconds between keep-alives."""
        return self.ttl / SESSION_KEEPALIVES

    def live(self, now: float | None = None) -> bool:
        """Not over: it may still be joined and kept alive (its deadline passed: `end`)."""
        if self.ended:
            return False
        if self.answered_at > -math.inf and (self.clock() if now is None else now) >= (
            self.deadline()
        ):
            self.end("it was not kept alive in time (no answer from the server)")
            return False
        return True

    def answered(self, sent_at: float, *, renewed: bool = False) -> None:
        """The server answered a join, or a keep-alive (``renewed``: it renewed every grant
        too), sent at ``sent_at``. After the deadline this changes nothing: the session is over
        (the server may have made a new one of the same id for a join)."""
        self.server_down = False
        if not self.live():
            return
        self.answered_at = max(self.answered_at, sent_at)
        if renewed and sent_at > self.renewed_at:
            self.renewed_at = sent_at
            self.renewal_answered_at = self.clock()

    def hold(self, holder: Holder, start: Callable[[], object]) -> None:
        """``holder`` holds a grant on the session, or waits for one: kept alive from now on
        (``start()`` starts the keep-alive, unless one runs)."""
        with self._guard:
            self.holders.add(holder)
            if self.keeper is None and not self.ended:
                self.keeper = start()

    def idle(self) -> bool:
        """For the keep-alive: True (and it counts as stopped) once no held lock is left on
        the session, or it is over. Locks let go are forgotten on the way: all of them every
        ``PRUNE_EVERY_S`` (a look at 5,000 costs milliseconds), else those before the first
        that holds."""
        with self._guard:
            holders = self.holders
            if not self.ended:
                now = self.clock()
                if now - self._pruned_at < PRUNE_EVERY_S:
                    gone: list[Holder] = []
                    holding = False
                    for holder in holders:
                        if holder.holds():
                            holding = True
                            break
                        gone.append(holder)
                    holders.difference_update(gone)
                    if holding:
                        return False
                self._pruned_at = now
                for h in [h for h in holders if not h.holds()]:
                    holders.discard(h)
                if holders:
                    return False
            self.keeper = None
            return True

    def keeping(self) -> bool:
        """Whether its keep-alive runs (which tells of the session's end, or its own: `stopped`)."""
        return self.keeper is not None and not self.ended

    def stopped(self) -> None:
        """The keep-alive ended while locks were held on it: the next `hold` starts another,
        and its holders are told, to renew by themselves."""
        with self._guard:
            self.keeper = None
            holders = list(self.holders)
        for holder in holders:
            holder.poke()

    def refused(self) -> None:
        """An attempt to keep it alive found nobody listening at the server's address."""
        if self.durable:
            self.server_down = True

    def end(self, why: str) -> None:
        """The session is over (``why``), for good: its holders are told."""
        if self.ended:
            return
        self.ended = why
        for holder in list(self.holders):
            holder.poke()

    def __repr__(self) -> str:
        state = f"ended: {self.ended}" if self.ended else "live"
        return f"<ClientSession ttl={self.ttl}s {state} holders={len(self.holders)}>"


class Sessions:
    """The current `ClientSession` with each server for one pool's connections (or one lock's):
    one that is over is replaced when a connection next joins; a fork child forgets them."""

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
        """The session a new connection to ``endpoint`` joins (``ttl``: its time, as the server
        grants it)."""
        mine = self._mine()
        found = mine.get(endpoint.address)
        session = None if found is None else found[1]
        if session is None or not session.live() or session.ttl != ttl:
            session = ClientSession(ttl)
            mine[endpoint.address] = (endpoint, session)
        return session

    def unheld(self) -> list[tuple[Endpoint, ClientSession]]:
        """The sessions that may live and hold no lock of this process, forgotten here (a clean
        close ends them, and what was held on them by token)."""
        mine = self._mine()
        out: list[tuple[Endpoint, ClientSession]] = []
        for address, (endpoint, session) in list(mine.items()):
            if session.idle() and session.live():
                out.append((endpoint, session))
                del mine[address]
        return out
