# pyright: reportMissingTypeStubs=false
"""Every lock option and ``dflock_*`` setting, once: its check, its default, its meaning.

The checks (`Check`) and the one table of options and settings (`Spec`), which the option
resolution (`celery_dflock.config.resolve_options`), `celery_dflock.config.DflockConfig`,
`celery_dflock.beat.BeatSettings` and the generated settings reference (`option_table`,
`setting_table`) all read. A value is checked once, where it enters (a setting, an attribute,
a call option, a message's options).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import keyword
import math
import ssl
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from types import MappingProxyType
from typing import Any, Final, Generic, Literal, NamedTuple, TypeAlias, TypeVar, cast, get_args

import click
from celery.exceptions import ImproperlyConfigured

from celery_dflock.client import sharding
from celery_dflock.client.clients import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_RENEW_RATIO,
    DEFAULT_SERVERS,
    DEFAULT_SESSION_TTL_S,
    MIN_SESSION_TTL_S,
    Lease,
    check_auth_token,
    check_limit,
    check_renew_ratio,
    check_servers,
    lease_seconds,
    positive_seconds,
    whole_seconds,
)
from celery_dflock.client.errors import InvalidValueError
from celery_dflock.client.sharding import Routing
from celery_dflock.client.wire import DEFAULT_MAX_LEASE_TTL_S, MAX_NUMBER
from celery_dflock.keys import KeySource

OnLocked = Literal["retry", "skip", "raise"]
"""What a run does when its lock is busy (after the ``lock_timeout`` FIFO wait)."""
OnLockLost = Literal["interrupt", "flag", "terminate"]
"""What happens to a running body whose lock was lost."""
LockFrom = Literal["run", "publish"]
"""When a task's key is taken: when its run starts, or when it is published (queue-once)."""
OnDuplicate = Literal["return", "raise"]
"""What a publish does while the key is held (``lock_from="publish"``)."""

T = TypeVar("T")
Word = TypeVar("Word", bound=str)
Check: TypeAlias = Callable[[object, str], T]
"""A check: ``(value, where) -> value`` normalised and typed, or `DflockConfigError` (never
given None: unset)."""


class DflockConfigError(click.ClickException, InvalidValueError, ImproperlyConfigured):
    """A ``dflock_*`` setting or a lock option has a value that cannot work.

    A `celery_dflock.DflockError` (and `ValueError`), and Celery's ``ImproperlyConfigured``;
    a ``celery`` command (``worker``, ``beat``) that meets one prints it as one line, as click
    prints its own errors, and exits 1.
    """


def close_matches(name: str, known: Iterable[str], cutoff: float = 0.75) -> str:
    """``"; did you mean 'a' or 'b'?"`` for the names of ``known`` close to ``name``, or ``""``."""
    close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=cutoff)
    return f"; did you mean {' or '.join(map(repr, close))}?" if close else ""


