"""The lock state machine shared by the sync and async clients (no I/O here).

`LockCore` validates a lock's settings, picks its server, builds each request, interprets each
reply, and decides when a lock is lost. `celery_dflock.client` and `celery_dflock.aio` only move
bytes and run the renewal thread / task around it, so the two faces cannot drift apart.
"""

from __future__ import annotations

import enum
import logging
import math
import os
import random
import re
import ssl
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Final, cast

from celery_dflock import protocol
from celery_dflock.cluster import ClusterMap, ShardsInfo
from celery_dflock.errors import (
    AuthError,
    DflockError,
    HoldsUnsupported,
    InvalidValueError,
    LimitMismatchError,
    LockNotOwned,
    MaxLocksError,
    MaxWaitersError,
    ProtocolError,
    ServerDraining,
    ServerUnavailable,
    ShardingMismatchError,
)
from celery_dflock.protocol import (
    Asked,
    Command,
    ErrorReply,
    Granted,
    Moved,
    Queued,
    Renewed,
    Reply,
    TimedOut,
)
from celery_dflock.sharding import (
    CLUSTER,
    Routing,
    select_server,
    server_identity,
    stable_hash_shard,
    validate_servers,
)
from dflockd_server import constants

logger: Final = logging.getLogger("celery_dflock.client")

DEFAULT_SERVERS: Final[tuple[tuple[str, int], ...]] = (("127.0.0.1", constants.DEFAULT_PORT),)
DEFAULT_ACQUIRE_TIMEOUT_S: Final = 10
DEFAULT_RENEW_RATIO: Final = 0.5
DEFAULT_CONNECT_TIMEOUT_S: Final = 5.0

REPLY_GRACE_S: Final = 10.0
"""How long a reply may take beyond the time the server was asked to wait."""
READ_TIMEOUT_MARGIN_S: Final = 3.0
"""Renewals happen at least this long before the server's idle read timeout would fire."""
MIN_RENEW_INTERVAL_S: Final = 0.1
MAX_RENEW_INTERVAL_S: Final = constants.DEFAULT_READ_TIMEOUT_S - READ_TIMEOUT_MARGIN_S
JOIN_TIMEOUT_S: Final = REPLY_GRACE_S + 1.0
"""How long `release` waits for the renewal thread / task to finish."""

CLOSING_ERRORS: Final = frozenset({constants.STATUS_ERROR_AUTH, constants.STATUS_ERROR_DRAINING})
"""Error replies after which the connection must not be reused."""

CLOSED_BY_SERVER: Final = (
    "the server closed it: restarted, shutting down, a network cut or an idle timeout"
)
"""Why a held lock's connection that broke while idle went (before it reattaches)."""

_TOKEN_IN_TEXT: Final = re.compile(r"[0-9a-f]{16,}")

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
REATTACH_FIRST_PAUSE_S: Final = 0.05
REATTACH_MAX_PAUSE_S: Final = 1.0
"""After a held lock's connection broke, each failed attempt to reattach (reconnect and renew
by token) is followed by a pause that doubles from the first to the most, while the lease
confirmed last still runs."""
UNAVAILABLE_FIRST_PAUSE_S: Final = 0.05
UNAVAILABLE_MAX_PAUSE_S: Final = 1.0
"""After ``error_unavailable``, a redirect loop or a member that cannot be reached, an acquire
tries again after a pause that doubles from the first to the most (each pause drawn at random
between half and all of that, so that clients do not retry in step), until its time is up."""


def redact(text: str) -> str:
    """``text`` with anything that looks like a token replaced (for logs and lost reasons)."""
    return _TOKEN_IN_TEXT.sub("<token>", text)


