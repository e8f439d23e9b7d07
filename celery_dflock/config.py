# pyright: reportMissingTypeStubs=false
"""The ``dflock_*`` settings, read once per app into a :class:`DflockConfig`, and lock options.

A lock option is resolved the way Celery resolves its own task options, first
match wins:

1. the per-call option (``task.apply_async(..., lock_key="x")``);
2. the task's entry in ``app.conf.dflock_task_locks`` (like ``task_annotations``,
   it lets an operator lock or tune a task without editing it);
3. the task attribute (``@app.task(base=LockedTask, lock_ttl=60)``);
4. the app-wide ``app.conf.dflock_*`` setting;
5. the built-in default.

Bad values raise :class:`DflockConfigError` naming the setting or option and
what would be accepted.
"""

from __future__ import annotations

import difflib
import importlib
import math
import ssl
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol, cast, get_args

from celery.exceptions import ImproperlyConfigured

from celery_dflock.clients import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_RENEW_RATIO,
    DEFAULT_SERVERS,
    Client,
    ClientSettings,
    check_auth_token,
    check_limit,
    check_renew_ratio,
    check_servers,
    positive_seconds,
)
from celery_dflock.errors import InvalidValueError
from celery_dflock.sharding import Routing, stable_hash_shard
from dflockd_server.constants import DEFAULT_MAX_LEASE_TTL_S, MAX_NUMBER

__all__ = [
    "DEFAULTS",
    "LOCK_OPTIONS",
    "SETTINGS",
    "DflockConfig",
    "DflockConfigError",
    "LockOptions",
    "OnLockLost",
    "OnLocked",
    "check_combination",
    "check_option_names",
    "check_setting_names",
    "close_matches",
    "get_config",
    "parse_servers",
    "read_setting",
    "reset_config",
    "resolve_options",
    "validate_option",
]

OnLocked = Literal["retry", "skip", "raise"]
"""What a run does when its lock is busy (after the ``lock_timeout`` FIFO wait)."""
OnLockLost = Literal["interrupt", "flag", "terminate"]
"""What happens to a running body whose lock was lost."""
LockFrom = Literal["run", "publish"]
"""When a task's key is taken: when its run starts, or when it is published (queue-once)."""
OnDuplicate = Literal["return", "raise"]
"""What a publish does while the key is held (``lock_from="publish"``)."""

ON_LOCKED_CHOICES: Final[tuple[str, ...]] = get_args(OnLocked)
ON_LOCK_LOST_CHOICES: Final[tuple[str, ...]] = get_args(OnLockLost)
LOCK_FROM_CHOICES: Final[tuple[str, ...]] = get_args(LockFrom)
ON_DUPLICATE_CHOICES: Final[tuple[str, ...]] = get_args(OnDuplicate)
SHARDING_NAMES: Final = ("stable_hash", "rendezvous", "cluster")

DEFAULT_RETRY_COUNTDOWN_S: Final = 1.0
DEFAULT_RETRY_BACKOFF_MAX_S: Final = 60.0
DEFAULT_PENDING_TTL_S: Final = DEFAULT_MAX_LEASE_TTL_S
"""``lock_pending_ttl``: how long a published message may wait in the queue holding its key
(the longest lease a server grants by default, ``dflockd --max-lease-ttl``)."""

_CONFIG_ATTR: Final = "_dflock_config"


@dataclass(frozen=True, slots=True)
class SettingDoc:
    """One app-wide setting as the settings reference shows it (see :func:`setting_table`)."""

    name: str
    default: str
    meaning: str


