"""Server settings: the ``Config`` dataclass, checked against ``settings`` when it is made."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from functools import partial
from typing import Any, Final

from dflockd_server import constants as c
from dflockd_server.settings import ETCD_ACCESS, SETTINGS, names
from dflockd_server.values import check_readable_file


class ConfigError(ValueError):
    """A setting has a value the server cannot use."""


_MEMBERS = names("members")
_ADVERTISE = names("advertise")
_CLUSTER = names("cluster")
_SERVER_PAIRS = ((("auth_token", "auth_token_file"),), (("tls_cert", "tls_key"),))
"""``check_pairs``' ``either`` and ``together`` of the server's own settings."""
ETCD_PASSWORDS: Final = (("cluster_password", "cluster_password_file"),)
"""etcd's password, given one way only (the cluster commands check it too)."""
_ETCD_PAIRS = (ETCD_PASSWORDS, (("cluster_cert", "cluster_key"),))
"""etcd access's, checked once ``--cluster`` is given (and ``etcds://`` for the TLS files)."""


def check_pairs(
    value: Callable[[str], object],
    either: tuple[tuple[str, str], ...],
    together: tuple[tuple[str, str], ...] = (),
) -> None:
    """Refuse a pair of ``either`` both given, or of ``together`` one without the other
    (``value``: a setting's value by its field, None when not given)."""
    for one, other in either:
        if value(one) is not None and value(other) is not None:
            raise ConfigError(f"give {names(one)} or {names(other)}, not both")
    for one, other in together:
        if (value(one) is None) != (value(other) is None):
            raise ConfigError(f"{names(one)} and {names(other)} must be given together")


def check_user(user: str | None, *, has_password: bool) -> None:
    """Refuse etcd's user without its password (given either way), or the password alone."""
    if (user is None) == has_password:
        raise ConfigError(
            f"{names('cluster_user')} and {names('cluster_password_file')} (or "
            f"{names('cluster_password')}) go together"
        )


def only_with(field: str, needed: str, *, give: str = "it") -> ConfigError:
    """The error of the setting ``field`` given without ``needed``, where it has no use."""
    return ConfigError(f"{names(field)} is only used with {needed}: give {give} too, or drop it")


def read_secret(path: str, name: str, strip: Callable[[str], str]) -> str:
    """The secret in the file ``path``, ``strip``ped (``ConfigError`` naming the setting
    ``name`` when it cannot be read or is empty)."""
    if (problem := check_readable_file(path)) is not None:
        raise ConfigError(f"cannot read {name} {path!r}: {problem}")
    try:
        with open(path, encoding="utf-8") as fh:
            secret = strip(fh.read())
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read {name} {path!r}: {exc}") from exc
    if not secret:
        raise ConfigError(f"{name} {path!r} is empty")
    return secret


