"""Server settings: the ``Config`` dataclass and the table of flags and environment variables."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

from dflockd_server import constants as c

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
EVENT_LOOPS = ("auto", "asyncio", "uvloop")


class ConfigError(ValueError):
    """A setting has a value the server cannot use."""


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
    max_connections: int = c.DEFAULT_MAX_CONNECTIONS
    max_connections_per_ip: int = c.DEFAULT_MAX_CONNECTIONS_PER_IP
    max_waiters: int = c.DEFAULT_MAX_WAITERS
    max_locks_per_connection: int = c.DEFAULT_MAX_LOCKS_PER_CONNECTION
    max_waits_per_connection: int = c.DEFAULT_MAX_WAITS_PER_CONNECTION
    write_timeout_s: float = c.DEFAULT_WRITE_TIMEOUT_S
    shutdown_timeout_s: float = c.DEFAULT_SHUTDOWN_TIMEOUT_S
    auth_token: str | None = None
    auth_token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_handshake_timeout_s: float = c.DEFAULT_TLS_HANDSHAKE_TIMEOUT_S
    max_tls_handshakes: int = c.DEFAULT_MAX_TLS_HANDSHAKES
    fence_state_file: str | None = None
    log_level: str = c.DEFAULT_LOG_LEVEL
    event_loop: str = c.DEFAULT_EVENT_LOOP
    metrics_port: int | None = None
    metrics_host: str | None = None

    def __post_init__(self) -> None:
        for setting in SETTINGS:
            value = getattr(self, setting.field)
            if value is None:
                continue
            problem = setting.check(value)
            if problem is not None:
                raise ConfigError(f"{setting.field}={value!r}: {problem}")
        if self.default_lease_ttl_s > self.max_lease_ttl_s:
            raise ConfigError(
                f"default_lease_ttl_s={self.default_lease_ttl_s} exceeds max_lease_ttl_s="
                f"{self.max_lease_ttl_s}: lower --default-lease-ttl or raise --max-lease-ttl"
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_cert and tls_key must be given together")
        if self.auth_token is not None and self.auth_token_file is not None:
            raise ConfigError("give auth_token or auth_token_file, not both")

    def resolve_auth_token(self) -> str | None:
        """The shared secret, read from ``auth_token_file`` when that is set."""
        if self.auth_token_file is None:
            return self.auth_token
        try:
            with open(self.auth_token_file, encoding="utf-8") as fh:
                token = fh.read().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(
                f"cannot read auth_token_file {self.auth_token_file!r}: {exc}"
            ) from exc
        if not token:
            raise ConfigError(f"auth_token_file {self.auth_token_file!r} is empty")
        return token

    def effective_settings(self) -> dict[str, Any]:
        """All settings as a dict with secrets masked, for the start-up log line."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "auth_token" and value is not None:
                value = "***"
            out[f.name] = value
        return out


# ------------------------------------------------------------------ value parsers
# Each parser turns a raw string (flag or env var) into a value or raises ValueError with a
# short reason; each checker returns None or a reason a typed value is unusable.


def parse_int(raw: str) -> int:
    text = raw.strip()
    if not text or not text.lstrip("-").isdigit() or not text.isascii():
        raise ValueError("not an integer")
    return int(text)


def parse_float(raw: str) -> float:
    try:
        value = float(raw.strip())
    except ValueError:
        raise ValueError("not a number") from None
    if not math.isfinite(value):
        raise ValueError("not a finite number")
    return value


TRUE_WORDS = frozenset({"1", "yes", "true", "on"})
FALSE_WORDS = frozenset({"0", "no", "false", "off"})


def parse_bool(raw: str) -> bool:
    text = raw.strip().lower()
    if text in TRUE_WORDS:
        return True
    if text in FALSE_WORDS:
        return False
    raise ValueError("expected 1/yes/true or 0/no/false")


def parse_str(raw: str) -> str:
    text = raw.strip()
    if not text:
        raise ValueError("empty")
    return text


def parse_grace(raw: str) -> float | None:
    """``auto`` (``None``: derived at start-up) or a number of seconds."""
    if raw.strip().lower() == "auto":
        return None
    return parse_float(raw)


def parse_log_level(raw: str) -> str:
    text = raw.strip().lower()
    if text not in LOG_LEVELS:
        raise ValueError(f"expected one of {', '.join(LOG_LEVELS)}")
    return text


def parse_event_loop(raw: str) -> str:
    text = raw.strip().lower()
    if text not in EVENT_LOOPS:
        raise ValueError(f"expected one of {', '.join(EVENT_LOOPS)}")
    return text