_APP_SETTING_DOCS: Final = (
    SettingDoc(
        "dflock_servers",
        repr(",".join(f"{host}:{port}" for host, port in DEFAULT_SERVERS)),
        '`"host:port,host:port"` or a list of `(host, port)`; keys are sharded over them. Every '
        "worker and beat of one deployment must name the same servers in the same order.",
    ),
    SettingDoc(
        "dflock_sharding_strategy",
        repr(SHARDING_NAMES[0]),
        '`"stable_hash"` (crc32, like every dflockd client), `"rendezvous"`, '
        '`"module:function"` or a callable `(key, n_servers) -> index`; or `"cluster"`: '
        "`dflock_servers` are seeds of a cluster (`dflockd --cluster`), which says where each "
        "key lives.",
    ),
    SettingDoc("dflock_auth_token", "None", "Shared secret, when the servers require one."),
    SettingDoc("dflock_ssl", "None", "`True` (TLS, system CAs) or an `ssl.SSLContext`."),
    SettingDoc(
        "dflock_connect_timeout", repr(DEFAULT_CONNECT_TIMEOUT_S), "Seconds to connect to a server."
    ),
    SettingDoc(
        "dflock_renew_ratio",
        repr(DEFAULT_RENEW_RATIO),
        "Renew a held lock at this fraction of its lease.",
    ),
    SettingDoc(
        "dflock_key_prefix", "''", "Put in front of every key (several projects on one server)."
    ),
    SettingDoc(
        "dflock_task_locks",
        "{}",
        "Task name -> lock options, for tasks you cannot edit (installed by "
        "`celery_dflock.signals.install(app)`).",
    ),
)
_BEAT_SETTING_DOCS: Final = (
    SettingDoc(
        "dflock_beat_lock_key",
        "'celery-beat:<app.main>'",
        "Key of the leader lock (with `dflock_key_prefix` in front).",
    ),
    SettingDoc(
        "dflock_beat_scheduler",
        "'celery.beat:PersistentScheduler'",
        'The scheduler that does the work: `"module:Class"` or the class.',
    ),
    SettingDoc(
        "dflock_beat_lease_ttl",
        "10",
        "Lease seconds of the leader lock: how long a hung beat blocks a failover.",
    ),
    SettingDoc(
        "dflock_beat_nonoverlap",
        "False",
        "Every task beat sends runs under a per-entry lock (`beat-entry:<entry name>`), "
        '`on_locked="skip"`.',
    ),
)

APP_SETTINGS: Final = tuple(doc.name for doc in _APP_SETTING_DOCS)
"""App-wide settings that are not a lock option's default (see `SETTINGS` for those)."""
BEAT_SETTINGS: Final = tuple(doc.name for doc in _BEAT_SETTING_DOCS)
"""The singleton beat's settings (read by :mod:`celery_dflock.beat`)."""


def setting_table(kind: Literal["app", "beat"]) -> list[SettingDoc]:
    """The app-wide (``"app"``) or beat (``"beat"``) settings with defaults and meanings, for
    the generated settings reference (lock options' settings: :func:`option_table`)."""
    return list(_APP_SETTING_DOCS if kind == "app" else _BEAT_SETTING_DOCS)


class DflockConfigError(InvalidValueError, ImproperlyConfigured):
    """A ``dflock_*`` setting or a lock option has a value that cannot work.

    A `celery_dflock.DflockError` (and `ValueError`), and Celery's ``ImproperlyConfigured``.
    """


class _App(Protocol):
    """The part of a Celery app this module reads."""

    @property
    def conf(self) -> Any: ...


# --------------------------------------------------------------------------- validators


def _number(
    value: object, where: str, *, minimum: float, integer: bool, exclusive_min: bool = False
) -> float:
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise DflockConfigError(f"{where} must be {kind} of seconds, got {value!r}")
    if integer and not isinstance(value, int):
        raise DflockConfigError(f"{where} must be a whole number of seconds, got {value!r}")
    too_small = value <= minimum if exclusive_min else value < minimum
    if too_small or value > MAX_NUMBER or math.isnan(value):
        bound = f"> {minimum}" if exclusive_min else f">= {minimum}"
        raise DflockConfigError(f"{where} must be {bound} and <= {MAX_NUMBER}, got {value!r}")
    return value


def _validate_key(value: object, where: str) -> object:
    if value is None or isinstance(value, str) or callable(value):
        return value
    raise DflockConfigError(
        f"{where} must be a format template (str), a callable taking the task's arguments, "
        f"or None for the default key; got {value!r}"
    )


def _validate_timeout(value: object, where: str) -> object:
    if value is None:
        return None
    return _number(value, where, minimum=0, integer=False)


RETRY_WAIT_S: Final = 30.0
"""The default ``lock_timeout`` of ``on_locked="retry"``: a run waits this long in its key's
FIFO queue (taking the key the moment the holder lets go) before it is sent again with a
countdown."""


