"""A client's settings: the defaults, the validators, and `ClientSettings` (no I/O here).

Every setting is checked once, where it enters (public constructors name the argument, the
Celery layer its ``dflock_*`` setting); the frozen `ClientSettings` is passed down whole to
every lock, which checks nothing again."""

from __future__ import annotations

import math
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, cast

from celery_dflock.client import wire
from celery_dflock.client.errors import InvalidValueError, ServerUnavailable
from celery_dflock.client.sharding import CLUSTER, Routing, stable_hash_shard, validate_servers

DEFAULT_SERVERS: Final[tuple[tuple[str, int], ...]] = (("127.0.0.1", wire.DEFAULT_PORT),)
DEFAULT_ACQUIRE_TIMEOUT_S: Final = 10
"""How long an acquire waits in the key's FIFO queue."""
DEFAULT_RENEW_RATIO: Final = 0.5
"""A held lock is renewed at this fraction of its lease."""
DEFAULT_CONNECT_TIMEOUT_S: Final = 5.0
"""How long a new connection (TCP, TLS, ``auth``, ``hello``) may take."""
DEFAULT_SESSION_TTL_S: Final = 15
"""A client's session time: it rides out a stall of about 9 s without losing a lock; a
process killed outright keeps its keys this long."""
MIN_SESSION_TTL_S: Final = 2
"""The shortest session time kept: the client counts a session over at its time less 0.75 s
from a keep-alive's send, and sends one every third of it (1 s: over 0.08 s before the next)."""

REPLY_GRACE_S: Final = 10.0  # how long a reply may take past the time the server was asked to wait
JOIN_TIMEOUT_S: Final = REPLY_GRACE_S + 1.0  # `release`'s wait for the renewal thread / task to end
READ_TIMEOUT_MARGIN_S: Final = 3.0  # renew this long at least before the server's read timeout
MIN_RENEW_INTERVAL_S: Final = 0.1
MAX_RENEW_INTERVAL_S: Final = wire.DEFAULT_READ_TIMEOUT_S - READ_TIMEOUT_MARGIN_S


