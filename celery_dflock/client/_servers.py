"""What a client knows of a server: its ``hello`` answer (`ServerInfo`), the features it may
list and the longest lease it grants, a detached `Hold` it granted, and the auth errors it may
answer (no I/O here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from celery_dflock.client import _replies, errors, wire
from celery_dflock.client._settings import MIN_SESSION_TTL_S, Endpoint, lease_name

CLOSING_ERRORS: Final = frozenset({wire.STATUS_ERROR_AUTH, wire.STATUS_ERROR_DRAINING})
"""Error replies after which the connection must not be reused."""


@dataclass(frozen=True, slots=True)
class Hold:
    """A detached hold (`Client.hold`): the lock ``key`` held by ``token`` on ``server``
    (``"host:port"``), freed only by a release of the token or when the lease runs out."""

    key: str
    token: str = field(repr=False)  # a bearer credential: never in a repr
    fence: int | None
    lease_ttl: int
    server: str


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """What a server said to ``hello``; one that answers ``error`` is `legacy`."""

    name: str | None = None
    version: str | None = None
    features: frozenset[str] = frozenset()
    max_lease_ttl_s: int | None = None  # None: not said
    default_lease_ttl_s: int | None = None
    # How long a session connection's grants outlive its close (the server lists ``session``).
    session_ttl_s: int | None = None
    run: str | None = None  # this start of the server
    grace_until: float = 0.0  # when its restart grace ends, on this process's monotonic clock

    @property
    def keeps_sessions(self) -> bool:
        """True when it keeps client sessions (lists ``keepalive``) that a keep-alive can keep:
        it cuts a session to its longest lease, and one below ``MIN_SESSION_TTL_S`` is over
        before the next keep-alive (then its locks renew by themselves, as without sessions)."""
        limit = self.max_lease_ttl_s
        if limit is not None and limit < MIN_SESSION_TTL_S:
            return False
        return wire.FEATURE_KEEPALIVE in self.features

    def session_ttl(self, asked: int) -> int:
        """The time of a session asked for ``asked`` seconds (at most ``max_lease_ttl_s``)."""
        limit = self.max_lease_ttl_s
        return asked if limit is None else min(asked, limit)

    @property
    def legacy(self) -> bool:
        return self.name is None

    @property
    def fences(self) -> bool:
        return wire.FEATURE_FENCE in self.features

    def supports(self, feature: str) -> bool:
        return feature in self.features

    def describe(self) -> str:
        if self.name is None:
            return "a dflockd server that does not answer hello (no ping, stats or fences)"
        return f"{self.name} {self.version or '?'}"


def check_lease(server: ServerInfo | None, where: str, what: str, lease: int | None) -> None:
    """Refuse a lease above the longest ``server`` grants (when its ``hello`` says it): the
    server answers such a request ``error``, as it does a token that no longer holds its key."""
    limit = None if server is None else server.max_lease_ttl_s
    if lease is None or limit is None or lease <= limit:
        return
    raise errors.InvalidValueError(
        f"{what}: the lease asked for ({lease} s) is above the longest lease server {where} "
        f"grants ({limit} s, its --max-lease-ttl / DFLOCKD_MAX_LEASE_TTL_S). Ask for a shorter "
        f"lease ({lease_name(lease)}): renewal keeps a lock held however long the work runs. "
        "Or start the server with a larger --max-lease-ttl"
    )


def require_holds(server: ServerInfo | None, where: str, what: str) -> ServerInfo:
    """``server``, when it listed ``holds``; else `HoldsUnsupported`."""
    if server is None or not server.supports(wire.FEATURE_HOLDS):
        told = "a server that was not asked hello" if server is None else server.describe()
        raise errors.HoldsUnsupported(
            f"server {where} is {told}, and a hold or owner note (of {what}) needs "
            "celery-dflock's dflockd-server (the 'holds' feature), which that server does not "
            "list in its hello; run the bundled `dflockd` there"
        )
    return server


def require_force_release(server: ServerInfo | None, where: str) -> None:
    if server is None or not server.supports(wire.FEATURE_FORCE_RELEASE):
        told = "a server that was not asked hello" if server is None else server.describe()
        raise errors.ForceReleaseUnsupported(
            f"server {where} is {told}, which does not list 'force_release' in its hello: it "
            "predates force release (or is a foreign dflockd); upgrade it to a dflockd-server "
            "that has it, or wait for the holder to release or its lease to run out"
        )


LEGACY_SERVER: Final = ServerInfo()


def _seconds(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def server_info(endpoint: Endpoint, reply: _replies.Reply, sent_at: float = 0.0) -> ServerInfo:
    """Interpret the reply to ``hello`` sent at ``sent_at`` (raises for ``error_auth`` /
    ``error_draining``)."""
    if isinstance(reply, _replies.JsonReply):
        data = reply.data
        grace = data.get("grace_remaining_s")
        name, version, features = data.get("server"), data.get("version"), data.get("features")
        listed: list[object] = list(features) if isinstance(features, list) else []  # pyright: ignore[reportUnknownArgumentType]
        session_ttl = _seconds(data.get("session_ttl_s"))
        return ServerInfo(
            name=str(name) if name is not None else "unnamed",
            version=None if version is None else str(version),
            features=frozenset(str(f) for f in listed),
            max_lease_ttl_s=_seconds(data.get("max_lease_ttl_s")),
            default_lease_ttl_s=_seconds(data.get("default_lease_ttl_s")),
            session_ttl_s=session_ttl if wire.FEATURE_SESSION in listed else None,
            run=str(data["run"]) if isinstance(data.get("run"), str) else None,
            grace_until=sent_at + grace if isinstance(grace, int | float) and sent_at else 0.0,
        )
    if isinstance(reply, _replies.ErrorReply):
        if reply.code == wire.STATUS_ERROR_AUTH:
            raise auth_required_error(endpoint)
        if reply.code == wire.STATUS_ERROR_DRAINING:
            raise errors.ServerDraining(
                f"server {endpoint.address} is shutting down; retry once it (or its "
                "replacement) is running"
            )
        return LEGACY_SERVER
    raise errors.ProtocolError(
        f"unexpected reply {reply!r} to 'hello' from {endpoint.address}; is the server a "
        "dflockd-compatible lock server on the right port?"
    )


def auth_required_error(endpoint: Endpoint) -> errors.AuthError:
    """The error for ``error_auth`` on a request other than ``auth``."""
    if endpoint.auth_token is None:
        return errors.AuthError(
            f"server {endpoint.address} requires authentication: give the secret it was "
            "started with (--auth-token / DFLOCKD_AUTH_TOKEN) as auth_token= (in Celery the "
            "`dflock_auth_token` setting)"
        )
    return errors.AuthError(
        f"server {endpoint.address} refused this connection's authentication; check "
        "auth_token against the server's --auth-token / DFLOCKD_AUTH_TOKEN"
    )


def auth_reply_error(endpoint: Endpoint, reply: _replies.Reply) -> errors.AuthError | None:
    """None when ``auth`` succeeded, else the error to raise."""
    if isinstance(reply, _replies.Ok):
        return None
    if isinstance(reply, _replies.ErrorReply) and reply.code == wire.STATUS_ERROR:
        return errors.AuthError(
            f"server {endpoint.address} has no auth token configured but one was given: "
            "remove auth_token= (in Celery `dflock_auth_token`) or start the server with "
            "--auth-token"
        )
    return errors.AuthError(
        f"server {endpoint.address} rejected the auth token (auth_token=, in Celery "
        "`dflock_auth_token`): it does not match the server's --auth-token / DFLOCKD_AUTH_TOKEN"
    )