# ------------------------------------------------------------------------------ endpoints


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where and how to connect: the identity a connection pool keys its connections on."""

    host: str
    port: int
    auth_token: str | None = field(default=None, repr=False)
    ssl_context: ssl.SSLContext | None = None
    connect_timeout_s: float = field(default=DEFAULT_CONNECT_TIMEOUT_S, compare=False)

    @property
    def address(self) -> str:
        """``host:port``."""
        return f"{self.host}:{self.port}"

    def unavailable_message(self, detail: str) -> str:
        """Why ``host:port`` cannot be used, and what to do."""
        return (
            f"cannot reach the dflockd lock server at {self.address} ({detail}); "
            "start it (`dflockd`, or `uv run dflockd`) or check the server list (`servers=`; "
            "in Celery the `dflock_servers` setting)"
        )


# ------------------------------------------------------------------------------ servers

FEATURE_FENCE: Final = constants.FEATURE_FENCE
FEATURE_PING: Final = constants.FEATURE_PING
FEATURE_STATS: Final = constants.FEATURE_STATS
FEATURE_HOLDS: Final = constants.FEATURE_HOLDS


@dataclass(frozen=True, slots=True)
class Hold:
    """A detached hold (`Client.hold`): the lock ``key`` held by ``token`` on ``server``
    (``"host:port"``) with a lease of ``lease_ttl`` seconds, freed only by a release of the
    token (from any process) or when the lease runs out. ``fence``: the token's fencing
    counter (None when the server does not issue fencing tokens)."""

    key: str
    token: str = field(repr=False)  # a bearer credential: never in a repr
    fence: int | None
    lease_ttl: int
    server: str


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """What a server said about itself in answer to ``hello`` (asked once per server).

    A server that predates ``hello`` (dflockd 0.4/0.5, the Go server) answers ``error``: it is
    a `legacy` server, with no features beyond ``l``/``n``/``r`` known.
    """

    name: str | None = None
    version: str | None = None
    features: frozenset[str] = frozenset()
    max_lease_ttl_s: int | None = None
    """The longest lease the server grants (its ``--max-lease-ttl``), when ``hello`` says so;
    None: not known (another server), nothing is checked before asking."""

    @property
    def legacy(self) -> bool:
        """True for a server that does not answer ``hello``."""
        return self.name is None

    @property
    def fences(self) -> bool:
        """True when its tokens are fencing tokens (``fence`` is None otherwise)."""
        return FEATURE_FENCE in self.features

    def supports(self, feature: str) -> bool:
        """True when ``hello`` listed ``feature``."""
        return feature in self.features

    def describe(self) -> str:
        """``dflockd-server 0.2.0`` or ``a dflockd server without hello``, for messages."""
        if self.name is None:
            return "a dflockd server that does not answer hello (no ping, stats or fences)"
        return f"{self.name} {self.version or '?'}"


LEGACY_SERVER: Final = ServerInfo()
"""What is known of a server that answered ``hello`` with ``error``."""


def server_info(endpoint: Endpoint, reply: Reply) -> ServerInfo:
    """Interpret the reply to ``hello`` (raises for ``error_auth`` / ``error_draining``)."""
    if isinstance(reply, protocol.Hello):
        data = reply.data
        name, version, features = data.get("server"), data.get("version"), data.get("features")
        listed: list[object] = list(features) if isinstance(features, list) else []  # pyright: ignore[reportUnknownArgumentType]
        max_lease = data.get("max_lease_ttl_s")
        return ServerInfo(
            name=str(name) if name is not None else "unnamed",
            version=None if version is None else str(version),
            features=frozenset(str(f) for f in listed),
            max_lease_ttl_s=(
                max_lease
                if isinstance(max_lease, int) and not isinstance(max_lease, bool) and max_lease > 0
                else None
            ),
        )
    if isinstance(reply, ErrorReply):
        if reply.code == constants.STATUS_ERROR_AUTH:
            raise auth_required_error(endpoint)
        if reply.code == constants.STATUS_ERROR_DRAINING:
            raise ServerDraining(
                f"server {endpoint.address} is shutting down; retry once it (or its "
                "replacement) is running"
            )
        return LEGACY_SERVER
    raise ProtocolError(
        f"unexpected reply {reply!r} to 'hello' from {endpoint.address}; is the server a "
        "dflockd-compatible lock server on the right port?"
    )


# ------------------------------------------------------------------------------ validation


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# Every validator raises `InvalidValueError` (or the subclass given as ``error``, as the
# Celery layer gives its `DflockConfigError`) with a message naming ``name``: the argument,
# or in Celery the setting, the user wrote. Each setting is checked here and nowhere else.


def whole_seconds(
    name: str, value: float, *, minimum: int, error: type[InvalidValueError] = InvalidValueError
) -> int:
    """``value`` as the protocol's whole seconds (fractions round up)."""
    if not _is_real(value) or not math.isfinite(value):
        raise error(f"{name} must be a number of seconds, got {value!r}")
    seconds = math.ceil(value)
    if seconds < minimum or seconds > constants.MAX_NUMBER:
        raise error(
            f"{name} must be between {minimum} and {constants.MAX_NUMBER} seconds, got {value!r}"
        )
    return seconds


def positive_seconds(
    name: str, value: float, *, error: type[InvalidValueError] = InvalidValueError
) -> float:
    """``value`` as a positive finite number of seconds."""
    if not _is_real(value) or not math.isfinite(value) or value <= 0:
        raise error(f"{name} must be a positive number of seconds, got {value!r}")
    return float(value)


def check_renew_ratio(
    value: object, name: str = "renew_ratio", *, error: type[InvalidValueError] = InvalidValueError
) -> float:
    """A renewal point: a fraction of the lease strictly between 0 and 1."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < 1:
        raise error(
            f"{name} must be a fraction of the lease strictly between 0 and 1 "
            f"(e.g. 0.5), got {value!r}"
        )
    return float(value)


def check_limit(
    value: object, name: str = "limit", *, error: type[InvalidValueError] = InvalidValueError
) -> int | None:
    """A semaphore's number of slots (None: a plain lock)."""
    if value is None:
        return None
    low, high = constants.MIN_SEMAPHORE_LIMIT, constants.MAX_SEMAPHORE_LIMIT
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise error(
            f"{name} must be None (a plain lock) or an integer from {low} to {high} "
            f"(a semaphore); got {value!r}"
        )
    return value