def default_timeout(on_locked: str) -> float:
    """``lock_timeout`` when none is set: `RETRY_WAIT_S` for ``"retry"``, else 0 (``"skip"``
    and ``"raise"`` give up at once)."""
    return RETRY_WAIT_S if on_locked == "retry" else 0.0


def _validate_ttl(value: object, where: str) -> object:
    if value is None:
        return None
    return int(_number(value, where, minimum=0, integer=True, exclusive_min=True))


def _validate_on_locked(value: object, where: str) -> object:
    if value not in ON_LOCKED_CHOICES:
        raise DflockConfigError(
            f"{where} must be one of {', '.join(map(repr, ON_LOCKED_CHOICES))}; got {value!r}"
        )
    return value


def _validate_on_lock_lost(value: object, where: str) -> object:
    if value not in ON_LOCK_LOST_CHOICES:
        raise DflockConfigError(
            f"{where} must be one of {', '.join(map(repr, ON_LOCK_LOST_CHOICES))}; got {value!r}"
        )
    return value


def _validate_lock_from(value: object, where: str) -> object:
    if value not in LOCK_FROM_CHOICES:
        raise DflockConfigError(
            f"{where} must be 'run' (the key is taken when the run starts) or 'publish' (taken "
            f"when the task is sent, held until its run ends: queue-once); got {value!r}"
        )
    return value


def _validate_on_duplicate(value: object, where: str) -> object:
    if value not in ON_DUPLICATE_CHOICES:
        raise DflockConfigError(
            f"{where} must be 'return' (the duplicate publish returns the queued task's "
            f"AsyncResult) or 'raise' (it raises AlreadyQueued); got {value!r}"
        )
    return value


def _validate_pending_ttl(value: object, where: str) -> object:
    return int(_number(value, where, minimum=0, integer=True, exclusive_min=True))


def _validate_limit(value: object, where: str) -> object:
    return check_limit(value, where, error=DflockConfigError)


def _validate_countdown(value: object, where: str) -> object:
    return float(_number(value, where, minimum=0, integer=False))


def _validate_max_retries(value: object, where: str) -> object:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DflockConfigError(
            f"{where} must be None (retry while the key is busy, no limit) or a whole number "
            f"of retries >= 0; got {value!r}"
        )
    return value