_PLAIN_REPLY: Final = ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "PACKET_LENGTH_TOO_LONG")
"""OpenSSL's reasons (by version) for a TLS handshake answered in plain bytes."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where and how to connect: the identity a connection pool keys its connections on."""

    host: str
    port: int
    auth_token: str | None = field(default=None, repr=False)
    ssl_context: ssl.SSLContext | None = None
    connect_timeout_s: float = field(default=DEFAULT_CONNECT_TIMEOUT_S, compare=False)
    session_ttl_s: int = field(default=DEFAULT_SESSION_TTL_S, compare=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def unavailable(self, why: str | OSError) -> ServerUnavailable:
        """Why ``host:port`` cannot be used (``why``: what failed), and what to do."""
        detail = why if isinstance(why, str) else why.strerror or str(why) or type(why).__name__
        if self.ssl_context is not None and any(reason in detail for reason in _PLAIN_REPLY):
            return ServerUnavailable(
                f"the dflockd lock server at {self.address} answers without TLS ({detail}): "
                "connect to it without TLS (ssl_context=None; in Celery leave `dflock_ssl` "
                "unset), or start it with --tls-cert and --tls-key"
            )
        return ServerUnavailable(
            f"cannot reach the dflockd lock server at {self.address} ({detail}); "
            "start it (`dflockd`, or `uv run dflockd`) or check the server list (`servers=`; "
            "in Celery the `dflock_servers` setting)"
        )


def _is_real(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# Every validator raises `InvalidValueError` (or the ``error`` subclass given, as the Celery
# layer gives its `DflockConfigError`) naming ``name``: the argument, or the setting, written.


def whole_seconds(
    name: str, value: float, *, minimum: int, error: type[InvalidValueError] = InvalidValueError
) -> int:
    """``value`` as the protocol's whole seconds (fractions round up)."""
    if not _is_real(value) or not math.isfinite(value):
        raise error(f"{name} must be a number of seconds, got {value!r}")
    seconds = math.ceil(value)
    if value < 0 or seconds < minimum or seconds > wire.MAX_NUMBER:  # (-0.5 rounds up to 0)
        raise error(
            f"{name} must be between {minimum} and {wire.MAX_NUMBER} seconds, got {value!r}"
        )
    return seconds


def positive_seconds(
    name: str, value: float, *, error: type[InvalidValueError] = InvalidValueError
) -> float:
    """``value`` as a positive number of seconds, at most the protocol's largest (a socket's
    timeout holds no more than about 9.2e9 s)."""
    if not _is_real(value) or not 0 < value <= wire.MAX_NUMBER:  # (NaN is no number here)
        raise error(
            f"{name} must be a positive number of seconds up to {wire.MAX_NUMBER}, got {value!r}"
        )
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
    value: object,
    name: str = "limit",
    *,
    error: type[InvalidValueError] = InvalidValueError,
    semaphore: bool = False,
) -> int | None:
    """A semaphore's number of slots (None: a plain lock, unless ``semaphore``)."""
    if value is None and not semaphore:
        return None
    low, high = wire.MIN_SEMAPHORE_LIMIT, wire.MAX_SEMAPHORE_LIMIT
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        plain = "" if semaphore else "None (a plain lock) or "
        raise error(
            f"{name} must be {plain}an integer from {low} to {high} (a semaphore); got {value!r}"
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
    if "\n" in value or "\r" in value or value != value.strip():  # what the protocol can carry
        raise error(
            f"{name} must not contain line breaks or leading/trailing whitespace "
            "(check how the secret was read, e.g. a trailing newline from a file)"
        )
    if len(value.encode("utf-8")) > wire.MAX_AUTH_LINE_BYTES:
        raise error(f"{name} is longer than the protocol's {wire.MAX_AUTH_LINE_BYTES} bytes")
    return value


def check_ssl_context(value: object) -> ssl.SSLContext | None:
    """TLS for every connection (None: plain TCP)."""
    if value is not None and not isinstance(value, ssl.SSLContext):
        raise InvalidValueError(f"ssl_context must be an ssl.SSLContext, got {value!r}")
    return value


def check_servers(
    value: object, name: str = "servers", *, error: type[InvalidValueError] = InvalidValueError
) -> tuple[tuple[str, int], ...]:
    """The server list, as a tuple (checked where it is given, then passed down as it is). A
    server listed twice is refused, not merged: a key goes to the server at its index, so a
    merged list would shard keys unlike a process that lists each server once."""
    try:
        servers = validate_servers(cast("Sequence[tuple[str, int]]", value))
    except ValueError as exc:
        raise error(str(exc) if name == "servers" else f"{name}: {exc}") from None
    seen: set[tuple[str, int]] = set()
    for host, port in servers:
        if (host.lower(), port) in seen:
            raise error(
                f"{name}: server {host.lower()}:{port} is listed twice; list each server once "
                "(a key goes to the server at its index in the list)"
            )
        seen.add((host.lower(), port))
    return servers


class Lease(int):
    """A lease in whole seconds that `lease_seconds` checked, with the ``name`` it was given
    under, so a refusal of it names where it was set."""

    name: str

    def __new__(cls, seconds: int, name: str) -> Lease:
        lease = super().__new__(cls, seconds)
        lease.name = name
        return lease

    def __reduce__(self) -> tuple[type[Lease], tuple[int, str]]:
        return Lease, (int(self), self.name)


def lease_name(lease: int) -> str:
    """Where ``lease`` was set, in the user's terms: a `Lease` says it, else ``lease_ttl_s``."""
    return lease.name if isinstance(lease, Lease) else "lease_ttl_s"


def lease_seconds(
    name: str, value: object, *, error: type[InvalidValueError] = InvalidValueError
) -> Lease:
    """A lease: a whole number of seconds from 1 (a fraction is refused, not rounded)."""
    if type(value) is Lease:
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise error(f"{name} must be a whole number of seconds (an int), got {value!r}")
    if not 1 <= value <= wire.MAX_NUMBER:
        raise error(f"{name} must be between 1 and {wire.MAX_NUMBER} seconds, got {value!r}")
    return Lease(value, name)


def check_sharding_strategy(value: object) -> Routing:
    """A callable ``(key, number_of_servers) -> index``, or ``"cluster"``."""
    if value == CLUSTER or (callable(value) and not isinstance(value, str)):
        return cast("Routing", value)
    raise InvalidValueError(
        "sharding_strategy must be a callable (key, number_of_servers) -> index or "
        f"{CLUSTER!r}, got {value!r}"
    )


@dataclass(frozen=True, slots=True)
class ClientSettings:
    """What every lock of one client shares, each value checked once."""

    servers: tuple[tuple[str, int], ...] = DEFAULT_SERVERS
    sharding_strategy: Routing = stable_hash_shard
    renew_ratio: float = DEFAULT_RENEW_RATIO
    auth_token: str | None = field(default=None, repr=False)
    ssl_context: ssl.SSLContext | None = None
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    acquire_timeout_s: int = DEFAULT_ACQUIRE_TIMEOUT_S  # a lock's default
    lease_ttl_s: int | None = None  # a lock's default (None: the server's)
    session_ttl_s: int = DEFAULT_SESSION_TTL_S
    # Made once: the locks on a server share one, which the pool finds by identity.
    _endpoints: tuple[Endpoint, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        endpoints = tuple(self.endpoint(host, port) for host, port in self.servers)
        object.__setattr__(self, "_endpoints", endpoints)

    @classmethod
    def checked(  # noqa: PLR0917 - the locks pass them in this order
        cls,
        servers: Sequence[tuple[str, int]] = DEFAULT_SERVERS,
        sharding_strategy: Routing = stable_hash_shard,
        renew_ratio: float = DEFAULT_RENEW_RATIO,
        auth_token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        acquire_timeout_s: float = DEFAULT_ACQUIRE_TIMEOUT_S,
        lease_ttl_s: int | None = None,
        session_ttl_s: float = DEFAULT_SESSION_TTL_S,
    ) -> ClientSettings:
        return cls(
            servers=check_servers(servers),
            sharding_strategy=check_sharding_strategy(sharding_strategy),
            renew_ratio=check_renew_ratio(renew_ratio),
            auth_token=check_auth_token(auth_token),
            ssl_context=check_ssl_context(ssl_context),
            connect_timeout_s=positive_seconds("connect_timeout_s", connect_timeout_s),
            acquire_timeout_s=whole_seconds("acquire_timeout_s", acquire_timeout_s, minimum=0),
            lease_ttl_s=None if lease_ttl_s is None else lease_seconds("lease_ttl_s", lease_ttl_s),
            session_ttl_s=whole_seconds("session_ttl_s", session_ttl_s, minimum=MIN_SESSION_TTL_S),
        )

    def endpoint(self, host: str, port: int) -> Endpoint:
        return Endpoint(
            host,
            port,
            self.auth_token,
            self.ssl_context,
            self.connect_timeout_s,
            self.session_ttl_s,
        )

    def endpoints(self) -> list[Endpoint]:
        return list(self._endpoints)

    def server_endpoint(self, index: int) -> Endpoint:
        return self._endpoints[index]