@dataclass(frozen=True, slots=True)
class Config:
    """Every server setting (docs/reference/server-flags.md lists them). Times are in seconds."""

    host: str = c.DEFAULT_HOST
    port: int = c.DEFAULT_PORT
    default_lease_ttl_s: int = c.DEFAULT_LEASE_TTL_S
    max_lease_ttl_s: int = c.DEFAULT_MAX_LEASE_TTL_S
    restart_grace_s: float | None = None
    lease_sweep_interval_s: float = c.DEFAULT_LEASE_SWEEP_INTERVAL_S
    gc_interval_s: float = c.DEFAULT_GC_INTERVAL_S
    gc_max_idle_s: float = c.DEFAULT_GC_MAX_IDLE_S
    max_locks: int = c.DEFAULT_MAX_LOCKS
    read_timeout_s: float = c.DEFAULT_READ_TIMEOUT_S
    auto_release_on_disconnect: bool = c.DEFAULT_AUTO_RELEASE_ON_DISCONNECT
    session_ttl_s: int = c.DEFAULT_SESSION_TTL_S
    max_connections: int = c.DEFAULT_MAX_CONNECTIONS
    max_connections_per_ip: int = c.DEFAULT_MAX_CONNECTIONS_PER_IP
    max_waiters: int = c.DEFAULT_MAX_WAITERS
    max_locks_per_connection: int = c.DEFAULT_MAX_LOCKS_PER_CONNECTION
    max_locks_per_ip: int | None = None  # None: `auto` (`locks_per_ip`)
    max_waits_per_connection: int = c.DEFAULT_MAX_WAITS_PER_CONNECTION
    write_timeout_s: float = c.DEFAULT_WRITE_TIMEOUT_S
    shutdown_timeout_s: float = c.DEFAULT_SHUTDOWN_TIMEOUT_S
    auth_token: str | None = None
    auth_token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_handshake_timeout_s: float = c.DEFAULT_TLS_HANDSHAKE_TIMEOUT_S
    max_tls_handshakes: int = c.DEFAULT_MAX_TLS_HANDSHAKES
    tls_reload_interval_s: float = c.DEFAULT_TLS_RELOAD_INTERVAL_S
    fence_state_file: str | None = None
    state_dir: str | None = None  # None: the address's default (none on port 0); "none": no state
    journal_fsync: str = c.DEFAULT_JOURNAL_FSYNC
    log_level: str = c.DEFAULT_LOG_LEVEL
    event_loop: str = c.DEFAULT_EVENT_LOOP
    metrics_port: int | None = None
    metrics_host: str | None = None
    members: tuple[str, ...] | None = None
    advertise: str | None = None
    cluster: str | None = None
    cluster_lease_ttl_s: int = c.DEFAULT_CLUSTER_LEASE_TTL_S
    cluster_ca_file: str | None = None
    cluster_cert: str | None = None
    cluster_key: str | None = None
    cluster_user: str | None = None
    cluster_password: str | None = None
    cluster_password_file: str | None = None

    def __post_init__(self) -> None:
        for setting in SETTINGS:
            value = getattr(self, setting.field)
            if (problem := None if value is None else setting.check(value)) is not None:
                raise ConfigError(f"{setting.field}={value!r} ({names(setting.field)}): {problem}")
        check_pairs(partial(getattr, self), *_SERVER_PAIRS)
        if self.default_lease_ttl_s > self.max_lease_ttl_s:
            raise ConfigError(
                f"{names('default_lease_ttl_s')}={self.default_lease_ttl_s} exceeds "
                f"{names('max_lease_ttl_s')}={self.max_lease_ttl_s}: lower the first or raise "
                "the second"
            )
        if self.metrics_host is not None and self.metrics_port is None:
            raise only_with(
                "metrics_host",
                f"{names('metrics_port')} (the metrics endpoint is off without it)",
            )
        self._check_membership()

    def _check_membership(self) -> None:
        members, advertise = self.members, self.advertise
        if members is not None and self.cluster is not None:
            raise ConfigError(
                f"{_MEMBERS} and {_CLUSTER} exclude each other: give the static list "
                "(--members) or the etcd cluster (--cluster), not both"
            )
        if members is not None:
            if advertise is None:
                raise ConfigError(
                    f"{_MEMBERS} needs {_ADVERTISE}: say which of the members this server is "
                    f"(e.g. --advertise {members[0]})"
                )
            if advertise not in members:
                raise ConfigError(
                    f"{_ADVERTISE}={advertise} is not one of {_MEMBERS}="
                    f"{','.join(members)}: give this server's HOST:PORT exactly as the list "
                    "names it (the clients' dflock_servers)"
                )
        elif self.cluster is not None:
            if advertise is None:
                raise ConfigError(
                    f"{_CLUSTER} needs {_ADVERTISE}: the HOST:PORT the clients and the other "
                    "members reach this server at"
                )
        elif advertise is not None:
            raise only_with("advertise", f"{_MEMBERS} or {_CLUSTER}", give="one of them")
        self._check_etcd_access()

    def _check_etcd_access(self) -> None:
        given = [f for f in ETCD_ACCESS if getattr(self, f) is not None]
        if self.cluster is None:
            if given:
                raise only_with(given[0], _CLUSTER)
            return
        tls = self.cluster.startswith(f"{c.CLUSTER_TLS_SCHEME}://")
        for name in ("cluster_ca_file", "cluster_cert", "cluster_key"):
            if name in given and not tls:
                raise ConfigError(
                    f"{names(name)} is for TLS to etcd, but {_CLUSTER}={self.cluster} "
                    f"is plain: write it {c.CLUSTER_TLS_SCHEME}://... to reach etcd over TLS"
                )
        check_pairs(partial(getattr, self), *_ETCD_PAIRS)
        passwords = (self.cluster_password, self.cluster_password_file)
        check_user(self.cluster_user, has_password=passwords != (None, None))

    @property
    def locks_per_ip(self) -> int:
        """``max_locks_per_ip`` in force (0: no cap); ``auto``: ``LOCKS_PER_IP_AUTO_SHARE`` of
        ``max_locks``, never below ``max_locks_per_connection``."""
        if self.max_locks_per_ip is not None:
            return self.max_locks_per_ip
        part, whole = c.LOCKS_PER_IP_AUTO_SHARE
        return max(1, self.max_locks * part // whole, self.max_locks_per_connection)

    def resolve_cluster_password(self) -> str | None:
        """The etcd user's password (read from ``cluster_password_file`` if set)."""
        if (path := self.cluster_password_file) is None:
            return self.cluster_password
        return read_secret(path, names("cluster_password_file"), lambda text: text.rstrip("\r\n"))

    def resolve_auth_token(self) -> str | None:
        """The shared secret (read from ``auth_token_file`` if set); ``ConfigError`` when no
        client can send it (the ``auth`` argument is one line of at most 64 KiB)."""
        if self.auth_token_file is None:
            secret, name = self.auth_token, names("auth_token")
        else:
            name = f"{names('auth_token_file')} {self.auth_token_file!r}"
            secret = read_secret(self.auth_token_file, names("auth_token_file"), str.strip)
        if secret is None:
            return None
        try:
            size = len(secret.encode())
        except UnicodeEncodeError:  # a flag's or a variable's bytes that were no UTF-8
            raise ConfigError(
                f"{name}: the secret is not UTF-8 text (bytes that are no character, passed "
                "on as they were given), which no client can send: give it in UTF-8"
            ) from None
        if "\n" in secret or "\r" in secret:
            raise ConfigError(
                f"{name}: the secret holds a line break, which no client can send (a file of "
                "several lines, as openssl rand -base64 writes one): give it on one line "
                "(openssl rand -hex 32)"
            )
        if size > c.MAX_AUTH_LINE_BYTES:
            raise ConfigError(
                f"{name}: the secret is longer than the {c.MAX_AUTH_LINE_BYTES} bytes a client "
                "can send"
            )
        return secret

    def effective_settings(self) -> dict[str, Any]:
        """All settings, secrets masked, for the start-up log line."""
        out: dict[str, Any] = {f.name: getattr(self, f.name) for f in fields(self)}
        for secret in ("auth_token", "cluster_password"):
            if out[secret] is not None:
                out[secret] = "***"
        return out