def _validate_bool(value: object, where: str) -> object:
    if not isinstance(value, bool):
        raise DflockConfigError(f"{where} must be True or False, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class _OptionSpec:
    name: str
    setting: str | None
    default: object
    validate: Callable[[object, str], object]
    meaning: str


_SPECS: Final = (
    _OptionSpec(
        "lock_key",
        None,
        None,
        _validate_key,
        "A format template over the task's arguments (defaults applied): "
        '`"report:{customer_id}"`; or a callable taking the task\'s arguments and returning '
        "the key; or `None`: the task "
        "name plus a digest of all arguments (canonical JSON, so UUID, datetime and Decimal "
        "arguments work). Keys with whitespace or over 256 bytes are made valid (readable "
        "prefix + digest).",
    ),
    _OptionSpec(
        "lock_timeout",
        "dflock_lock_timeout",
        None,
        _validate_timeout,
        "Seconds to wait in the key's FIFO queue before `on_locked` applies (whole seconds on "
        'the wire, rounded up). `None`: 30 s with `on_locked="retry"` (the run waits for the '
        'key in the worker, holding its pool slot, then retries), 0 with `"skip"` and '
        '`"raise"`.',
    ),
    _OptionSpec(
        "lock_ttl",
        "dflock_lock_ttl",
        None,
        _validate_ttl,
        "Lease in seconds (`None`: the server's, 33 s by default); renewed every "
        "`lock_ttl * dflock_renew_ratio` while the body runs.",
    ),
    _OptionSpec(
        "on_locked",
        "dflock_on_locked",
        "retry",
        _validate_on_locked,
        'The lock is busy: `"retry"` (sent again with a countdown, exponential backoff and '
        "jitter, up to `lock_max_retries` times, then the task fails with `LockNotAcquired` "
        'saying the retries ran out), `"skip"` (the run fails at once with `LockSkipped`) or '
        '`"raise"` (the run fails with `LockNotAcquired`).',
    ),
    _OptionSpec(
        "lock_limit",
        None,
        None,
        _validate_limit,
        "Let up to N runs per key proceed at once (a semaphore); `None`: a plain lock. A key "
        "is one resource: while runs with one limit hold it, a run with another (a lock is "
        "limit 1) is refused at once and `on_locked` applies.",
    ),
    _OptionSpec(
        "on_lock_lost",
        "dflock_on_lock_lost",
        "interrupt",
        _validate_on_lock_lost,
        'The lock is lost mid-run (renewal refused or server gone): `"interrupt"` raises '
        '`LockLost` in the body; `"flag"` only sets `self.lock.lost`; `"terminate"` kills a '
        "prefork pool child (elsewhere it interrupts). `lock_lost` is sent in every case.",
    ),
    _OptionSpec(
        "lock_retry_countdown",
        "dflock_lock_retry_countdown",
        DEFAULT_RETRY_COUNTDOWN_S,
        _validate_countdown,
        'First retry countdown of `on_locked="retry"`, doubled per retry.',
    ),
    _OptionSpec(
        "lock_retry_backoff_max",
        "dflock_lock_retry_backoff_max",
        DEFAULT_RETRY_BACKOFF_MAX_S,
        _validate_countdown,
        "Longest retry countdown.",
    ),
    _OptionSpec(
        "lock_max_retries",
        "dflock_lock_max_retries",
        None,
        _validate_max_retries,
        'Most retries of `on_locked="retry"`; `None`: retry as long as the key is busy, so no '
        "run is dropped because its key was busy. Counted apart from Celery's `retries`: the "
        "task's `max_retries` is left to its own `self.retry` calls.",
    ),
    _OptionSpec(
        "lock_retry_jitter",
        "dflock_lock_retry_jitter",
        True,
        _validate_bool,
        "Randomise each countdown between half and all of it.",
    ),
    _OptionSpec(
        "lock_from",
        "dflock_lock_from",
        "run",
        _validate_lock_from,
        '`"run"`: the key is taken when the run starts. `"publish"` (queue-once): the key is '
        "taken when the task is sent (`delay`, `apply_async`, canvas, beat) and held until its "
        "run ends, so a duplicate is never queued (`on_duplicate` says what the duplicate "
        "gets); needs celery-dflock's server. Not with `lock_limit`.",
    ),
    _OptionSpec(
        "on_duplicate",
        "dflock_on_duplicate",
        "return",
        _validate_on_duplicate,
        'A publish while the key is held (`lock_from="publish"`): `"return"` sends nothing '
        "and returns the `AsyncResult` of the task holding the key; "
        '`"raise"` raises `AlreadyQueued` (`.task_id`: the holder\'s).',
    ),
    _OptionSpec(
        "lock_pending_ttl",
        "dflock_lock_pending_ttl",
        DEFAULT_PENDING_TTL_S,
        _validate_pending_ttl,
        'Seconds a message sent with `lock_from="publish"` may wait holding its key, counted '
        "from the send (a longer `countdown`/`eta` extends it to the due time); a message no "
        "worker takes by then (a purged queue, a lost message) frees it. A retry keeps the key "
        "as long. At most the server's `--max-lease-ttl` (300 s unless raised).",
    ),
)
_BY_NAME: Final = {spec.name: spec for spec in _SPECS}

LOCK_OPTIONS: Final = tuple(spec.name for spec in _SPECS)
"""Every lock option name (task attribute, call option, ``dflock_task_locks`` entry key)."""
DEFAULTS: Final[Mapping[str, object]] = {spec.name: spec.default for spec in _SPECS}
"""The built-in default of every lock option."""
SETTINGS: Final[Mapping[str, str]] = {
    spec.name: spec.setting for spec in _SPECS if spec.setting is not None
}
"""Lock option name -> the ``app.conf`` setting that gives its app-wide default: the option's
name with ``dflock_`` in front."""
RENAMED_SETTINGS: Final[Mapping[str, str]] = {
    "dflock_default_timeout": "dflock_lock_timeout",
    "dflock_default_ttl": "dflock_lock_ttl",
    "dflock_retry_countdown": "dflock_lock_retry_countdown",
    "dflock_retry_backoff_max": "dflock_lock_retry_backoff_max",
    "dflock_max_retries": "dflock_lock_max_retries",
    "dflock_retry_jitter": "dflock_lock_retry_jitter",
}
"""Old setting name -> its name now; the old names are still read, with a DeprecationWarning."""

KNOWN_SETTINGS: Final = frozenset(
    (*APP_SETTINGS, *SETTINGS.values(), *BEAT_SETTINGS, *RENAMED_SETTINGS)
)
"""Every ``dflock_*`` setting this package reads (the old names of renamed ones too)."""


def close_matches(name: str, known: Iterable[str]) -> str:
    """``"; did you mean 'a' or 'b'?"`` for the names of ``known`` close to ``name``, or ``""``."""
    close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.75)
    return f"; did you mean {' or '.join(map(repr, close))}?" if close else ""