def _event_loop(value: str) -> str | None:
    return None if value in EVENT_LOOPS else f"expected one of {', '.join(EVENT_LOOPS)}"


def _positive(value: float) -> str | None:
    return None if value > 0 else "must be > 0"


def _non_negative(value: float) -> str | None:
    return None if value >= 0 else "must be >= 0"


def _port(value: int) -> str | None:
    return None if 0 <= value <= 65535 else "must be 0..65535"


def _lease(value: int) -> str | None:
    if not 0 < value <= c.MAX_NUMBER:
        return f"must be 1..{c.MAX_NUMBER}"
    return None


def _any(_value: object) -> str | None:
    return None


def _log_level(value: str) -> str | None:
    return None if value in LOG_LEVELS else f"expected one of {', '.join(LOG_LEVELS)}"


@dataclass(frozen=True, slots=True)
class Setting:
    """One row of the settings table: Config field, CLI flag, env vars, parser, help."""

    field: str
    flag: str
    env: tuple[str, ...]
    parse: Callable[[str], Any]
    check: Callable[[Any], str | None]
    help: str
    metavar: str = "N"
    none_text: str = "none"
    """How ``--help`` shows a default of ``None``."""


SETTINGS: tuple[Setting, ...] = (
    Setting("host", "--host", ("DFLOCKD_HOST",), parse_str, _any, "bind address", "ADDR"),
    Setting("port", "--port", ("DFLOCKD_PORT",), parse_int, _port, "bind port (0: any free)"),
    Setting(
        "default_lease_ttl_s",
        "--default-lease-ttl",
        ("DFLOCKD_DEFAULT_LEASE_TTL_S",),
        parse_int,
        _lease,
        "lease in seconds when a request gives none",
    ),
    Setting(
        "max_lease_ttl_s",
        "--max-lease-ttl",
        ("DFLOCKD_MAX_LEASE_TTL_S",),
        parse_int,
        _lease,
        "longest lease a request may ask for (l, e, n and their semaphore forms); a longer "
        "one gets `error`. It bounds the restart grace",
    ),
    Setting(
        "restart_grace_s",
        "--restart-grace",
        ("DFLOCKD_RESTART_GRACE_S",),
        parse_grace,
        _non_negative,
        "after a start, grant no key for this long, so leases granted by the previous server "
        "end first (auto: the longest lease the previous run granted, recorded beside "
        "--fence-state-file; without one max_lease_ttl, or none on port 0; 0: off)",
        none_text="auto",
    ),
    Setting(
        "lease_sweep_interval_s",
        "--lease-sweep-interval",
        ("DFLOCKD_LEASE_SWEEP_INTERVAL_S",),
        parse_float,
        _positive,
        "seconds between sweeps for expired leases",
    ),
    Setting(
        "gc_interval_s",
        "--gc-interval",
        ("DFLOCKD_GC_LOOP_SLEEP", "DFLOCKD_GC_INTERVAL_S"),
        parse_float,
        _positive,
        "seconds between prunes of idle key state",
    ),
    Setting(
        "gc_max_idle_s",
        "--gc-max-idle",
        ("DFLOCKD_GC_MAX_UNUSED_TIME", "DFLOCKD_GC_MAX_IDLE_S"),
        parse_float,
        _non_negative,
        "seconds a key stays idle (no holder, no waiter) before it is pruned",
    ),
    Setting(
        "max_locks",
        "--max-locks",
        ("DFLOCKD_MAX_LOCKS",),
        parse_int,
        _positive,
        "most distinct keys (locks and semaphores); existing keys are never refused",
    ),
    Setting(
        "read_timeout_s",
        "--read-timeout",
        ("DFLOCKD_READ_TIMEOUT_S",),
        parse_float,
        _non_negative,
        "close a connection silent this long with no request in flight (0: never)",
    ),
    Setting(
        "auto_release_on_disconnect",
        "--auto-release-on-disconnect",
        ("DFLOCKD_AUTO_RELEASE_ON_DISCONNECT",),
        parse_bool,
        _any,
        "release a connection's locks when it closes (1/yes/true, 0/no/false)",
        "BOOL",
    ),
    Setting(
        "max_connections",
        "--max-connections",
        ("DFLOCKD_MAX_CONNECTIONS",),
        parse_int,
        _non_negative,
        "most open connections; more are accepted and closed at once (0: no cap)",
    ),
    Setting(
        "max_connections_per_ip",
        "--max-connections-per-ip",
        ("DFLOCKD_MAX_CONNECTIONS_PER_IP",),
        parse_int,
        _non_negative,
        "most open connections from one client address (0: no cap)",
    ),
    Setting(
        "max_waiters",
        "--max-waiters",
        ("DFLOCKD_MAX_WAITERS",),
        parse_int,
        _non_negative,
        "most waiters queued per key (0: no cap)",
    ),
    Setting(
        "max_locks_per_connection",
        "--max-locks-per-connection",
        ("DFLOCKD_MAX_LOCKS_PER_CONNECTION",),
        parse_int,
        _non_negative,
        "most locks and semaphore slots one connection holds at once, its queued acquires "
        "counted as held; past it an acquire gets `error_max_locks`. It keeps one connection "
        "from taking every key (0: no cap)",
    ),
    Setting(
        "max_waits_per_connection",
        "--max-waits-per-connection",
        ("DFLOCKD_MAX_WAITS_PER_CONNECTION",),
        parse_int,
        _non_negative,
        "most queued acquires plus pending two-phase enqueues (e, se) of one connection; past "
        "it `error_max_waiters`. It keeps one connection from queueing on every key (0: no "
        "cap)",
    ),
    Setting(
        "write_timeout_s",
        "--write-timeout",
        ("DFLOCKD_WRITE_TIMEOUT_S",),
        parse_float,
        _positive,
        "drop a connection whose replies stay unread this long",
    ),
    Setting(
        "shutdown_timeout_s",
        "--shutdown-timeout",
        ("DFLOCKD_SHUTDOWN_TIMEOUT_S",),
        parse_float,
        _non_negative,
        "on SIGTERM/SIGINT, seconds holders may take to release before connections close",
    ),
    Setting(
        "auth_token",
        "--auth-token",
        ("DFLOCKD_AUTH_TOKEN",),
        parse_str,
        _any,
        "shared secret clients must send with `auth` first",
        "SECRET",
    ),
    Setting(
        "auth_token_file",
        "--auth-token-file",
        ("DFLOCKD_AUTH_TOKEN_FILE",),
        parse_str,
        _any,
        "file holding the shared secret",
        "PATH",
    ),
    Setting(
        "tls_cert",
        "--tls-cert",
        ("DFLOCKD_TLS_CERT",),
        parse_str,
        _any,
        "PEM certificate (chain): serve TLS",
        "PATH",
    ),
    Setting(
        "tls_key",
        "--tls-key",
        ("DFLOCKD_TLS_KEY",),
        parse_str,
        _any,
        "PEM private key for --tls-cert",
        "PATH",
    ),
    Setting(
        "tls_handshake_timeout_s",
        "--tls-handshake-timeout",
        ("DFLOCKD_TLS_HANDSHAKE_TIMEOUT_S",),
        parse_float,
        _positive,
        "drop a TLS connection whose handshake is not done this long after it was accepted",
    ),
    Setting(
        "max_tls_handshakes",
        "--max-tls-handshakes",
        ("DFLOCKD_MAX_TLS_HANDSHAKES",),
        parse_int,
        _non_negative,
        "most TLS handshakes under way at once; past it the oldest is dropped, so connections "
        "that never finish theirs bound the server's memory and cannot lock out new clients "
        "(0: no cap)",
    ),
    Setting(
        "fence_state_file",
        "--fence-state-file",
        ("DFLOCKD_FENCE_STATE_FILE",),
        parse_str,
        _any,
        "file persisting the fencing-counter ceiling across restarts",
        "PATH",
    ),
    Setting(
        "log_level",
        "--log-level",
        ("DFLOCKD_LOG_LEVEL",),
        parse_log_level,
        _log_level,
        "debug, info, warning, error or critical",
        "LEVEL",
    ),
    Setting(
        "event_loop",
        "--event-loop",
        ("DFLOCKD_EVENT_LOOP",),
        parse_event_loop,
        _event_loop,
        "auto (uvloop when it is installed, else asyncio's), asyncio or uvloop (the `uvloop` "
        "extra: pip install 'dflockd-server[uvloop]')",
        "LOOP",
    ),
    Setting(
        "metrics_port",
        "--metrics-port",
        ("DFLOCKD_METRICS_PORT",),
        parse_int,
        _port,
        "serve Prometheus metrics over HTTP on this port (0: any free; needs the `metrics` "
        "extra: pip install 'dflockd-server[metrics]')",
    ),
    Setting(
        "metrics_host",
        "--metrics-host",
        ("DFLOCKD_METRICS_HOST",),
        parse_str,
        _any,
        "bind address of the metrics endpoint (default: --host)",
        "ADDR",
    ),
)
