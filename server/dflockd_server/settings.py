"""The settings table: for each ``Config`` field, its CLI flag, environment variables (the
first is the one documented), parser, check and help text. The CLI builds its parser from it,
``Config`` checks its values with it, and ``docs/gen_reference.py`` generates the flags
reference from it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from dflockd_server import values as v

__all__ = [
    "BY_FIELD",
    "ETCD_ACCESS",
    "SETTINGS",
    "TOPICS",
    "Setting",
    "check_host",
    "names",
]


@dataclass(frozen=True, slots=True)
class Setting:
    """One row of the settings table: Config field, parser, check, help. Its flag is the field
    less a ``_s`` suffix (``--max-lease-ttl``), its environment variable ``DFLOCKD_`` and the
    field (``DFLOCKD_MAX_LEASE_TTL_S``) unless ``env`` names others."""

    field: str
    parse: Callable[[str], Any]
    check: Callable[[Any], str | None]
    help: str
    metavar: str = "N"
    none_text: str = "none"  # how --help shows a default of None
    env: tuple[str, ...] = ()  # the environment variables, the documented one first
    common: bool = False  # shown by dflockd --help (--help-all: every setting)

    def __post_init__(self) -> None:
        if not self.env:
            object.__setattr__(self, "env", (f"DFLOCKD_{self.field.upper()}",))

    @property
    def flag(self) -> str:
        return "--" + self.field.removesuffix("_s").replace("_", "-")

    def take(self, raw: str, source: str) -> Any:
        """``raw`` parsed and checked; a ``ValueError`` naming ``source`` when refused."""
        try:
            value = self.parse(raw)
        except ValueError as exc:
            raise ValueError(f"{source}={raw!r}: {exc}") from None
        problem = self.check(value)
        if problem is not None:
            raise ValueError(f"{source}={raw!r}: {problem}")
        return value

    def in_environment(self, environ: Mapping[str, str]) -> tuple[str, str] | None:
        """The first of its variables set in ``environ`` (an empty one counts as unset) and
        its raw value, or None; a ``ValueError`` naming them when a variable and its alias are
        both set to different values."""
        found = [(name, environ[name]) for name in self.env if environ.get(name)]
        if len({raw.strip() for _, raw in found}) > 1:
            given = " and ".join(f"{name}={raw!r}" for name, raw in found)
            raise ValueError(f"{given} are one setting ({self.flag}) given twice: set one of them")
        return found[0] if found else None


def check_host(host: str) -> str | None:
    """Why ``host`` is no name or address the socket layer can look up (it encodes a name with
    the ``idna`` codec, whose error was a traceback at the bind: ``a..b``, a label over 63
    characters), or None."""
    try:
        host.encode("idna")
    except UnicodeError as exc:  # its reason is the last of the nested ones
        reason = str(exc).rpartition("UnicodeError: ")[2].rstrip(")")
        return f"not a host name or address ({reason}: each part between dots holds 1 to 63)"
    return None


def _looked_up(
    check: Callable[[Any], str | None], hosts: Callable[[Any], list[str]]
) -> Callable[[Any], str | None]:
    """``check``, then ``check_host`` of each of ``hosts(value)`` (an etcd endpoint's or a
    member's: a lookup of it raised the ``idna`` codec's ``UnicodeError``, a traceback)."""

    def check_and_hosts(value: Any) -> str | None:
        if (problem := check(value)) is not None:
            return problem
        for host in hosts(value):
            if (problem := check_host(host)) is not None:
                return f"{host!r} is {problem}"
        return None

    return check_and_hosts


def _member_host(member: str) -> str:
    return member.rpartition(":")[0].strip("[]")


# (parse, check) pairs that several settings share
_TEXT = (v.parse_str, v.check_nothing)
_HOST = (v.parse_str, check_host)
_FILE = (v.parse_str, v.check_readable_file)
_COUNT = (v.parse_int, v.check_non_negative)  # a cap or a count (0: no cap, or none)
_POSITIVE_INT = (v.parse_int, v.check_positive)
_LEASE = (v.parse_int, v.check_lease)
_PORT = (v.parse_int, v.check_port)
_SECONDS = (v.parse_float, v.check_seconds)
_SECONDS_OR_0 = (v.parse_float, v.check_seconds_or_0)


SETTINGS: tuple[Setting, ...] = (
    Setting("host", *_HOST, "bind address", "ADDR", common=True),
    Setting("port", *_PORT, "bind port (0: any free)", common=True),
    Setting("default_lease_ttl_s", *_LEASE, "lease in seconds when a request gives none"),
    Setting("max_lease_ttl_s", *_LEASE,
        "longest lease a request may ask for (l, e, n and their semaphore forms); a longer one "
        "gets `error`. It bounds the restart grace", common=True),
    Setting("restart_grace_s", v.parse_grace, v.check_auto,
        "after a start, grant no key for this long, so leases granted by the previous server end "
        "first (auto: none where the state dir's journal tells what the previous run granted; else "
        "the longest lease it recorded, or max_lease_ttl when none is known; none on port 0 "
        "without a state dir; 0: off)", none_text="auto"),
    Setting("lease_sweep_interval_s", *_SECONDS, "seconds between sweeps for expired leases"),
    Setting("gc_interval_s", *_SECONDS,
        "seconds between prunes of idle key state",
        env=("DFLOCKD_GC_LOOP_SLEEP", "DFLOCKD_GC_INTERVAL_S")),
    Setting("gc_max_idle_s", *_SECONDS_OR_0,
        "seconds a key stays idle (no holder, no waiter) before it is pruned",
        env=("DFLOCKD_GC_MAX_UNUSED_TIME", "DFLOCKD_GC_MAX_IDLE_S")),
    Setting("max_locks", *_POSITIVE_INT,
        "most distinct keys (locks and semaphores); existing keys are never refused", common=True),
    Setting("read_timeout_s", *_SECONDS_OR_0,
        "close a connection silent this long with no request in flight (0: never)"),
    Setting("auto_release_on_disconnect", v.parse_bool, v.check_nothing,
        "end a connection's grants when its peer closes it: at once, or --session-ttl later for a "
        "session connection (1/yes/true, 0/no/false: they run to their lease's end)"),
    Setting("session_ttl_s", *_COUNT,
        "seconds a session connection's grants outlive its close by the peer (0: no sessions: "
        "every connection is a plain one, whose reset by the network frees its grants before their "
        "holder can know)"),
    Setting("max_connections", *_COUNT,
        "most open connections; more are accepted and closed at once (0: no cap)"),
    Setting("max_connections_per_ip", *_COUNT,
        "most open connections from one client address (0: no cap)"),
    Setting("max_waiters", *_COUNT, "most waiters queued per key (0: no cap)"),
    Setting("max_locks_per_connection", *_COUNT,
        "most locks and semaphore slots one connection holds at once, its queued acquires counted "
        "as held; past it an acquire gets `error_max_locks`. It keeps one connection from taking "
        "every key (0: no cap)"),
    Setting("max_locks_per_ip", v.parse_auto_int, v.check_auto,
        "most locks and semaphore slots the connections from one client address hold at once "
        "together, their queued acquires counted as held; past it an acquire gets "
        "`error_max_locks`. It keeps one address from taking every key (auto: 3/4 of --max-locks, "
        "so a quarter stays for other addresses, but never below --max-locks-per-connection; 0: no "
        "cap). Detached holds (queue-once's) belong to no connection and are not counted",
        none_text="auto"),
    Setting("max_waits_per_connection", *_COUNT,
        "most queued acquires plus pending two-phase enqueues (e, se) of one connection; past it "
        "`error_max_waiters`. It keeps one connection from queueing on every key (0: no cap)"),
    Setting("write_timeout_s", *_SECONDS, "drop a connection whose replies stay unread this long"),
    Setting("shutdown_timeout_s", *_SECONDS_OR_0,
        "on SIGTERM/SIGINT, seconds holders may take to release before connections close"),
    Setting("auth_token", *_TEXT, "shared secret clients must send with `auth` first", "SECRET"),
    Setting("auth_token_file", *_TEXT, "file holding the shared secret", "PATH", common=True),
    Setting("tls_cert", *_TEXT, "PEM certificate (chain): serve TLS", "PATH", common=True),
    Setting("tls_key", *_TEXT, "PEM private key for --tls-cert", "PATH", common=True),
    Setting("tls_handshake_timeout_s", *_SECONDS,
        "drop a TLS connection whose handshake is not done this long after it was accepted"),
    Setting("max_tls_handshakes", *_COUNT,
        "most TLS handshakes under way at once; past it the oldest is dropped, so connections that "
        "never finish theirs bound the server's memory and cannot lock out new clients (0: no cap)",
        ),
    Setting("tls_reload_interval_s", *_SECONDS,
        "seconds between looks at --tls-cert and --tls-key: once they change (cert-manager renews "
        "them), new connections get the new certificate; open ones keep theirs"),
    Setting("fence_state_file", *_TEXT,
        "file persisting the fencing-counter ceiling across restarts (deprecated: it lives in "
        "--state-dir by default; this overrides where)", "PATH"),
    Setting("state_dir", *_TEXT,
        "directory for the lease journal and the fence ceiling, so a restart loses no lock; "
        "default `$XDG_STATE_HOME/dflockd/HOST-PORT` (`~/.local/state/...`), none on port 0; "
        "`none` keeps no state (a restart on a fixed port then grants nothing for --max-lease-ttl)",
        "DIR", "by address", common=True),
    Setting("journal_fsync", v.parse_fsync, v.check_fsync,
        "when the lease journal (in --state-dir) reaches the disk: `always` (before each reply "
        "that grants), `everysec` (once a second: a crash of the machine may lose the last "
        "second's grants; a crash of the server loses nothing) or `no` (when the OS decides)",
        "MODE"),
    Setting("log_level", v.parse_log_level, v.check_log_level,
        "debug, info, warning, error or critical", "LEVEL", common=True),
    Setting("event_loop", v.parse_event_loop, v.check_event_loop,
        "auto (uvloop when it is installed, as dflockd-server installs it but on Windows; else "
        "asyncio's), asyncio or uvloop", "LOOP"),
    Setting("metrics_port", *_PORT,
        "serve Prometheus metrics (/metrics) and the status page (/status) over HTTP on this port "
        "(0: any free; needs the `metrics` extra: pip install 'dflockd-server[metrics]')",
        common=True),
    Setting("metrics_host", *_HOST,
        "bind address of the metrics endpoint (default: --host)", "ADDR"),
    Setting("members", v.parse_members,
        _looked_up(v.check_members, lambda members: [_member_host(m) for m in members]),
        "static members: every lock server of the fleet as HOST:PORT,HOST:PORT,... in the order "
        "the clients list them (dflock_servers); this server then serves only the keys the "
        "clients' crc32 sharding gives to --advertise and answers `error_moved <owner>` for the "
        "others, so a client with another list gets a clear error", "LIST", common=True),
    Setting("advertise", v.parse_member,
        _looked_up(v.check_member, lambda member: [_member_host(member)]),
        "this server's HOST:PORT as clients and the other members name it (one of --members; "
        "needed with --members or --cluster)", "HOST:PORT", common=True),
    Setting("cluster", v.parse_cluster,
        _looked_up(v.check_cluster,
            lambda url: [host for host, _ in v.split_cluster_url(url).endpoints]),
        "cluster mode: `etcd://HOST:PORT[,HOST:PORT...][/PREFIX]` (default prefix /dflockd), "
        "`etcds://...` to reach etcd over TLS: the etcd cluster holding the fixed shard map and "
        "the live members. List every etcd endpoint: a request that one does not answer within a "
        "fifth of --cluster-lease-ttl (at least 0.5 s) goes to the next. Needs --advertise, "
        "excludes --members", "URL", common=True),
    Setting("cluster_lease_ttl_s", *_LEASE,
        "cluster mode: seconds of the member's etcd lease; a member that cannot renew it grants "
        "and renews nothing (its holders see their locks lost), and a dead member's keys pass to "
        "another after this plus --max-lease-ttl"),
    Setting("cluster_ca_file", *_FILE,
        "cluster mode over TLS (etcds://): PEM file of the CAs that sign etcd's certificates "
        "(default: the system's)", "PATH"),
    Setting("cluster_cert", *_FILE,
        "cluster mode over TLS (etcds://): PEM client certificate for etcd (--client-cert-auth), "
        "with --cluster-key", "PATH"),
    Setting("cluster_key", *_FILE,
        "cluster mode over TLS (etcds://): PEM private key of --cluster-cert", "PATH"),
    Setting("cluster_user", *_TEXT,
        "cluster mode: etcd user (etcd's authentication), with --cluster-password-file or "
        "--cluster-password", "USER"),
    Setting("cluster_password", *_TEXT,
        "cluster mode: the etcd user's password (prefer --cluster-password-file)", "SECRET"),
    Setting("cluster_password_file", *_FILE,
        "cluster mode: file holding the etcd user's password", "PATH"),
)  # fmt: skip

BY_FIELD: Mapping[str, Setting] = MappingProxyType({setting.field: setting for setting in SETTINGS})
"""Each setting by its ``Config`` field."""


def names(field: str) -> str:
    """``--flag / ENV``: how an error names the setting of a ``Config`` field."""
    return f"{BY_FIELD[field].flag} / {BY_FIELD[field].env[0]}"


ETCD_ACCESS = ("cluster_ca_file", "cluster_cert", "cluster_key", "cluster_user",
               "cluster_password_file", "cluster_password")  # fmt: skip
"""The settings of the access to the cluster's etcd (TLS files, user), which the operator's
commands (``cluster.ops``) take too."""


TOPICS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("where it listens", ("host", "port")),
    ("state and restarts", ("state_dir", "journal_fsync", "fence_state_file", "restart_grace_s")),
    ("leases", ("default_lease_ttl_s", "max_lease_ttl_s", "lease_sweep_interval_s")),
    ("keys, waiters and idle keys", ("max_locks", "max_waiters", "max_locks_per_connection",
        "max_locks_per_ip", "max_waits_per_connection", "gc_interval_s", "gc_max_idle_s")),
    ("connections", ("max_connections", "max_connections_per_ip", "read_timeout_s",
        "write_timeout_s", "auto_release_on_disconnect", "session_ttl_s", "shutdown_timeout_s")),
    ("auth and TLS", ("auth_token_file", "auth_token", "tls_cert", "tls_key",
        "tls_handshake_timeout_s", "max_tls_handshakes", "tls_reload_interval_s")),
    ("logs, metrics and the event loop",
        ("log_level", "metrics_port", "metrics_host", "event_loop")),
    ("several servers: a static list", ("members",)),
    ("several servers: a cluster on etcd",
        ("cluster", "advertise", "cluster_lease_ttl_s", *ETCD_ACCESS)),
)  # fmt: skip
"""``dflockd --help-all``'s sections: each setting's field under one topic, in this order."""