def looks_like_lock_option(name: str) -> bool:
    """Whether ``name``, which is no lock option, is most likely a misspelt one (``lock_tll``,
    ``on_lock``, ``lockttl``): it starts like one, or is one letter or two away from one."""
    lowered = name.lower()
    if lowered in LOCK_OPTIONS:
        return False
    if lowered.startswith(("lock_", "on_lock")):
        return True
    return bool(difflib.get_close_matches(lowered, LOCK_OPTIONS, n=1, cutoff=0.8))


def check_option_names(names: Iterable[str], where: str) -> None:
    """Refuse a name that is not a lock option but looks like a misspelt one (``where``: the
    task or call it was given to): Celery would keep it without a word, and the lock would
    run on the option's default."""
    for name in names:
        if looks_like_lock_option(name):
            raise DflockConfigError(
                f"{where}: {name!r} is not a lock option{close_matches(name, LOCK_OPTIONS)} "
                f"(the lock options: {', '.join(LOCK_OPTIONS)})"
            )


def read_setting(conf: Any, name: str) -> object:
    """``app.conf`` setting ``name``; the upper-case spelling of Celery's old setting style
    (``DFLOCK_SERVERS``) is read too. (With ``namespace="CELERY"`` Celery itself maps
    ``CELERY_DFLOCK_SERVERS`` to ``dflock_servers``.)"""
    value: object = conf.get(name)
    if value is None:
        value = conf.get(name.upper())
    if value is None:
        for old, renamed in RENAMED_SETTINGS.items():
            if renamed != name:
                continue
            for spelling in (old, old.upper()):
                value = conf.get(spelling)
                if value is not None:
                    warnings.warn(
                        f"app.conf.{spelling} is deprecated: rename it to {name} (each lock "
                        f"option's app-wide setting is its name with dflock_ in front)",
                        DeprecationWarning,
                        stacklevel=2,
                    )
                    return value
    return value


def check_setting_names(conf: Any) -> None:
    """Refuse a ``dflock_*`` setting (any case) that this package does not read: a misspelt
    setting would otherwise be ignored without a word."""
    for raw in list(conf.keys()):
        name = str(raw)
        lowered = name.lower()
        if not lowered.startswith("dflock_") or lowered in KNOWN_SETTINGS:
            continue
        current = sorted(KNOWN_SETTINGS - RENAMED_SETTINGS.keys())
        close = difflib.get_close_matches(lowered, current, n=3)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        raise DflockConfigError(
            f"app.conf.{name} is not a celery-dflock setting; {hint}the settings are: "
            f"{', '.join(current)}"
        )


def validate_option(name: str, value: object, where: str) -> object:
    """Check one lock option (``where`` names its source in the error), return it normalised."""
    spec = _BY_NAME.get(name)
    if spec is None:
        raise DflockConfigError(
            f"{where}: unknown lock option {name!r}{close_matches(name, LOCK_OPTIONS)} "
            f"(the lock options: {', '.join(LOCK_OPTIONS)})"
        )
    return spec.validate(value, where)


def _validate_options(
    options: object, where: str, *, allow_callables: bool = True
) -> dict[str, object]:
    if not isinstance(options, Mapping):
        raise DflockConfigError(
            f"{where} must be a mapping of lock options (e.g. {{'lock_ttl': 60}}), got {options!r}"
        )
    result: dict[str, object] = {}
    for name, value in cast("Mapping[object, object]", options).items():
        if not isinstance(name, str):
            raise DflockConfigError(f"{where}: option names must be strings, got {name!r}")
        checked = validate_option(name, value, f"{where}[{name!r}]")
        if not allow_callables and callable(checked):
            raise DflockConfigError(
                f"{where}[{name!r}] must be serialisable (a template string), not a callable"
            )
        result[name] = checked
    check_combination(result, where)
    return result


