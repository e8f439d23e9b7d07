"""Where a lock's requests go: the server list's shard, or a cluster's map and its redirect
rule (no I/O here).

`ClusterRouter` is one client's cached cluster map, shared by its locks. `KeyRoute` is one
lock's route (every `LockCore` has one): the key's server, and how one acquire follows a
cluster's redirects (``error_moved``, ``error_ask``, ``error_unavailable``, a member that cannot be
reached), pausing and reading the map again by one rule.
"""

from __future__ import annotations

import logging
import math
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Final

from celery_dflock.client import _requests, wire
from celery_dflock.client._refusals import describe_lock, mismatch_error
from celery_dflock.client._replies import Asked, ErrorReply, Moved, Reply
from celery_dflock.client._settings import ClientSettings
from celery_dflock.client.cluster import ClusterMap
from celery_dflock.client.errors import DflockError, ProtocolError
from celery_dflock.client.sharding import CLUSTER, select_server

logger: Final = logging.getLogger("celery_dflock.client")

MAP_REFRESH_INTERVAL_S: Final = 0.2
"""A client refreshes its cached cluster map at most this often (unless a member it was sent
to did not answer, or a redirect loop was found: then at once)."""
REDIRECT_LOOP: Final = 3
"""``error_moved`` replies in a row one acquire follows at once; the next one is a redirect
loop (members whose views of the map differ for a moment, during a hand-over): the acquire
pauses as after ``error_unavailable``, reads the shard map again and routes by it."""
HANDOVER_MIN_WAIT_S: Final = 2.0
"""An acquire follows a hand-over (redirects, ``error_unavailable``, a member that cannot be
reached) for its acquire timeout, and at least this long: a try-once acquire (timeout 0) still
gets its answer from the key's new member after a short hand-over. The server is never asked
to queue it longer than what is left of its own timeout."""
UNAVAILABLE_FIRST_PAUSE_S: Final = 0.05
UNAVAILABLE_MAX_PAUSE_S: Final = 1.0
"""After ``error_unavailable``, a redirect loop or a member that cannot be reached, an acquire
tries again after a pause that doubles from the first to the most (each pause drawn at random
between half and all of that, so that clients do not retry in step), until its time is up."""
# ------------------------------------------------------------------------------ cluster routing


