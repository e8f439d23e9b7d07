"""Where a lock's requests go (no I/O here): `ClusterRouter`, one client's cached cluster map shared
by its locks; `KeyRoute`, one lock's route: the key's server, and how an acquire follows a cluster's
redirects (``error_moved``, ``error_ask``, ``error_unavailable``, an unreachable member), pausing
and reading the map again by one rule."""

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
from celery_dflock.client.errors import DflockError, InvalidValueError, ProtocolError
from celery_dflock.client.sharding import CLUSTER, select_server

logger: Final = logging.getLogger("celery_dflock.client")

MAP_REFRESH_INTERVAL_S: Final = 0.2  # a map refresh at most this often (found wrong: at once)
REDIRECT_LOOP: Final = 3  # `error_moved`s followed at once in a row; the next: pause, map again
HANDOVER_MIN_WAIT_S: Final = 2.0  # an acquire follows a hand-over this long at least (try-once too)
UNAVAILABLE_FIRST_PAUSE_S: Final = 0.05
UNAVAILABLE_MAX_PAUSE_S: Final = 1.0  # hand-over retry pauses double up to this (each: half to all)


@dataclass(frozen=True, slots=True)
class NextTry:
    """After a redirect: pause ``pause_s``; ``reroute``: route by the map (read again at once
    when ``reread``), else go where the redirect said."""

    pause_s: float
    reroute: bool
    reread: bool = False


def split_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[v6]:PORT``) as ``(host, port)``."""
    host, _, port = address.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not host or not port.isascii() or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ProtocolError(f"{address!r} is not a HOST:PORT a server may redirect to")
    return host, int(port)


def server_of(key: str, settings: ClientSettings, router: ClusterRouter | None) -> tuple[str, int]:
    """The ``(host, port)`` that owns ``key`` (no I/O; with ``router``, by its cached map, the
    first seed while there is none)."""
    servers = settings.servers
    if router is not None:
        return router.owner(key) or servers[0]
    return servers[select_server(key, servers, settings.sharding_strategy)]  # pyright: ignore[reportArgumentType]


class ClusterRouter:
    """One client's cached cluster map, shared by its locks (thread safe), fetched from the
    first of the ``seeds`` that answers ``shards``."""

    def __init__(self, seeds: Sequence[tuple[str, int]]) -> None:
        self.seeds = tuple(seeds)
        self.map: ClusterMap | None = None
        self.stale = False  # after `invalidate`, until a refresh is claimed
        self._claimed_at = -math.inf
        self._suspects: frozenset[tuple[str, int]] = frozenset()
        self._guard = threading.Lock()

    def claim_refresh(self, now: float | None = None) -> bool:
        """True when a refresh may start now (none started too recently)."""
        now = time.monotonic() if now is None else now
        with self._guard:
            recent = now - self._claimed_at < MAP_REFRESH_INTERVAL_S
            if self.map is not None and not self.stale and recent:
                return False
            self._claimed_at = now
            self.stale = False
            return True

    def invalidate(self, suspect: tuple[str, int] | None = None) -> None:
        """The map may be wrong: the next routing reads it again at once, asking ``suspect``
        (a member that did not answer) last."""
        with self._guard:
            self.stale = True
            if suspect is not None:
                self._suspects = self._suspects | {suspect}

    def update(self, cluster_map: ClusterMap) -> None:
        self.map = cluster_map
        self._suspects = frozenset()

    def candidates(self) -> list[tuple[str, int]]:
        """Where to ask for the map: the seeds, then the last map's nodes; suspects last."""
        current = self.map
        nodes = () if current is None else map(split_address, current.nodes)
        found = list(self.seeds)
        found += [address for address in dict.fromkeys(nodes) if address not in found]
        suspects = self._suspects
        return [a for a in found if a not in suspects] + [a for a in found if a in suspects]

    def owner(self, key: str) -> tuple[str, int] | None:
        """Where ``key`` lives by the cached map (None: not known)."""
        current = self.map
        if current is None:
            return None
        owner = current.owner(key)
        return None if owner is None else split_address(owner)

    def target(self, key: str) -> tuple[str, int] | None:
        """Where ``key`` may be granted besides its shard's current node, by the cached map:
        the node its shard is split to (a move key by key), else its target (None: unknown)."""
        known = self.map
        if known is None:
            return None
        shard = known.shard_of(key)
        index = known.split[shard] if known.split and known.split[shard] >= 0 else -1
        index = known.target[shard] if index < 0 else index
        return None if index < 0 else split_address(known.nodes[index])