# --------------------------------------------------------------------------- servers


def _parse_port(text: str, where: str, entry: object) -> int:
    """The port as an int (its range is checked with the whole list, by `check_servers`)."""
    try:
        return int(text)
    except ValueError:
        raise DflockConfigError(
            f"{where}: bad port in {entry!r}; expected 'host:port' with a port from 1 to 65535"
        ) from None


def _parse_address(entry: object, where: str) -> tuple[str, int]:
    if isinstance(entry, str):
        text = entry.strip()
        if text.startswith("["):  # [IPv6]:port
            host, sep, port_text = text[1:].partition("]:")
        else:
            host, sep, port_text = text.rpartition(":")
        if not sep or not host:
            raise DflockConfigError(
                f"{where}: {entry!r} is not 'host:port' (e.g. '127.0.0.1:6388' or '[::1]:6388')"
            )
        return host, _parse_port(port_text, where, entry)
    if isinstance(entry, tuple | list) and len(cast("tuple[object, ...]", entry)) == 2:
        host_obj, port_obj = cast("tuple[object, object]", tuple(cast("Iterable[object]", entry)))
        if isinstance(host_obj, str) and host_obj and isinstance(port_obj, int | str):
            return host_obj, _parse_port(str(port_obj), where, cast("object", entry))
    raise DflockConfigError(f"{where}: {entry!r} is not a server; use (host, port) or 'host:port'")


def parse_servers(value: object, where: str = "dflock_servers") -> tuple[tuple[str, int], ...]:
    """Servers from ``"host:port,host:port"``, a list of ``(host, port)`` or of ``"host:port"``."""
    entries: list[object]
    if isinstance(value, str):
        entries = [part for part in value.split(",") if part.strip()]
    elif isinstance(value, tuple | list):
        items = list(cast("Iterable[object]", value))
        # A bare ("host", port) pair is one server, not two.
        if len(items) == 2 and isinstance(items[0], str) and isinstance(items[1], int):
            entries = [tuple(items)]
        else:
            entries = items
    else:
        raise DflockConfigError(
            f"{where} must be 'host:port,host:port' or a list of (host, port); got {value!r}"
        )
    if not entries:
        raise DflockConfigError(f"{where} is empty; give at least one 'host:port'")
    parsed = [_parse_address(entry, where) for entry in entries]
    return check_servers(parsed, where, error=DflockConfigError)


# --------------------------------------------------------------------------- the config


def _sharding_strategy(value: object) -> Routing:
    where = "dflock_sharding_strategy"
    if callable(value):
        return cast("Callable[[str, int], int]", value)
    if isinstance(value, str):
        from celery_dflock import sharding

        if value == sharding.CLUSTER:
            return sharding.CLUSTER
        named = {"stable_hash": sharding.stable_hash_shard, "rendezvous": sharding.rendezvous_shard}
        if value in named:
            return named[value]
        module_name, sep, attr = value.partition(":")
        if sep and module_name and attr:
            try:
                found: object = getattr(importlib.import_module(module_name), attr)
            except (ImportError, AttributeError) as exc:
                raise DflockConfigError(f"{where}: cannot import {value!r} ({exc})") from exc
            if callable(found):
                return cast("Callable[[str, int], int]", found)
    raise DflockConfigError(
        f"{where} must be 'stable_hash', 'rendezvous', 'cluster', 'module:function' or a callable "
        f"(key, number_of_servers) -> index; got {value!r}"
    )


def _ssl_context(value: object) -> ssl.SSLContext | None:
    if value is None or value is False:
        return None
    if value is True:
        return ssl.create_default_context()
    if isinstance(value, ssl.SSLContext):
        return value
    raise DflockConfigError(
        f"dflock_ssl must be None/False (plain TCP), True (verify with the system CAs) or an "
        f"ssl.SSLContext; got {value!r}"
    )