@dataclass(frozen=True, slots=True)
class NextTry:
    """What an acquire does after a redirect (`KeyRoute.on_redirect`): pause ``pause_s``;
    ``reroute``: route by the map (read again, at most every `MAP_REFRESH_INTERVAL_S`, or at
    once when ``reread``), else go where the redirect said."""

    pause_s: float
    reroute: bool
    reread: bool = False


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT``) as ``(host, port)``; `ProtocolError` when it is not."""
    host, _, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isascii() or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ProtocolError(f"{address!r} is not a HOST:PORT a server may redirect to")
    return host, int(port)


class ClusterRouter:
    """One client's cached cluster map, shared by its locks (thread safe, no I/O): the
    ``servers`` are seeds; the map is fetched from the first that answers ``shards``, and
    refreshed at most once per `MAP_REFRESH_INTERVAL_S`."""

    def __init__(self, seeds: Sequence[tuple[str, int]]) -> None:
        self.seeds = tuple(seeds)
        self._map: ClusterMap | None = None
        self._claimed_at = -math.inf
        self._stale = False
        self._suspects: frozenset[tuple[str, int]] = frozenset()
        self._guard = threading.Lock()

    @property
    def map(self) -> ClusterMap | None:
        """The map last fetched (None before the first fetch)."""
        return self._map

    def claim_refresh(self, now: float | None = None) -> bool:
        """True when a refresh may start now (then the next is at least
        `MAP_REFRESH_INTERVAL_S` away); False when one started too recently."""
        now = time.monotonic() if now is None else now
        with self._guard:
            recent = now - self._claimed_at < MAP_REFRESH_INTERVAL_S
            if self._map is not None and not self._stale and recent:
                return False
            self._claimed_at = now
            self._stale = False
            return True

    @property
    def stale(self) -> bool:
        """True after `invalidate`, until a refresh is claimed."""
        return self._stale

    def invalidate(self, suspect: tuple[str, int] | None = None) -> None:
        """The map may be wrong (a member did not answer, or members redirected an acquire
        in a loop): the next routing reads it again at once. ``suspect``: a member that did not
        answer, asked for the map only after the others until the map is read again."""
        with self._guard:
            self._stale = True
            if suspect is not None:
                self._suspects = self._suspects | {suspect}

    def update(self, cluster_map: ClusterMap) -> None:
        """Route by ``cluster_map`` from now on (a reference swap)."""
        self._map = cluster_map
        self._suspects = frozenset()

    def candidates(self) -> list[tuple[str, int]]:
        """Where to ask for the map: the seeds, then every node the last map named; the
        members that did not answer lately last."""
        found = list(self.seeds)
        current = self._map
        if current is not None:
            for node in current.nodes:
                address = split_address(node)
                if address not in found:
                    found.append(address)
        suspects = self._suspects
        return [a for a in found if a not in suspects] + [a for a in found if a in suspects]

    def owner(self, key: str) -> tuple[str, int] | None:
        """Where ``key`` lives by the cached map (None: no map, or no node for its shard)."""
        current = self._map
        if current is None:
            return None
        owner = current.owner(key)
        return None if owner is None else split_address(owner)


# ------------------------------------------------------------------------------ one key's route


class KeyRoute:
    """Where one lock's requests go, and how its acquires follow a cluster's redirects (a
    `LockCore` has one, as ``core.routing``; every method is I/O free)."""

    def __init__(
        self,
        key: str,
        limit: int | None,
        settings: ClientSettings,
        acquire_timeout_s: int,
        router: ClusterRouter | None,
    ) -> None:
        self.key = _requests.validate_key(key)
        self.limit = limit
        """A semaphore's slots (None: a plain lock)."""
        self.settings = settings
        self.acquire_timeout_s = acquire_timeout_s
        self.router: ClusterRouter | None = None
        """Cluster routing (``sharding_strategy="cluster"``): the map shared with the client."""
        servers = settings.servers
        if settings.sharding_strategy == CLUSTER:
            self.router = router if router is not None else ClusterRouter(servers)
            index = 0
        else:
            index = select_server(self.key, servers, settings.sharding_strategy)  # pyright: ignore[reportArgumentType]
        self.endpoint = settings.server_endpoint(index)
        # One acquire's routing: its deadline (None: no acquire under way), the deadline of
        # following a hand-over (cluster routing: at least `HANDOVER_MIN_WAIT_S`), whether
        # it was redirected or paused yet, `error_moved` replies in a row, the last pause.
        self.acquire_deadline: float | None = None
        self.route_deadline = 0.0
        self.rerouted = False
        self.redirects = 0
        self.unavailable_pause = 0.0
        self.handover: str | None = None
        """Why the last acquire was not acquired when a hand-over kept it from the key's
        member until its time was up (None: it was not so)."""
        self.asking = False  # the next acquire request follows an `error_ask`: `asking` first
        self.ask_ticket: str | None = None  # what that `error_ask` gave, passed along
        self.clock: Callable[[], float] = time.monotonic
        """The clock its deadlines are on (a simulated client's own: tests/sim)."""
        self.jitter: Callable[[], float] = random.random
        """Draws in [0, 1) that spread its pauses (a simulated client's seeded ones)."""

    @property
    def semaphore(self) -> bool:
        """True for a semaphore (``sl``/``se``/... commands)."""
        return self.limit is not None

    @property
    def what(self) -> str:
        """``lock 'key'`` or ``semaphore 'key' (limit N)``, for messages."""
        return describe_lock(self.key, self.limit)

    def begin_acquire(self) -> None:
        """An acquire (or enqueue) starts: its deadlines run from now."""
        now = self.clock()
        self.acquire_deadline = now + self.acquire_timeout_s
        follow = self.acquire_timeout_s
        if self.router is not None:
            follow = max(follow, HANDOVER_MIN_WAIT_S)
        self.route_deadline = now + follow
        self.handover = None
        self.rerouted = False
        self.redirects = 0
        self.unavailable_pause = 0.0
        self.asking = False

    def end_acquire(self) -> None:
        self.acquire_deadline = None
        self.asking = False

    def wait_seconds(self) -> int:
        """The whole seconds the server may queue this acquire: the acquire timeout, or what
        is left of it after redirects and pauses (0 once it ran out)."""
        deadline = self.acquire_deadline
        if deadline is None or not self.rerouted:
            return self.acquire_timeout_s
        return max(0, math.ceil(deadline - self.clock()))

    def retarget(self, host: str, port: int) -> None:
        """Send the next requests for this key to ``host:port``."""
        if (host, port) != (self.endpoint.host, self.endpoint.port):
            self.endpoint = replace(self.endpoint, host=host, port=port)

    def route(self) -> bool:
        """Cluster routing: aim at the key's node by the cached map. False when there is no
        map yet, or it is to be read again (`ClusterRouter.stale`): fetch it, then route
        again."""
        router = self.router
        if router is None:
            return True
        if router.map is None:
            return False
        if router.stale:
            return False
        owner = router.owner(self.key)
        if owner is not None:
            self.retarget(*owner)
        return True

    @staticmethod
    def redirected(reply: Reply) -> bool:
        """True for ``error_moved`` and ``error_unavailable``: the key is not served there."""
        return isinstance(reply, Moved) or (
            isinstance(reply, ErrorReply) and reply.code == wire.STATUS_ERROR_UNAVAILABLE
        )

    def on_redirect(self, reply: Reply) -> NextTry | None:
        """Cluster routing after `redirected`: what to do next, or None when the time to
        follow a hand-over is up (not acquired; `handover` says why).

        ``error_moved`` is followed at once, up to `REDIRECT_LOOP` in a row; past that the
        members disagree for a moment (a hand-over under way): pause, read the map again (at
        once) and route by it. ``error_unavailable`` (the key's new member has not taken the
        shard over yet): pause, then route by the map (read again at most every
        `MAP_REFRESH_INTERVAL_S`). Pauses grow as `UNAVAILABLE_FIRST_PAUSE_S` says."""
        self.rerouted = True
        where = self.endpoint.address
        if isinstance(reply, Moved):
            return self._follow("error_moved", reply.address)
        self.redirects = 0
        pause_s = self._next_pause(f"{where} answered error_unavailable")
        return None if pause_s is None else NextTry(pause_s, reroute=True)

    def on_ask(self, reply: Asked) -> NextTry | None:
        """``error_ask <HOST:PORT>``: send this acquire, once, to that member with ``asking``
        first (a key-level move: the shard map is not refreshed, the next acquire is routed
        by it again). Counts as a redirect: past `REDIRECT_LOOP` in a row, the acquire pauses,
        reads the map again and routes by it, as after a loop of ``error_moved``; None when
        the time to follow a hand-over is up."""
        self.rerouted = True
        self.ask_ticket = reply.ticket
        return self._follow("error_ask", reply.address, asking=True)

    def _follow(self, answer: str, address: str, *, asking: bool = False) -> NextTry | None:
        """A redirect to ``address``: followed at once up to `REDIRECT_LOOP` in a row (with
        ``asking`` first when ``asking``); past that a loop: pause, read the map again, route
        by it (None when the time to follow a hand-over is up)."""
        self.redirects += 1
        if self.redirects <= REDIRECT_LOOP:
            self.retarget(*split_address(address))
            self.asking = asking
            return NextTry(0.0, reroute=False)
        self.redirects = 0
        why = (
            f"a redirect loop: {self.endpoint.address} answered {answer} {address} after "
            f"{REDIRECT_LOOP} redirects in a row"
        )
        pause_s = self._next_pause(why)
        return None if pause_s is None else NextTry(pause_s, reroute=True, reread=True)

    def on_ask_refused(self) -> float | None:
        """The member an ``error_ask`` named did not take ``asking`` (it predates key-level
        moves): seconds to pause before routing by the map again, as after
        ``error_unavailable``; None when the acquire's time is up."""
        return self._next_pause(f"{self.endpoint.address} refused asking")

    def on_unreachable(self, exc: DflockError) -> float | None:
        """Cluster routing: the key's node could not be reached, or closed the connection, or
        did not answer in time, or is draining (a member that died, stopped or is leaving):
        the map is to be read again at once (`ClusterRouter.invalidate`, also when the time is
        up: the next acquire reads it), and this returns the seconds to pause before routing
        again by it, growing as after ``error_unavailable``. None: not cluster routing, or the
        time to follow a hand-over is up (the caller raises ``exc``)."""
        router = self.router
        if router is None:
            return None
        self.rerouted = True
        self.redirects = 0
        router.invalidate((self.endpoint.host, self.endpoint.port))
        return self._next_pause(f"{self.endpoint.address} unreachable ({exc})")

    def _next_pause(self, why: str) -> float | None:
        pause = min(
            max(self.unavailable_pause * 2, UNAVAILABLE_FIRST_PAUSE_S), UNAVAILABLE_MAX_PAUSE_S
        )
        self.unavailable_pause = pause
        remaining = self.route_deadline - self.clock()
        if remaining <= 0:
            self.handover = (
                f"{self.what} was not acquired within its acquire timeout "
                f"({self.acquire_timeout_s} s; in Celery lock_timeout): a hand-over of its "
                f"shard between cluster members was under way ({why})"
            )
            logger.info("%s", self.handover)
            return None
        return min(pause * (0.5 + self.jitter() / 2), remaining)  # jitter

    def mismatch_error(self, reply: Reply, shards: dict[str, object] | None) -> DflockError:
        """A list-mode client was redirected: the server has another view of where keys live.
        ``shards`` is what the server answered to ``shards`` (None: it did not say)."""
        return mismatch_error(
            reply,
            shards,
            what=self.what,
            where=self.endpoint.address,
            servers=self.settings.servers,
            strategy=self.settings.sharding_strategy,
        )