def check_countdown(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise DflockConfigError(f"{where} must be a number of seconds, got {value!r}")
    if value < 0 or value > MAX_NUMBER or math.isnan(value):
        raise DflockConfigError(f"{where} must be >= 0 and <= {MAX_NUMBER}, got {value!r}")
    return float(value)


def check_lease(value: object, where: str) -> Lease:
    return lease_seconds(where, value, error=DflockConfigError)


def check_max_retries(value: object, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DflockConfigError(
            f"{where} must be None (retry while the key is busy, no limit) or a whole number "
            f"of retries >= 0; got {value!r}"
        )
    return value


def check_connect_timeout(value: object, where: str) -> float:
    return positive_seconds(where, cast("float", value), error=DflockConfigError)


def check_session_ttl(value: object, where: str) -> int:
    return whole_seconds(
        where, cast("float", value), minimum=MIN_SESSION_TTL_S, error=DflockConfigError
    )


def check_key(value: object, where: str) -> KeySource:
    if isinstance(value, str) or callable(value):
        return cast("KeySource", value)
    raise DflockConfigError(
        f"{where} must be a format template (str), a callable taking the task's arguments, "
        f"or None for the default key; got {value!r}"
    )


def one_of(choices: tuple[Word, ...], meanings: str | None = None) -> Check[Word]:
    """A check that the value is one of ``choices`` (``meanings``: the error's words for them)."""
    accepted = meanings or "one of " + ", ".join(map(repr, choices))

    def check(value: object, where: str) -> Word:
        for choice in choices:
            if value == choice:
                return choice
        raise DflockConfigError(f"{where} must be {accepted}; got {value!r}")

    return check


def check_bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise DflockConfigError(f"{where} must be True or False, got {value!r}")
    return value


def check_string(value: object, where: str, *, empty: bool = True) -> str:
    """A string (``empty=False``: one with more than white space)."""
    if not isinstance(value, str) or not (empty or value.strip()):
        kind = "a string" if empty else "a non-empty string"
        raise DflockConfigError(f"{where} must be {kind}, got {value!r}")
    return value


def _parse_address(entry: object, where: str) -> object:
    """``"host:port"`` (``"[::1]:port"``) or a pair whose port is text, as ``(host, port)``;
    any other entry as it is, for `check_servers` to check."""
    if isinstance(entry, str):
        text = entry.strip()
        if text.startswith("["):  # [IPv6]:port
            host, sep, port = text[1:].partition("]:")
        else:
            host, sep, port = text.rpartition(":")
        if not sep or not host:
            raise DflockConfigError(
                f"{where}: {entry!r} is not 'host:port' (e.g. '127.0.0.1:6388' or '[::1]:6388')"
            )
    else:
        pair = cast("Sequence[object]", entry) if isinstance(entry, tuple | list) else ()
        if len(pair) != 2 or not isinstance(pair[1], str):
            return cast("object", entry)
        host, port = pair[0], pair[1]
    try:
        return host, int(port)
    except ValueError:
        raise DflockConfigError(
            f"{where}: bad port in {entry!r}; expected 'host:port' with a port from 1 to 65535"
        ) from None


def parse_servers(value: object, where: str = "dflock_servers") -> tuple[tuple[str, int], ...]:
    """Servers from ``"host:port,host:port"``, a list of ``(host, port)`` or of ``"host:port"``."""
    if isinstance(value, str):
        entries = [part for part in value.split(",") if part.strip()]
    elif isinstance(value, tuple | list):
        items = list(cast("Iterable[object]", value))
        # A bare ("host", port) pair is one server, not two.
        bare = len(items) == 2 and isinstance(items[0], str) and isinstance(items[1], int)
        entries = [tuple(items)] if bare else items
    else:
        raise DflockConfigError(
            f"{where} must be 'host:port,host:port' or a list of (host, port); got {value!r}"
        )
    if not entries:
        raise DflockConfigError(f"{where} is empty; give at least one 'host:port'")
    parsed = [_parse_address(entry, where) for entry in entries]
    return check_servers(parsed, where, error=DflockConfigError)


def check_sharding(value: object, where: str) -> Routing:
    found = value
    if isinstance(value, str):
        if value == sharding.CLUSTER:
            return sharding.CLUSTER
        named = {"stable_hash": sharding.stable_hash_shard, "rendezvous": sharding.rendezvous_shard}
        module_name, sep, attr = value.partition(":")
        if value in named:
            found = named[value]
        elif sep and module_name and attr:
            try:
                found = getattr(importlib.import_module(module_name), attr)
            except (ImportError, AttributeError, TypeError) as exc:  # TypeError: ".relative"
                raise DflockConfigError(f"{where}: cannot import {value!r} ({exc})") from exc
    if callable(found):
        try:
            inspect.signature(found).bind("key", 1)
        except ValueError:  # no signature to read (some built-ins): taken on trust
            pass
        except TypeError as exc:
            raise DflockConfigError(
                f"{where}: {found!r} cannot be called as (key, number_of_servers) -> index: {exc}"
            ) from None
        return cast("Callable[[str, int], int]", found)
    raise DflockConfigError(
        f"{where} must be 'stable_hash', 'rendezvous', 'cluster', 'module:function' or a callable "
        f"(key, number_of_servers) -> index; got {value!r}"
    )


def check_ssl(value: object, where: str) -> ssl.SSLContext | None:
    if value is None or value is False:
        return None
    if value is True:
        return ssl.create_default_context()
    if isinstance(value, ssl.SSLContext):
        return value
    raise DflockConfigError(
        f"{where} must be None/False (plain TCP), True (verify with the system CAs) or an "
        f"ssl.SSLContext; got {value!r}"
    )


DEFAULT_BEAT_LEASE_TTL_S: Final = 10
DEFAULT_BEAT_KEY_PREFIX: Final = "celery-beat:"
"""Beat's leader lock key, when ``dflock_beat_lock_key`` is not set: this and ``app.main``."""


@dataclass(frozen=True, slots=True)
class Spec(Generic[T]):
    """One lock option, or one app-wide or beat setting."""

    name: str
    """The lock option; for a setting with no per-task option, the setting."""
    setting: str | None
    """The ``app.conf`` setting that gives it (a lock option's: its app-wide default)."""
    default: T
    check: Check[T]
    meaning: str
    shown: str | None = None
    """The default as the settings reference shows it, when not ``repr(default)``."""

    @property
    def attribute(self) -> str:
        """A lock option's field of `GivenOptions` and `celery_dflock.config.LockOptions`: its
        name without ``lock_`` (``ttl``), unless that leaves a Python keyword (``lock_from``)."""
        short = self.name.removeprefix("lock_")
        return self.name if keyword.iskeyword(short) else short

    def read(self, value: object, where: str) -> T:
        """The value as set (checked), or the default when it is None."""
        return self.default if value is None else self.check(value, where)

    def given(self, values: Mapping[str, object], where: Callable[[str], str]) -> T | None:
        """This option's value in ``values`` (checked), or None."""
        value = values.get(self.name)
        return None if value is None else self.check(value, where(self.name))


def _setting(
    name: str, default: T, check: Check[T], meaning: str, shown: str | None = None
) -> Spec[T]:
    return Spec(name, name, default, check, meaning, shown)


def _option(
    name: str, default: T, check: Check[T], meaning: str, *, app_wide: bool = True
) -> Spec[T]:
    """A lock option's row: its app-wide setting is its name with ``dflock_`` in front."""
    return Spec(name, f"dflock_{name}" if app_wide else None, default, check, meaning)


_PENDING_DEFAULT: Final = "lock_pending_ttl (dflock_lock_pending_ttl), by default"
LOCK_OPTION_SPECS: Final[tuple[Spec[Any], ...]] = (
    _option("lock_key", None, check_key,
        "A format template over the task's arguments (defaults applied): "
        '`"report:{customer_id}"`; or a callable taking the task\'s arguments and returning the '
        "key; or `None`: the task name plus a digest of all arguments (canonical JSON, so UUID, "
        "datetime and Decimal arguments work). Keys with whitespace or over 256 bytes are made "
        "valid (readable prefix + digest).", app_wide=False),
    _option("lock_timeout", None, check_countdown,
        "Seconds to wait in the key's FIFO queue before `on_locked` applies (whole seconds on the "
        'wire, rounded up). `None`: 30 s with `on_locked="retry"` (the run waits for the key in '
        'the worker, holding its pool slot, then retries), 0 with `"skip"` and `"raise"`.'),
    _option("lock_ttl", None, check_lease,
        "Lease in seconds (`None`: the server's, 33 s by default); renewed every `lock_ttl * "
        "dflock_renew_ratio` while the body runs."),
    _option("on_locked", "retry", one_of(get_args(OnLocked)),
        'The lock is busy: `"retry"` (sent again with a countdown, exponential backoff and jitter, '
        "up to `lock_max_retries` times, then the task fails with `LockNotAcquired` saying the "
        'retries ran out), `"skip"` (the run fails at once with `LockSkipped`) or `"raise"` (the '
        "run fails with `LockNotAcquired`)."),
    _option("lock_limit", None, partial(check_limit, error=DflockConfigError),
        "Let up to N runs per key proceed at once (a semaphore); `None`: a plain lock. A key is "
        "one resource: while runs with one limit hold it, a run with another (a lock is limit 1) "
        "is refused at once and `on_locked` applies.", app_wide=False),
    _option("on_lock_lost", "interrupt", one_of(get_args(OnLockLost)),
        'The lock is lost mid-run (renewal refused or server gone): `"interrupt"` raises '
        '`LockLost` in the body; `"flag"` only sets `self.lock.lost`; `"terminate"` kills a '
        "prefork pool child (elsewhere it interrupts). `lock_lost` is sent in every case."),
    _option("lock_retry_countdown", 1.0, check_countdown,
        'First retry countdown of `on_locked="retry"`, doubled per retry.'),
    _option("lock_retry_backoff_max", 60.0, check_countdown, "Longest retry countdown."),
    _option("lock_max_retries", None, check_max_retries,
        'Most retries of `on_locked="retry"`; `None`: retry as long as the key is busy, so no run '
        "is dropped because its key was busy. Counted apart from Celery's `retries`: the task's "
        "`max_retries` is left to its own `self.retry` calls."),
    _option("lock_retry_jitter", True, check_bool,
        "Randomise each countdown between half and all of it."),
    _option("lock_from", "run",
        one_of(get_args(LockFrom), "'run' (the key is taken when the run starts) or 'publish' "
            "(taken when the task is sent, held until its run ends: queue-once)"),
        '`"run"`: the key is taken when the run starts. `"publish"` (queue-once): the key is '
        "taken when the task is sent (`delay`, `apply_async`, canvas, beat) and held until its "
        "run ends, so a duplicate is never queued (`on_duplicate` says what the duplicate "
        "gets); needs celery-dflock's server. Not with `lock_limit`."),
    _option("on_duplicate", "return",
        one_of(get_args(OnDuplicate), "'return' (the duplicate publish returns the queued "
            "task's AsyncResult) or 'raise' (it raises AlreadyQueued)"),
        'A publish while the key is held (`lock_from="publish"`): `"return"` sends nothing '
        "and returns the `AsyncResult` of the task holding the key; "
        '`"raise"` raises `AlreadyQueued` (`.task_id`: the holder\'s).'),
    _option("lock_pending_ttl", Lease(DEFAULT_MAX_LEASE_TTL_S, _PENDING_DEFAULT), check_lease,
        'Seconds a message sent with `lock_from="publish"` may wait holding its key, counted from '
        "the send, or from when a delayed message (`countdown`/`eta`) is due; a message no worker "
        "takes by then (a purged queue, a lost message) frees it. A retry keeps the key as long. "
        "At most the server's `--max-lease-ttl` (300 s unless raised)."),
)  # fmt: skip
"""Every lock option, once: every other listing derives from it."""

LOCK_OPTIONS: Final = tuple(spec.name for spec in LOCK_OPTION_SPECS)
SETTINGS: Final[Mapping[str, str]] = MappingProxyType(
    {spec.name: spec.setting for spec in LOCK_OPTION_SPECS if spec.setting is not None}
)
"""Lock option name -> its app-wide ``app.conf`` setting (``dflock_`` + the name)."""


def _choices(name: str) -> str:
    """An error's end for ``name``, no lock option: the close ones, then every lock option."""
    return f"{close_matches(name, LOCK_OPTIONS)} (the lock options: {', '.join(LOCK_OPTIONS)})"


@dataclass(frozen=True, slots=True)
class GivenOptions:
    """The lock options given in one place (a call, a ``dflock_task_locks`` entry, a task's
    attributes, the ``dflock_*`` settings), checked (`read_options`); None: not given there.
    One field per `LOCK_OPTION_SPECS` row, named by its `Spec.attribute`."""

    key: KeySource = None
    timeout: float | None = None
    ttl: Lease | None = None
    on_locked: OnLocked | None = None
    limit: int | None = None
    on_lock_lost: OnLockLost | None = None
    retry_countdown: float | None = None
    retry_backoff_max: float | None = None
    max_retries: int | None = None
    retry_jitter: bool | None = None
    lock_from: LockFrom | None = None
    on_duplicate: OnDuplicate | None = None
    pending_ttl: Lease | None = None

    def by_name(self) -> dict[str, object]:
        """The options given, by option name (a message's ``dflock_options`` header)."""
        return {
            spec.name: value
            for spec in LOCK_OPTION_SPECS
            if (value := getattr(self, spec.attribute)) is not None
        }


NO_OPTIONS: Final = GivenOptions()


def read_options(
    values: object, where: Callable[[str], str], *, what: str, serialisable: bool = False
) -> GivenOptions:
    """The lock options of ``values`` (option name -> value), each checked by its `Spec` and
    together (`check_combination`); in an error ``where(name)`` names each source, ``what``
    the whole. ``serialisable``: they travel in a message, so no callables."""
    if not isinstance(values, Mapping):
        raise DflockConfigError(
            f"{what} must be a mapping of lock options (e.g. {{'lock_ttl': 60}}), got {values!r}"
        )
    given = cast("Mapping[object, object]", values)
    for name, value in given.items():
        if not isinstance(name, str):
            raise DflockConfigError(f"{what}: option names must be strings, got {name!r}")
        if name not in LOCK_OPTIONS:
            raise DflockConfigError(f"{where(name)}: unknown lock option {name!r}{_choices(name)}")
        if serialisable and callable(value):
            raise DflockConfigError(
                f"{where(name)} must be serialisable (a template string), not a callable"
            )
    named = cast("Mapping[str, object]", given)
    options = GivenOptions(
        **{spec.attribute: spec.given(named, where) for spec in LOCK_OPTION_SPECS}
    )
    check_combination(options.lock_from, options.limit, what)
    return options


def read_attributes(values: Mapping[str, object], task_name: str) -> GivenOptions:
    return read_options(
        values,
        lambda name: f"attribute {name} of task {task_name!r}",
        what=f"lock options of task {task_name!r}",
    )


def items_of(what: str) -> Callable[[str], str]:
    """``where`` for the options of a mapping named ``what``: ``what['lock_ttl']``."""
    return lambda name: f"{what}[{name!r}]"


def read_call_options(values: object, what: str) -> GivenOptions:
    """Per-call lock options (``apply_async(..., lock_ttl=60)``, a message's header)."""
    return read_options(values, items_of(what), what=what, serialisable=True)


def check_combination(lock_from: LockFrom | None, limit: int | None, where: str) -> None:
    """Refuse lock options that cannot work together (``where`` names their source)."""
    if lock_from == "publish" and limit is not None:
        raise DflockConfigError(
            f"{where}: lock_from='publish' cannot be combined with "
            f"lock_limit={limit!r}: a key held from publish lets one message "
            f"of the key wait in the queue (a lock, not a semaphore); remove lock_limit, or "
            f"use lock_from='run' (a semaphore slot is taken when the run starts)"
        )


def looks_like_lock_option(name: str) -> bool:
    """Whether ``name``, no lock option, is most likely a misspelt one (``lock_tll``,
    ``on_lock``, ``lockttl``). A name close to Celery's own option ``X`` that a ``lock_X``
    option mirrors (``max_retries``) is Celery's, and passes."""
    lowered = name.lower()
    if lowered in LOCK_OPTIONS:
        return False
    if lowered.startswith(("lock_", "on_lock")):
        return True
    close = difflib.get_close_matches(lowered, LOCK_OPTIONS, n=1, cutoff=_MISSPELT)
    if not close:
        return False
    celery = close[0].removeprefix("lock_")
    return celery == close[0] or difflib.SequenceMatcher(None, lowered, celery).ratio() < _MISSPELT


_MISSPELT: Final = 0.8  # difflib's ratio from which a name is taken for a lock option's slip


def check_option_names(names: Iterable[str], where: str) -> None:
    """Refuse a name that looks like a misspelt lock option (Celery would keep it silently)."""
    for name in names:
        if looks_like_lock_option(name):
            raise DflockConfigError(f"{where}: {name!r} is not a lock option{_choices(name)}")


def check_task_locks(value: object, where: str) -> Mapping[str, GivenOptions]:
    """``dflock_task_locks``: task name -> lock options, each entry checked."""
    if not isinstance(value, Mapping):
        raise DflockConfigError(
            f"{where} must map task names to lock options, e.g. "
            "{'proj.tasks.report': {'lock_key': 'report:{customer_id}'}}; "
            f"got {value!r}"
        )
    task_locks: dict[str, GivenOptions] = {}
    for name, options in cast("Mapping[object, object]", value).items():
        if not isinstance(name, str):
            raise DflockConfigError(f"{where} keys must be task names, got {name!r}")
        entry = f"{where}[{name!r}]"
        task_locks[name] = read_options(options, items_of(entry), what=entry)
    return MappingProxyType(task_locks)


APP_SETTING_SPECS: Final = (
    _setting("dflock_servers", DEFAULT_SERVERS, parse_servers,
        '`"host:port,host:port"` or a list of `(host, port)`, each server once; keys are sharded '
        "over them. Every worker and beat of one deployment must name the same servers in the same "
        "order.", shown=repr(",".join(f"{host}:{port}" for host, port in DEFAULT_SERVERS))),
    _setting("dflock_sharding_strategy", sharding.stable_hash_shard, check_sharding,
        '`"stable_hash"` (crc32, like every dflockd client), `"rendezvous"`, `"module:function"` '
        'or a callable `(key, n_servers) -> index`; or `"cluster"`: `dflock_servers` are seeds of '
        "a cluster (`dflockd --cluster`), which says where each key lives.",
        shown=repr("stable_hash")),
    _setting("dflock_auth_token", None, partial(check_auth_token, error=DflockConfigError),
        "Shared secret, when the servers require one."),
    _setting("dflock_ssl", None, check_ssl, "`True` (TLS, system CAs) or an `ssl.SSLContext`."),
    _setting("dflock_connect_timeout", DEFAULT_CONNECT_TIMEOUT_S, check_connect_timeout,
        "Seconds to connect to a server."),
    _setting("dflock_session_ttl", DEFAULT_SESSION_TTL_S, check_session_ttl,
        "Seconds of each worker's session with a lock server, kept alive every third of it: a "
        "stall of the server, the network or the worker shorter than about two thirds of it costs "
        "no lock; a worker killed outright (not a pool child: its worker frees those at once) "
        "keeps its keys this long. At least 2, at most the server's `--max-lease-ttl`."),
    _setting("dflock_renew_ratio", DEFAULT_RENEW_RATIO,
        partial(check_renew_ratio, error=DflockConfigError),
        "Renew a held lock at this fraction of its lease."),
    _setting("dflock_key_prefix", "", check_string,
        "Put in front of every key (several projects on one server)."),
    _setting("dflock_task_locks", MappingProxyType[str, GivenOptions]({}), check_task_locks,
        "Task name -> lock options, for tasks you cannot edit (installed by "
        "`celery_dflock.signals.install(app)`).", shown="{}"),
)  # fmt: skip
"""App-wide settings that are not a lock option's default (those are in `LOCK_OPTION_SPECS`)."""
BEAT_SETTING_SPECS: Final = (
    _setting("dflock_beat_lock_key", None, partial(check_string, empty=False),
        "Key of the leader lock (with `dflock_key_prefix` in front).",
        shown=repr(DEFAULT_BEAT_KEY_PREFIX + "<app.main>")),
    _setting("dflock_beat_scheduler", None,
        lambda value, _where: value,  # a class or "module:Class": checked by celery_dflock.beat
        'The scheduler that does the work: `"module:Class"` or the class. Unset: the app\'s '
        "`beat_scheduler`, or `celery.beat:PersistentScheduler` when that names "
        "`SingletonScheduler`.", shown="beat_scheduler"),
    _setting("dflock_beat_lease_ttl", DEFAULT_BEAT_LEASE_TTL_S, check_lease,
        "Lease seconds of the leader lock: how long a hung beat blocks a failover."),
    _setting("dflock_beat_nonoverlap", False, check_bool,
        "Every task beat sends runs under a per-entry lock (`beat-entry:<entry name>`), "
        '`on_locked="skip"`, unless the task sets its own `lock_key` or `on_locked`.'),
)  # fmt: skip
"""The singleton beat's settings (read by `celery_dflock.beat.BeatSettings`)."""

APP_SETTINGS: Final = tuple(spec.name for spec in APP_SETTING_SPECS)
BEAT_SETTINGS: Final = tuple(spec.name for spec in BEAT_SETTING_SPECS)
RENAMED_SETTINGS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "dflock_default_timeout": "dflock_lock_timeout",
        "dflock_default_ttl": "dflock_lock_ttl",
        "dflock_retry_countdown": "dflock_lock_retry_countdown",
        "dflock_retry_backoff_max": "dflock_lock_retry_backoff_max",
        "dflock_max_retries": "dflock_lock_max_retries",
        "dflock_retry_jitter": "dflock_lock_retry_jitter",
    }
)
"""Old setting name -> its name now (still read, with a DeprecationWarning)."""
KNOWN_SETTINGS: Final = frozenset(
    (*APP_SETTINGS, *SETTINGS.values(), *BEAT_SETTINGS, *RENAMED_SETTINGS)
)
"""Every ``dflock_*`` setting this package reads (the old names of renamed ones too)."""


class SettingDoc(NamedTuple):
    """One app-wide or beat setting as the settings reference shows it (`setting_table`)."""

    name: str
    default: str
    meaning: str


def option_table() -> list[tuple[str, str | None, object, str]]:
    """(option, app.conf setting, default, meaning) for every lock option (for docs)."""
    return [(spec.name, spec.setting, spec.default, spec.meaning) for spec in LOCK_OPTION_SPECS]


def setting_table(kind: Literal["app", "beat"]) -> list[SettingDoc]:
    """The app-wide or beat settings with defaults and meanings (for docs)."""
    specs = APP_SETTING_SPECS if kind == "app" else BEAT_SETTING_SPECS
    return [SettingDoc(spec.name, spec.shown or repr(spec.default), spec.meaning) for spec in specs]