@dataclass(frozen=True, slots=True)
class DflockConfig:
    """Every ``dflock_*`` setting of one app, validated (see :func:`get_config`)."""

    servers: tuple[tuple[str, int], ...] = DEFAULT_SERVERS
    auth_token: str | None = None
    ssl_context: ssl.SSLContext | None = None
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S
    renew_ratio: float = DEFAULT_RENEW_RATIO
    sharding_strategy: Routing | None = None
    """None: the client's default (``stable_hash_shard``); ``"cluster"``: cluster routing."""
    key_prefix: str = ""
    defaults: Mapping[str, object] = field(default_factory=lambda: dict(DEFAULTS))
    """App-wide lock option defaults (built-in defaults overlaid with ``dflock_*``)."""
    task_locks: Mapping[str, Mapping[str, object]] = field(default_factory=dict[str, Any])
    """``dflock_task_locks``: task name -> lock options."""

    @classmethod
    def from_conf(cls, conf: Any) -> DflockConfig:
        """Read and validate the ``dflock_*`` settings of a Celery ``app.conf``."""

        check_setting_names(conf)

        def get(name: str) -> object:
            return read_setting(conf, name)

        servers = get("dflock_servers")
        auth_token = check_auth_token(
            get("dflock_auth_token"), "dflock_auth_token", error=DflockConfigError
        )
        connect_timeout = get("dflock_connect_timeout")
        renew_ratio = get("dflock_renew_ratio")
        key_prefix = get("dflock_key_prefix")
        if key_prefix is not None and not isinstance(key_prefix, str):
            raise DflockConfigError(f"dflock_key_prefix must be a string, got {key_prefix!r}")
        strategy = get("dflock_sharding_strategy")

        defaults = dict(DEFAULTS)
        for option, setting in SETTINGS.items():
            value = get(setting)
            if value is not None:
                defaults[option] = validate_option(option, value, f"app.conf.{setting}")

        task_locks_raw = get("dflock_task_locks")
        task_locks: dict[str, Mapping[str, object]] = {}
        if task_locks_raw is not None:
            if not isinstance(task_locks_raw, Mapping):
                raise DflockConfigError(
                    "dflock_task_locks must map task names to lock options, e.g. "
                    "{'proj.tasks.report': {'lock_key': 'report:{customer_id}'}}; "
                    f"got {task_locks_raw!r}"
                )
            for name, options in cast("Mapping[object, object]", task_locks_raw).items():
                if not isinstance(name, str):
                    raise DflockConfigError(
                        f"dflock_task_locks keys must be task names, got {name!r}"
                    )
                task_locks[name] = _validate_options(options, f"dflock_task_locks[{name!r}]")

        return cls(
            servers=DEFAULT_SERVERS if servers is None else parse_servers(servers),
            auth_token=auth_token,
            ssl_context=_ssl_context(get("dflock_ssl")),
            connect_timeout_s=(
                DEFAULT_CONNECT_TIMEOUT_S
                if connect_timeout is None
                else positive_seconds(
                    "dflock_connect_timeout",
                    cast("float", connect_timeout),
                    error=DflockConfigError,
                )
            ),
            renew_ratio=(
                DEFAULT_RENEW_RATIO
                if renew_ratio is None
                else check_renew_ratio(renew_ratio, "dflock_renew_ratio", error=DflockConfigError)
            ),
            sharding_strategy=None if strategy is None else _sharding_strategy(strategy),
            key_prefix=key_prefix or "",
            defaults=defaults,
            task_locks=task_locks,
        )

    def client_settings(self) -> ClientSettings:
        """The settings of this app's `Client` (already validated, as ``dflock_*`` settings)."""
        return ClientSettings(
            servers=check_servers(self.servers, "dflock_servers", error=DflockConfigError),
            sharding_strategy=self.sharding_strategy or stable_hash_shard,
            renew_ratio=self.renew_ratio,
            auth_token=self.auth_token,
            ssl_context=self.ssl_context,
            connect_timeout_s=self.connect_timeout_s,
        )

    def new_client(self) -> Client:
        """A `Client` on these settings. The Celery layer keeps one per app and process (see
        ``celery_dflock._runtime.Runtime.client``); beat and ``celery dflock`` make their own."""
        return Client.from_settings(self.client_settings())


def get_config(app: _App) -> DflockConfig:
    """The app's :class:`DflockConfig`, read on first use and cached on the app.

    Change ``dflock_*`` settings before the first locked task runs, or call
    :func:`reset_config` afterwards.
    """
    cached: object = getattr(app, _CONFIG_ATTR, None)
    if isinstance(cached, DflockConfig):
        return cached
    config = DflockConfig.from_conf(app.conf)
    setattr(app, _CONFIG_ATTR, config)
    return config