class KeyRoute:
    """Where one lock's requests go, and how its acquires follow a cluster's redirects."""

    def __init__(
        self,
        key: str,
        limit: int | None,
        settings: ClientSettings,
        acquire_timeout_s: int,
        router: ClusterRouter | None,
    ) -> None:
        self.key = _requests.validate_key(key)
        self.limit = limit  # a semaphore's slots (None: a plain lock)
        self.settings = settings
        self.acquire_timeout_s = acquire_timeout_s
        self.router: ClusterRouter | None = None
        servers = settings.servers
        if router is not None:
            if not isinstance(router, ClusterRouter):  # pyright: ignore[reportUnnecessaryIsInstance]
                raise InvalidValueError(
                    "router must be None or a ClusterRouter (a cluster client's `router`), "
                    f"got {router!r}"
                )
            if settings.sharding_strategy != CLUSTER:
                raise InvalidValueError(
                    'router shares a cluster\'s shard map: give it with sharding_strategy="cluster"'
                    " (a lock routed over its server list has no map to share)"
                )
        if settings.sharding_strategy == CLUSTER:
            self.router = router if router is not None else ClusterRouter(servers)
            index = 0
        else:
            index = select_server(self.key, servers, settings.sharding_strategy)  # pyright: ignore[reportArgumentType]
        self.endpoint = settings.server_endpoint(index)
        # One acquire's routing: its deadline (None: none under way), that of following a
        # hand-over, whether it was redirected yet, redirects in a row, the last pause.
        self.acquire_deadline: float | None = None
        self.route_deadline = 0.0
        self.rerouted = False
        self.redirects = 0
        self.unavailable_pause = 0.0
        self.handover: str | None = None  # why a hand-over outlasted the last acquire
        self.asking = False  # the next acquire request follows an `error_ask`: `asking` first
        self.ask_ticket: str | None = None  # what that `error_ask` gave, passed along
        self.clock: Callable[[], float] = time.monotonic  # tests/sim: a simulated one
        self.jitter: Callable[[], float] = random.random  # tests/sim: seeded

    @property
    def what(self) -> str:
        """``lock 'key'`` or ``semaphore 'key' (limit N)``, for messages."""
        return describe_lock(self.key, self.limit)

    def begin_acquire(self) -> None:
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
        """Whole seconds the server may queue this acquire: what is left of its timeout."""
        deadline = self.acquire_deadline
        if deadline is None or not self.rerouted:
            return self.acquire_timeout_s
        return max(0, math.ceil(deadline - self.clock()))

    def retarget(self, host: str, port: int) -> None:
        if (host, port) != (self.endpoint.host, self.endpoint.port):
            self.endpoint = replace(self.endpoint, host=host, port=port)

    def to_target(self) -> bool:
        """Aim at the target of the key's shard when the map shows it moving elsewhere than
        here (a key of a shard moving key by key may be granted there); False otherwise."""
        target = None if self.router is None else self.router.target(self.key)
        if target is None or target == (self.endpoint.host, self.endpoint.port):
            return False
        self.retarget(*target)
        return True

    def route(self) -> bool:
        """Aim at the key's node by the cached map; False when there is none fresh: fetch it."""
        router = self.router
        if router is None:
            return True
        if router.map is None or router.stale:
            return False
        owner = router.owner(self.key)
        if owner is not None:
            self.retarget(*owner)
        return True

    @staticmethod
    def redirected(reply: Reply) -> bool:
        """``error_moved`` or ``error_unavailable``: the key is not served there."""
        return isinstance(reply, Moved) or (
            isinstance(reply, ErrorReply) and reply.code == wire.STATUS_ERROR_UNAVAILABLE
        )

    def on_redirect(self, reply: Reply) -> NextTry | None:
        """After `redirected`: what to do next, or None when the time to follow a hand-over
        is up (`handover` says why)."""
        self.rerouted = True
        if isinstance(reply, Moved):
            return self._follow("error_moved", reply.address)
        self.redirects = 0
        pause_s = self._next_pause(f"{self.endpoint.address} answered error_unavailable")
        return None if pause_s is None else NextTry(pause_s, reroute=True)

    def on_ask(self, reply: Asked) -> NextTry | None:
        """``error_ask <HOST:PORT>``: send this acquire once to that member, ``asking`` first
        (a key-level move: the map stays)."""
        self.rerouted = True
        self.ask_ticket = reply.ticket
        return self._follow("error_ask", reply.address, asking=True)

    def _follow(self, answer: str, address: str, *, asking: bool = False) -> NextTry | None:
        """Follow a redirect at once, up to `REDIRECT_LOOP` in a row (then a loop)."""
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
        """An ``error_ask``'s member refused ``asking``: pause as on ``error_unavailable``."""
        return self._next_pause(f"{self.endpoint.address} refused asking")

    def on_unreachable(self, exc: DflockError) -> float | None:
        """The key's node could not serve: read the map again after the pause returned; None
        when not cluster routing or the time is up (the caller raises ``exc``)."""
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
        return mismatch_error(
            reply,
            shards,
            what=self.what,
            where=self.endpoint.address,
            servers=self.settings.servers,
            strategy=self.settings.sharding_strategy,
        )