def check_auth_token(
    value: object, name: str = "auth_token", *, error: type[InvalidValueError] = InvalidValueError
) -> str | None:
    """The shared secret sent first on every connection (None: no auth)."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise error(f"{name} must be a non-empty string or None")
    protocol.encode_auth(value)  # what the protocol can carry
    return value


def check_ssl_context(
    value: object, name: str = "ssl_context", *, error: type[InvalidValueError] = InvalidValueError
) -> ssl.SSLContext | None:
    """TLS for every connection (None: plain TCP)."""
    if value is not None and not isinstance(value, ssl.SSLContext):
        raise error(f"{name} must be an ssl.SSLContext, got {value!r}")
    return value


def check_servers(
    value: object, name: str = "servers", *, error: type[InvalidValueError] = InvalidValueError
) -> tuple[tuple[str, int], ...]:
    """The server list, checked once (the tuple returned is taken as it is when given again)."""
    try:
        return validate_servers(cast("Sequence[tuple[str, int]]", value))
    except ValueError as exc:
        raise error(str(exc) if name == "servers" else f"{name}: {exc}") from None


@dataclass(frozen=True, slots=True)
class ClientSettings:
    """What every lock of one client shares, each value validated once (by the `Client`, with
    the validators above; in Celery by the config, naming its ``dflock_*`` settings)."""

    servers: tuple[tuple[str, int], ...] = DEFAULT_SERVERS
    sharding_strategy: Routing = stable_hash_shard
    renew_ratio: float = DEFAULT_RENEW_RATIO
    auth_token: str | None = field(default=None, repr=False)
    ssl_context: ssl.SSLContext | None = None
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    acquire_timeout_s: float = DEFAULT_ACQUIRE_TIMEOUT_S
    """The FIFO wait of a lock made without ``acquire_timeout_s``."""
    lease_ttl_s: float | None = None
    """The lease of a lock made without ``lease_ttl_s`` (None: the server's default)."""

    def endpoint(self, host: str, port: int) -> Endpoint:
        """How to connect to the server ``host:port``."""
        return Endpoint(host, port, self.auth_token, self.ssl_context, self.connect_timeout_s)

    def endpoints(self) -> list[Endpoint]:
        """Every server's `endpoint`, in the configured order."""
        return [self.endpoint(host, port) for host, port in self.servers]


class LockState(enum.Enum):
    """Where a lock object stands, as far as this process knows."""

    IDLE = "idle"
    ENQUEUED = "enqueued"
    HELD = "held"


class EnqueueResult(str):
    """What ``enqueue()`` returns: ``"acquired"`` (held now) or ``"queued"`` (call ``wait()``).

    A `str`, as dflockd's own clients and the Go client return, that is also true only when
    acquired, so ``if lock.enqueue() == "acquired":`` and ``if lock.enqueue():`` both read
    naturally (code written for the earlier ``True``/``False`` keeps working).
    """

    __slots__ = ()

    def __bool__(self) -> bool:
        return str.__eq__(self, "acquired")


ACQUIRED: Final = EnqueueResult("acquired")
QUEUED: Final = EnqueueResult("queued")


@dataclass(slots=True)
class RenewOutcome:
    """What a renewal attempt found: ``renewed``; or ``reattach`` (the connection is done for,
    the grant may still be held: renew it by token on a new connection); or ``lost_reason``
    (None: nothing to do)."""

    renewed: bool
    lost_reason: str | None = None
    reattach: bool = False


# ------------------------------------------------------------------------------ cluster routing


@dataclass(frozen=True, slots=True)
class NextTry:
    """What an acquire does after a redirect (`LockCore.on_redirect`): pause ``pause_s``;
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


# ------------------------------------------------------------------------------ the core


class LockCore:
    """State and decisions of one lock or semaphore object; every method is I/O free."""

    def __init__(  # noqa: PLR0917 - the shells pass them in this order
        self,
        key: str,
        limit: int | None,
        acquire_timeout_s: float,
        lease_ttl_s: float | None,
        servers: Sequence[tuple[str, int]],
        sharding_strategy: Routing,
        renew_ratio: float,
        auth_token: str | None,
        ssl_context: ssl.SSLContext | None,
        connect_timeout_s: float,
        router: ClusterRouter | None = None,
        note: str | None = None,
    ) -> None:
        self.key = protocol.validate_key(key)
        self.note = None if note is None else protocol.validate_note(note)
        """The owner note sent with each acquire (``hl ... c <note>``) to a server with holds."""
        self.holder: str | None = None
        """After an acquire refused on a busy key: the holder's note (servers with holds)."""
        self.busy = False
        """The last acquire ended with ``timeout`` (the key stayed busy)."""
        self.limit = check_limit(limit)
        self.acquire_timeout_s = whole_seconds("acquire_timeout_s", acquire_timeout_s, minimum=0)
        self.lease_ttl_s = (
            None if lease_ttl_s is None else whole_seconds("lease_ttl_s", lease_ttl_s, minimum=1)
        )
        self.renew_ratio = check_renew_ratio(renew_ratio)
        check_auth_token(auth_token)
        check_ssl_context(ssl_context)
        self.servers = check_servers(servers)
        self.strategy = sharding_strategy
        self.router: ClusterRouter | None = None
        """Cluster routing (``sharding_strategy="cluster"``): the map shared with the client."""
        if sharding_strategy == CLUSTER:
            self.router = router if router is not None else ClusterRouter(self.servers)
            self.server_index = 0
        elif isinstance(sharding_strategy, str):
            raise InvalidValueError(
                f"sharding_strategy must be a callable (key, number_of_servers) -> index or "
                f"{CLUSTER!r}, got {sharding_strategy!r}"
            )
        else:
            self.server_index = select_server(self.key, self.servers, sharding_strategy)
        host, port = self.servers[self.server_index]
        self.endpoint = Endpoint(
            host,
            port,
            auth_token,
            ssl_context,
            positive_seconds("connect_timeout_s", connect_timeout_s),
        )
        self.state = LockState.IDLE
        self.token: str | None = None
        self.fencing = False  # the server that granted `token` issues fencing tokens
        self.lease = 0
        self.lost = False
        self.pid: int | None = None
        # time.monotonic() until which the lease surely runs, and by which it surely ends
        self.lease_deadline = 0.0
        self.lease_latest_end = 0.0
        self.enqueued_at: float | None = None  # when the `e` that queued us was sent
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
        # Reattaching a held lock whose connection broke: failed attempts so far, and why
        # the connection went (None: the lock's connection is fine).
        self.reattach_failures = 0
        self.broken: str | None = None

    # ---------------------------------------------------------------- naming
    @property
    def semaphore(self) -> bool:
        """True for a semaphore (``sl``/``se``/... commands)."""
        return self.limit is not None

    @property
    def what(self) -> str:
        """``lock 'key'`` or ``semaphore 'key' (limit N)``, for messages."""
        if self.limit is None:
            return f"lock {self.key!r}"
        return f"semaphore {self.key!r} (limit {self.limit})"

    def describe(self) -> str:
        """A repr body without the token."""
        return f"key={self.key!r}, server={self.endpoint.address!r}, state={self.state.value}" + (
            ", lost" if self.lost else ""
        )

    # ---------------------------------------------------------------- views
    @property
    def fence(self) -> int | None:
        """The fencing counter of the current token; None without one, or when its server
        does not issue fencing tokens (it did not list ``fence`` in its ``hello``)."""
        if self.token is None or not self.fencing:
            return None
        return protocol.fence_of(self.token)

    def foreign_process(self) -> bool:
        """True when the lock was acquired by another process (we are a fork child)."""
        return self.pid is not None and self.pid != os.getpid()

    def locked(self) -> bool:
        """Held (acquired, not released) by this object in this process."""
        return self.state is LockState.HELD and not self.foreign_process()

    def owned(self) -> bool:
        """`locked`, not lost, and the lease is known to be still running."""
        return self.locked() and not self.lost and time.monotonic() < self.lease_deadline

    def renew_interval(self) -> float:
        """Seconds between renewals: ``lease * renew_ratio``, below the server's read timeout."""
        interval = self.lease * self.renew_ratio
        return max(MIN_RENEW_INTERVAL_S, min(interval, MAX_RENEW_INTERVAL_S))

    def first_renewal_in(self) -> float:
        """Seconds to the first renewal of a new grant: at the usual point of the lease, as
        far as the client knows where the lease stands (a grant collected by ``w`` may have
        started when the lock was freed, before the ``w`` was sent)."""
        interval = self.renew_interval()
        remaining = self.lease_deadline - time.monotonic()
        return max(0.0, min(interval, remaining - (self.lease - interval)))

    def reply_timeout(self, wait_s: int = 0) -> float:
        """How long to wait for a reply when the server was asked to wait ``wait_s``."""
        return wait_s + REPLY_GRACE_S

    def renew_reply_timeout(self) -> float:
        """A renewal answered after the lease surely ran out is useless: wait at most that
        long. (Not only until ``lease_deadline``: after a late ``w`` the lease may run well
        past it, and the renewal sent at once to find out must get its answer.)"""
        remaining = self.lease_latest_end - time.monotonic()
        return max(MIN_RENEW_INTERVAL_S, min(REPLY_GRACE_S, remaining))

    # ---------------------------------------------------------------- routing
    def begin_acquire(self) -> None:
        """An acquire (or enqueue) starts: its deadlines run from now."""
        now = time.monotonic()
        self.acquire_deadline = now + self.acquire_timeout_s
        follow = self.acquire_timeout_s
        if self.router is not None:
            follow = max(follow, HANDOVER_MIN_WAIT_S)
        self.route_deadline = now + follow
        self.holder = None
        self.busy = False
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
        return max(0, math.ceil(deadline - time.monotonic()))

    def endpoint_at(self, host: str, port: int) -> Endpoint:
        """How to connect to ``host:port`` (this lock's auth, TLS and connect timeout)."""
        return replace(self.endpoint, host=host, port=port)

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
            isinstance(reply, ErrorReply) and reply.code == constants.STATUS_ERROR_UNAVAILABLE
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
        remaining = self.route_deadline - time.monotonic()
        if remaining <= 0:
            self.handover = (
                f"{self.what} was not acquired within its acquire timeout "
                f"({self.acquire_timeout_s} s; in Celery lock_timeout): a hand-over of its "
                f"shard between cluster members was under way ({why})"
            )
            logger.info("%s", self.handover)
            return None
        return min(pause * (0.5 + random.random() / 2), remaining)  # jitter

    def mismatch_error(self, reply: Reply, shards: dict[str, object] | None) -> DflockError:
        """A list-mode client was redirected: the server has another view of where keys live.
        ``shards`` is what the server answered to ``shards`` (None: it did not say)."""
        where = self.endpoint.address
        ours = ",".join(server_identity(server) for server in self.servers)
        strategy = getattr(self.strategy, "__name__", None) or repr(self.strategy)
        redirect = (
            f"error_moved {reply.address}" if isinstance(reply, Moved) else "error_unavailable"
        )
        try:
            info = None if shards is None else ShardsInfo.parse(shards, where)
        except ProtocolError:
            info = None
        if info is not None and info.mode == constants.MODE_CLUSTER:
            return ShardingMismatchError(
                f"server {where} is a member of a cluster (dflockd --cluster) and answered "
                f"{redirect} for {self.what}, but this client shards keys itself over "
                f"servers={ours} (strategy {strategy}; in Celery the `dflock_servers` setting): "
                "use sharding_strategy='cluster' (in Celery dflock_sharding_strategy = "
                '"cluster"), the servers then being seeds of the cluster'
            )
        theirs = ",".join(info.members) if info is not None and info.members else "unknown"
        self_name = info.self_address if info is not None else None
        return ShardingMismatchError(
            f"server {where} refused {self.what} ({redirect}): it was started with "
            f"--members {theirs}"
            + (f" --advertise {self_name}" if self_name else "")
            + f" and serves only its crc32 share of that list, but this client's servers are "
            f"{ours} (sharding strategy {strategy}; in Celery the `dflock_servers` setting). "
            "List the same servers in the same order on both sides (servers= / "
            "dflock_servers and every server's --members / DFLOCKD_MEMBERS), with the default "
            "stable_hash_shard strategy"
        )

    # ---------------------------------------------------------------- requests
    def _require_idle(self) -> None:
        if self.state is LockState.HELD and self.lost:
            raise DflockError(f"{self.what} was lost; call release() before acquiring it again")
        if self.state is LockState.HELD:
            raise DflockError(f"{self.what} is already held by this object; release() it first")
        if self.state is LockState.ENQUEUED:
            raise DflockError(
                f"{self.what} is enqueued on this object; call wait() or release() first"
            )

    def check_lease(self, server: ServerInfo | None, lease: int | None) -> None:
        """Refuse, before asking, a lease above the longest ``server`` grants (its ``hello``
        says so; a server that does not is asked as it is)."""
        limit = None if server is None else server.max_lease_ttl_s
        if lease is None or limit is None or lease <= limit:
            return
        raise InvalidValueError(
            f"{self.what}: the lease asked for ({lease} s) is above the longest lease server "
            f"{self.endpoint.address} grants ({limit} s, its --max-lease-ttl / "
            "DFLOCKD_MAX_LEASE_TTL_S). Ask for a shorter lease (lease_ttl_s=; in Celery the "
            "lock_ttl option or the dflock_lock_ttl setting, lock_pending_ttl for a key held "
            "from publish, dflock_beat_lease_ttl for beat): renewal keeps a lock held however "
            "long the work runs. Or start the server with a larger --max-lease-ttl"
        )

    def acquire_request(self, server: ServerInfo | None = None) -> tuple[Command, bytes, float]:
        """``l`` / ``sl`` with the acquire timeout: (command, bytes, reply timeout). A lock
        with a `note` sends ``hl ... c <note>`` instead to a ``server`` that has holds."""
        self._require_idle()
        timeout = self.wait_seconds()
        if self.limit is None:
            if self.note is not None and server is not None and server.supports(FEATURE_HOLDS):
                self.check_lease(server, self.hold_lease())
                data = protocol.encode_hold(
                    self.key, timeout, self.hold_lease(), self.note, detached=False
                )
                return Command.HOLD, data, self.reply_timeout(timeout)
            self.check_lease(server, self.lease_ttl_s)
            data = protocol.encode_lock(self.key, timeout, self.lease_ttl_s)
            return Command.LOCK, data, self.reply_timeout(timeout)
        self.check_lease(server, self.lease_ttl_s)
        data = protocol.encode_sem_lock(self.key, timeout, self.limit, self.lease_ttl_s)
        return Command.SEM_LOCK, data, self.reply_timeout(timeout)

    def hold_request(
        self, server: ServerInfo | None, note: str, *, detached: bool = True
    ) -> tuple[Command, bytes, float]:
        """``hl ... d <note>``: a detached hold; not ``detached``: ``hl ... c <note>``, bound
        to the connection until `detach_token_request` (`HoldsUnsupported` unless ``server``
        has holds)."""
        self._require_idle()
        self.require_holds(server)
        self.check_lease(server, self.hold_lease())
        timeout = self.wait_seconds()
        data = protocol.encode_hold(self.key, timeout, self.hold_lease(), note, detached=detached)
        return Command.HOLD, data, self.reply_timeout(timeout)

    def detach_token_request(
        self, server: ServerInfo | None, token: str, lease_ttl: int
    ) -> tuple[Command, bytes, float]:
        """``hd <token> <lease>`` for a grant this object does not hold: detach it from the
        connection it is bound to (`HoldsUnsupported` unless ``server`` has holds)."""
        self.require_holds(server)
        data = protocol.encode_hand_down(self.key, protocol.validate_token(token), lease_ttl)
        return Command.HAND_DOWN, data, self.reply_timeout()

    def hold_lease(self) -> int:
        """The lease ``hl`` asks for (it always names one): the lock's, else the protocol's
        default."""
        return constants.DEFAULT_LEASE_TTL_S if self.lease_ttl_s is None else self.lease_ttl_s

    def require_holds(self, server: ServerInfo | None) -> None:
        """Raise `HoldsUnsupported` unless ``server`` listed ``holds`` in its ``hello``."""
        if server is None or not server.supports(FEATURE_HOLDS):
            what = "a server that was not asked hello" if server is None else server.describe()
            raise HoldsUnsupported(
                f"server {self.endpoint.address} is {what}, and a hold or owner note (of "
                f"{self.what}) needs celery-dflock's dflockd-server (the 'holds' feature), "
                "which that server does not list in its hello; run the bundled `dflockd` there"
            )

    def take_over_note(self, note: str | None) -> str:
        """The note ``ht`` carries for `adopt`: ``note``, else this lock's `note`; a
        `ValueError` (an `InvalidValueError`) when neither is given (``ht`` always names one)."""
        if note is not None:
            return protocol.validate_note(note)
        if self.note is not None:
            return self.note
        raise InvalidValueError(
            f"adopting a hold of {self.what} needs an owner note: pass note= to adopt() or "
            "make the lock with note="
        )

    def take_over_request(
        self, server: ServerInfo | None, token: str, note: str, on_close_lease: int | None
    ) -> tuple[Command, bytes, float]:
        """``ht <token> <lease> <onclose> <note>``: take over a detached grant made elsewhere,
        bound to this connection from now on (`HoldsUnsupported` unless ``server`` has
        holds)."""
        self._require_idle()
        self.require_holds(server)
        self.check_lease(server, self.hold_lease())
        data = protocol.encode_take(self.key, token, self.hold_lease(), on_close_lease, note)
        return Command.TAKE, data, self.reply_timeout()

    def on_take_over_reply(
        self, token: str, reply: Reply, sent_at: float, server: ServerInfo | None
    ) -> bool:
        """Interpret the reply to `take_over_request`: True when held now (as after a grant),
        False when ``token`` no longer holds the key or another connection has it bound
        (`holder` then says that holder's note)."""
        self.holder = None
        self.busy = False
        if isinstance(reply, Renewed) and reply.seconds_remaining > 0:
            granted = Granted(token, reply.seconds_remaining)
            return self.on_grant_reply(Command.LOCK, granted, sent_at, server)
        if isinstance(reply, protocol.Bound):
            self.busy = True
            self.holder = reply.holder
            return False
        if isinstance(reply, ErrorReply) and reply.code == constants.STATUS_ERROR:
            return False
        if isinstance(reply, ErrorReply):
            raise self.error_for(Command.TAKE, reply)
        raise ProtocolError(f"unexpected reply {reply!r} to {Command.TAKE.label}")

    def token_renew_request(self, token: str, lease_ttl: int) -> tuple[Command, bytes, float]:
        """``n <token> <lease>`` for a grant this object does not hold."""
        data = protocol.encode_renew(self.key, protocol.validate_token(token), lease_ttl)
        return Command.RENEW, data, self.reply_timeout()

    def note_request(
        self, server: ServerInfo | None, token: str, note: str
    ) -> tuple[Command, bytes, float]:
        """``note <token> <note>`` (`HoldsUnsupported` unless ``server`` has holds)."""
        self.require_holds(server)
        return Command.NOTE, protocol.encode_note(self.key, token, note), self.reply_timeout()

    def on_token_reply(self, command: Command, reply: Reply) -> bool:
        """The reply to `token_renew_request` or `note_request`: True done, False when the
        token no longer holds the key; raises for other refusals."""
        if isinstance(reply, Renewed | protocol.Ok):
            return True
        if isinstance(reply, ErrorReply) and reply.code == constants.STATUS_ERROR:
            return False
        if isinstance(reply, ErrorReply):
            raise self.error_for(command, reply)
        raise ProtocolError(f"unexpected reply {reply!r} to {command.label}")

    def hand_off_request(
        self, lease_ttl: int, server: ServerInfo | None
    ) -> tuple[Command, bytes, float]:
        """``hd <token> <lease_ttl>`` for the held token: detach it from this connection before
        letting go of it. A ``server`` without holds gets ``n <token> <lease_ttl>`` (its grant
        stays bound to the connection, which goes back to the pool)."""
        token = self._held_token()
        if server is None or not server.supports(FEATURE_HOLDS):
            return self.token_renew_request(token, lease_ttl)
        data = protocol.encode_hand_down(self.key, token, lease_ttl)
        return Command.HAND_DOWN, data, self.reply_timeout()

    def enqueue_request(self, server: ServerInfo | None = None) -> tuple[Command, bytes, float]:
        """``e`` / ``se``."""
        self._require_idle()
        self.check_lease(server, self.lease_ttl_s)
        if self.limit is None:
            data = protocol.encode_enqueue(self.key, self.lease_ttl_s)
            return Command.ENQUEUE, data, self.reply_timeout()
        data = protocol.encode_sem_enqueue(self.key, self.limit, self.lease_ttl_s)
        return Command.SEM_ENQUEUE, data, self.reply_timeout()

    def wait_request(self, timeout_s: float | None) -> tuple[Command, bytes, float]:
        """``w`` / ``sw`` (the lock must be enqueued)."""
        if self.state is not LockState.ENQUEUED:
            raise LockNotOwned(f"{self.what} is not enqueued: call enqueue() before wait()")
        timeout = (
            self.acquire_timeout_s
            if timeout_s is None
            else whole_seconds("timeout_s", timeout_s, minimum=0)
        )
        command = Command.WAIT if self.limit is None else Command.SEM_WAIT
        encode = protocol.encode_wait if self.limit is None else protocol.encode_sem_wait
        return command, encode(self.key, timeout), self.reply_timeout(timeout)

    def _held_token(self) -> str:
        if self.state is not LockState.HELD or self.token is None:
            raise LockNotOwned(f"{self.what} is not held by this object: acquire() it first")
        return self.token

    def renew_request(self) -> tuple[Command, bytes, float]:
        """``n`` / ``sn`` for the held token."""
        token = self._held_token()
        if self.limit is None:
            data = protocol.encode_renew(self.key, token, self.lease_ttl_s)
            return Command.RENEW, data, self.renew_reply_timeout()
        data = protocol.encode_sem_renew(self.key, token, self.lease_ttl_s)
        return Command.SEM_RENEW, data, self.renew_reply_timeout()

    def release_request(self) -> tuple[Command, bytes, float]:
        """``r`` / ``sr`` for the held token."""
        token = self._held_token()
        if self.limit is None:
            data = protocol.encode_release(self.key, token)
            return Command.RELEASE, data, self.reply_timeout()
        data = protocol.encode_sem_release(self.key, token)
        return Command.SEM_RELEASE, data, self.reply_timeout()

    # ---------------------------------------------------------------- replies
    def on_grant_reply(
        self, command: Command, reply: Reply, sent_at: float, server: ServerInfo | None
    ) -> bool:
        """Interpret the reply to ``l``/``sl``/``e``/``se``/``w``/``sw``; ``server`` is what the
        server said to ``hello`` (its tokens count as fences only if it lists ``fence``).

        True: held (the caller pins the connection and starts renewing). False: not held
        (``queued`` leaves the state ENQUEUED, the connection stays pinned). Raises for refusals.
        """
        if isinstance(reply, Granted):
            started = sent_at
            if command in (Command.WAIT, Command.SEM_WAIT) and self.enqueued_at is not None:
                # The server grants a queued lock when it is freed, and its lease runs from
                # then, possibly long before this `w` was sent; the reply still carries the
                # whole lease. The earliest that can be is when we enqueued.
                started = self.enqueued_at
            self.state = LockState.HELD
            self.token = reply.token
            self.fencing = server is not None and server.fences
            self.lease = reply.lease
            self.lost = False
            self.pid = os.getpid()
            self.lease_deadline = started + reply.lease
            self.lease_latest_end = time.monotonic() + reply.lease
            self.enqueued_at = None
            return True
        if isinstance(reply, Queued):
            self.state = LockState.ENQUEUED
            self.pid = os.getpid()
            self.enqueued_at = sent_at
            return False
        self.reset()
        if isinstance(reply, TimedOut):
            self.busy = True
            self.holder = reply.holder
            return False
        if isinstance(reply, Moved):
            logger.warning(
                "%s: its shard moved to %s while it was queued on %s; not acquired (acquire "
                "again: the cluster routes it there)",
                self.what,
                reply.address,
                self.endpoint.address,
            )
            return False
        if isinstance(reply, ErrorReply):
            if reply.code == constants.STATUS_ERROR_LEASE_EXPIRED:
                logger.warning(
                    "%s on %s was granted while queued, but its lease ran out before wait() "
                    "collected it; call wait() sooner after enqueue() or use a longer lease",
                    self.what,
                    self.endpoint.address,
                )
                return False
            raise self.error_for(command, reply)
        raise ProtocolError(f"unexpected reply {reply!r} to {command.label}")

    def on_renew_reply(self, reply: Reply, sent_at: float) -> RenewOutcome:
        """Interpret the reply to ``n``/``sn`` (on the pinned connection or, reattaching, on a
        new one). ``error_draining``: the server is shutting down (to restart, it may keep the
        lease): reattach. ``error``: the server no longer holds the grant: lost."""
        if isinstance(reply, Renewed):
            self.lease_deadline = sent_at + reply.seconds_remaining
            self.lease_latest_end = time.monotonic() + reply.seconds_remaining
            if self.broken is not None:
                logger.info(
                    "dflock %s reattached to the lock server at %s (its connection had "
                    "closed: %s); still held",
                    self.what,
                    self.endpoint.address,
                    redact(self.broken),
                )
            self.broken = None
            self.reattach_failures = 0
            return RenewOutcome(renewed=True)
        code = reply.code if isinstance(reply, ErrorReply) else repr(reply)
        if code == constants.STATUS_ERROR_DRAINING:
            return RenewOutcome(
                renewed=False, lost_reason="the server is shutting down", reattach=True
            )
        if code == constants.STATUS_ERROR and self.broken is not None:
            why = (
                f"its connection closed ({self.broken}), and the server refused the renewal "
                "by token on a new connection (it released the lock with the connection, or "
                "restarted without it, or the lease had expired)"
            )
        elif code == constants.STATUS_ERROR:
            why = "the server refused the renewal (the lease had expired or was released)"
        else:
            why = f"the server answered {code!r} to the renewal"
        return RenewOutcome(renewed=False, lost_reason=why)

    # ---------------------------------------------------------------- reattaching
    def connection_broke(self, detail: str) -> None:
        """The held lock's connection closed or failed (``detail`` says how). The server may
        still hold the grant (a restart that restored it from its journal, a connection cut
        on the way, or without auto-release on disconnect): the lock is not lost until a
        renewal by token on a new connection is refused or the lease runs out first."""
        if self.broken is None:
            self.reattach_failures = 0
            logger.info(
                "dflock %s: its connection to %s closed (%s); reattaching by token while the "
                "lease runs (%.1f s left)",
                self.what,
                self.endpoint.address,
                redact(detail),
                max(0.0, self.lease_left()),
            )
        self.broken = detail

    def lease_left(self, now: float | None = None) -> float:
        """Seconds the lease confirmed last surely still runs (from when the last accepted
        grant or renewal was sent; never more than the lease)."""
        return self.lease_deadline - (time.monotonic() if now is None else now)

    def reattach_endpoint(self, now: float | None = None) -> Endpoint:
        """Where to reconnect: the lock's endpoint, its connect timeout cut to the lease left
        (a connection made after the lease ran out could not save the lock)."""
        left = max(MIN_RENEW_INTERVAL_S, self.lease_left(now))
        if left >= self.endpoint.connect_timeout_s:
            return self.endpoint
        return replace(self.endpoint, connect_timeout_s=left)

    def reattach_pause(self, detail: str, now: float | None = None) -> float | None:
        """An attempt to reach the server again failed (``detail``): seconds to pause before
        the next, doubling from `REATTACH_FIRST_PAUSE_S` to `REATTACH_MAX_PAUSE_S` and never
        past the lease; None when the lease has run out (the caller `mark_unreachable`s)."""
        self.broken = detail
        left = self.lease_left(now)
        if left <= 0:
            return None
        pause = min(REATTACH_FIRST_PAUSE_S * 2**self.reattach_failures, REATTACH_MAX_PAUSE_S)
        self.reattach_failures += 1
        return min(pause, left)

    def mark_unreachable(self) -> bool:
        """The lease ran out before the server could be reached again after the lock's
        connection broke: `mark_lost`; True the first time."""
        return self.mark_lost(
            f"its connection to the lock server at {self.endpoint.address} closed "
            f"({self.broken or 'unknown cause'}), and the server could not be reached again "
            "before the lease ran out"
        )

    def on_release_reply(self, reply: Reply, *, retried: bool = False) -> bool:
        """Interpret the reply to ``r``/``sr``: True if this release freed the lock.

        A refusal means the server no longer held this grant: its lease ran out while this
        process still counted on it (paused, or its renewals did not get through), or it was
        released from elsewhere. The lock was lost while held: it is marked lost here and
        stays HELD, so the caller can notify (with the fence still known) before it `reset`s.
        A confirmed release resets at once. ``retried``: an earlier release of this grant was
        sent and its connection broke before the answer came; that release may have freed
        it, so a refusal is no proof of a loss (reset, not marked lost).
        """
        if isinstance(reply, protocol.Ok):
            self.reset()
            return True
        code = reply.code if isinstance(reply, ErrorReply) else repr(reply)
        if retried:
            logger.info(
                "dflock %s: the server no longer held it when the release was sent again "
                "(reply %r); the first release, whose answer was lost with its connection, "
                "may have freed it",
                self.what,
                code,
            )
            self.reset()
            return False
        self.mark_lost(
            "the server no longer held it when it was released (the lease had run out or it "
            f"was released elsewhere; reply {code!r})"
        )
        return False

    @staticmethod
    def draining(reply: Reply) -> bool:
        """True for ``error_draining``: the server is shutting down (a restart may keep the
        lease); a request about a held grant is sent again on a new connection."""
        return isinstance(reply, ErrorReply) and reply.code == constants.STATUS_ERROR_DRAINING

    def mark_lost(self, reason: str) -> bool:
        """Record that the lock is lost; True the first time (the caller then notifies)."""
        if self.lost or self.state is not LockState.HELD:
            return False
        self.lost = True
        logger.warning(
            "dflock %s on %s was lost: %s", self.what, self.endpoint.address, redact(reason)
        )
        return True

    def adopt(self, token: str) -> None:
        """Hold ``token``, granted to another object or process, so that it can be released
        through `release_request` / `on_release_reply` (then `reset`). Nothing is known of its
        lease, so this object never counts it as its own to lose: it is marked lost up front,
        and a release the server refuses is not reported as a loss."""
        self._require_idle()
        self.state = LockState.HELD
        self.token = protocol.validate_token(token)
        self.fencing = False
        self.lease = 0
        self.lost = True
        self.pid = os.getpid()

    def reset(self) -> None:
        """Back to IDLE (after a release, a timeout, a refusal or a fork)."""
        self.state = LockState.IDLE
        self.token = None
        self.pid = None
        self.lease_deadline = 0.0
        self.lease_latest_end = 0.0
        self.enqueued_at = None
        self.broken = None
        self.reattach_failures = 0

    # ---------------------------------------------------------------- errors
    def error_for(self, command: Command, reply: ErrorReply) -> DflockError:
        """The exception for a refusal, with a message that says what to do."""
        where = self.endpoint.address
        code = reply.code
        if code == constants.STATUS_ERROR_MAX_LOCKS:
            return MaxLocksError(
                f"server {where} refused {self.what}: it already tracks its maximum number of "
                "keys; raise its --max-locks (DFLOCKD_MAX_LOCKS) or use fewer distinct keys"
            )
        if code == constants.STATUS_ERROR_MAX_WAITERS:
            return MaxWaitersError(
                f"server {where} refused to queue on {self.what}: too many waiters already; "
                "raise its --max-waiters (DFLOCKD_MAX_WAITERS) or use a shorter acquire timeout"
            )
        if code == constants.STATUS_ERROR_LIMIT_MISMATCH:
            if self.limit is None:
                return LimitMismatchError(
                    f"{self.what} on {where} was refused: the key is in use as a semaphore "
                    "(a limit other than 1), and a lock is a semaphore of limit 1 on the same "
                    "key, so the two exclude each other; use another key for the lock, or the "
                    "same limit everywhere the key is used, or wait until the key is idle"
                )
            return LimitMismatchError(
                f"{self.what} on {where} was refused: the key is in use with a limit other "
                f"than {self.limit} (as a lock, limit 1, or a semaphore of another limit); "
                "every user of a key must pass the same limit (or wait until the key is idle)"
            )
        if code == constants.STATUS_ERROR_AUTH:
            return auth_required_error(self.endpoint)
        if code == constants.STATUS_ERROR_DRAINING:
            return ServerDraining(
                f"server {where} is shutting down and refused {command.label} for "
                f"{self.what}; retry once it (or its replacement) is running"
            )
        if code == constants.STATUS_ERROR_ALREADY_ENQUEUED:
            return DflockError(
                f"{self.what} is already enqueued on this connection; call wait() instead"
            )
        if code == constants.STATUS_ERROR_NOT_ENQUEUED:
            return LockNotOwned(f"{self.what} is not enqueued on {where}: call enqueue() first")
        if code == constants.STATUS_ERROR_UNAVAILABLE:
            return ServerUnavailable(
                f"no cluster member serves {self.what} right now ({where} answered "
                f"{code!r} to {command.label}: its shard is changing hands); retry shortly"
            )
        lease = ""
        if self.lease_ttl_s is not None and code == constants.STATUS_ERROR:
            lease = (
                f", or the lease asked for ({self.lease_ttl_s} s, lock_ttl / lease_ttl_s) is "
                "above its --max-lease-ttl (DFLOCKD_MAX_LEASE_TTL_S, default "
                f"{constants.DEFAULT_MAX_LEASE_TTL_S} s): ask for a shorter lease (renewal "
                "keeps it held) or raise the server's limit"
            )
        return ProtocolError(
            f"server {where} answered {code!r} to {command.label} for {self.what}: it found "
            "the request malformed or does not know the command (an older dflockd server?)"
            f"{lease}"
        )


def auth_required_error(endpoint: Endpoint) -> AuthError:
    """The error for ``error_auth`` on a request other than ``auth``."""
    if endpoint.auth_token is None:
        return AuthError(
            f"server {endpoint.address} requires authentication: give the secret it was "
            "started with (--auth-token / DFLOCKD_AUTH_TOKEN) as auth_token= (in Celery the "
            "`dflock_auth_token` setting)"
        )
    return AuthError(
        f"server {endpoint.address} refused this connection's authentication; check "
        "auth_token against the server's --auth-token / DFLOCKD_AUTH_TOKEN"
    )


def auth_reply_error(endpoint: Endpoint, reply: Reply) -> AuthError | None:
    """None when ``auth`` succeeded, else the error to raise."""
    if isinstance(reply, protocol.Ok):
        return None
    if isinstance(reply, ErrorReply) and reply.code == constants.STATUS_ERROR:
        return AuthError(
            f"server {endpoint.address} has no auth token configured but one was given: "
            "remove auth_token= (in Celery `dflock_auth_token`) or start the server with "
            "--auth-token"
        )
    return AuthError(
        f"server {endpoint.address} rejected the auth token (auth_token=, in Celery "
        "`dflock_auth_token`): it does not match the server's --auth-token / DFLOCKD_AUTH_TOKEN"
    )