def reset_config(app: _App) -> None:
    """Forget the cached config: the next :func:`get_config` reads ``app.conf`` again."""
    if hasattr(app, _CONFIG_ATTR):
        delattr(app, _CONFIG_ATTR)


# --------------------------------------------------------------------------- resolution


@dataclass(frozen=True, slots=True)
class LockOptions:
    """The lock options of one task run, every layer resolved."""

    key: str | Callable[..., str] | None
    timeout: float
    ttl: int | None
    on_locked: OnLocked
    limit: int | None
    on_lock_lost: OnLockLost
    retry_countdown: float
    retry_backoff_max: float
    retry_jitter: bool
    max_retries: int | None = None
    lock_from: LockFrom = "run"
    on_duplicate: OnDuplicate = "return"
    pending_ttl: int = DEFAULT_PENDING_TTL_S
    timeout_given: bool = True
    """Whether ``lock_timeout`` was set (False: ``timeout`` is `default_timeout`'s)."""


def check_call_options(options: Mapping[str, object], where: str) -> dict[str, object]:
    """Validate per-call lock options; they travel in a message, so no callables."""
    return _validate_options(options, where, allow_callables=False)


def check_combination(options: Mapping[str, object], where: str) -> None:
    """Refuse lock options that cannot work together (``where`` names their source)."""
    if options.get("lock_from") == "publish" and options.get("lock_limit") is not None:
        raise DflockConfigError(
            f"{where}: lock_from='publish' cannot be combined with "
            f"lock_limit={options['lock_limit']!r}: a key held from publish lets one message "
            f"of the key wait in the queue (a lock, not a semaphore); remove lock_limit, or "
            f"use lock_from='run' (a semaphore slot is taken when the run starts)"
        )


def resolve_options(
    config: DflockConfig,
    task_name: str,
    attributes: Mapping[str, object],
    call: Mapping[str, object] | None = None,
) -> LockOptions:
    """Resolve every lock option: call > dflock_task_locks > attribute > app.conf > default.

    ``attributes`` are the task's lock attributes (None means unset). Values
    from ``config`` were validated when it was read; attributes and call
    options are validated here.
    """
    entry = config.task_locks.get(task_name, {})
    resolved: dict[str, object] = {}
    for name in LOCK_OPTIONS:
        if call and call.get(name) is not None:
            value = validate_option(name, call[name], f"call option {name} of {task_name!r}")
        elif entry.get(name) is not None:
            value = entry[name]
        elif attributes.get(name) is not None:
            value = validate_option(
                name, attributes[name], f"attribute {name} of task {task_name!r}"
            )
        else:
            value = config.defaults[name]
        resolved[name] = value
    check_combination(resolved, f"lock options of task {task_name!r}")
    return LockOptions(
        key=cast("str | Callable[..., str] | None", resolved["lock_key"]),
        timeout=(
            default_timeout(str(resolved["on_locked"]))
            if resolved["lock_timeout"] is None
            else float(cast("float", resolved["lock_timeout"]))
        ),
        ttl=cast("int | None", resolved["lock_ttl"]),
        on_locked=cast("OnLocked", resolved["on_locked"]),
        limit=cast("int | None", resolved["lock_limit"]),
        on_lock_lost=cast("OnLockLost", resolved["on_lock_lost"]),
        retry_countdown=cast("float", resolved["lock_retry_countdown"]),
        retry_backoff_max=cast("float", resolved["lock_retry_backoff_max"]),
        retry_jitter=cast("bool", resolved["lock_retry_jitter"]),
        max_retries=cast("int | None", resolved["lock_max_retries"]),
        lock_from=cast("LockFrom", resolved["lock_from"]),
        on_duplicate=cast("OnDuplicate", resolved["on_duplicate"]),
        pending_ttl=cast("int", resolved["lock_pending_ttl"]),
        timeout_given=resolved["lock_timeout"] is not None,
    )


def option_table() -> list[tuple[str, str | None, object, str]]:
    """(option, app.conf setting, default, meaning) for every lock option (for docs)."""
    return [(spec.name, spec.setting, spec.default, spec.meaning) for spec in _SPECS]
