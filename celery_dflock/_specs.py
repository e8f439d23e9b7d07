"""The one table of every lock option and ``dflock_*`` setting: its name, the ``app.conf``
setting that gives it, its default, its check and its meaning (one `Spec` each).

The task-option resolution (`celery_dflock._plan.resolve_options`), the settings read into
`celery_dflock.config.DflockConfig` and `celery_dflock.beat.BeatSettings`, and the generated
settings reference (``docs/gen_reference.py``, through `option_table` and `setting_table`) all
read this table; a default is written here once.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Literal, NamedTuple, cast

from celery_dflock._values import (
    Check,
    DflockConfigError,
    as_given,
    check_auth,
    check_beat_lease,
    check_bool,
    check_connect_timeout,
    check_countdown,
    check_key,
    check_lease,
    check_limit_value,
    check_lock_from,
    check_max_retries,
    check_non_empty_string,
    check_on_duplicate,
    check_on_lock_lost,
    check_on_locked,
    check_renew_ratio_value,
    check_sharding,
    check_ssl,
    check_string,
    check_timeout,
    check_ttl,
    close_matches,
    parse_servers,
)
from celery_dflock.client.clients import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_RENEW_RATIO,
    DEFAULT_SERVERS,
)
from celery_dflock.client.wire import DEFAULT_MAX_LEASE_TTL_S

__all__ = [
    "APP_SETTINGS",
    "APP_SETTING_SPECS",
    "BEAT_SETTINGS",
    "BEAT_SETTING_SPECS",
    "DEFAULTS",
    "KNOWN_SETTINGS",
    "LOCK_OPTIONS",
    "LOCK_OPTION_SPECS",
    "RENAMED_SETTINGS",
    "SETTINGS",
    "SettingDoc",
    "Spec",
    "check_call_options",
    "check_combination",
    "check_option_names",
    "option_table",
    "setting_table",
    "validate_option",
]

DEFAULT_RETRY_COUNTDOWN_S: Final = 1.0
DEFAULT_RETRY_BACKOFF_MAX_S: Final = 60.0
DEFAULT_PENDING_TTL_S: Final = DEFAULT_MAX_LEASE_TTL_S
"""``lock_pending_ttl``: how long a published message may wait in the queue holding its key
(the longest lease a server grants by default, ``dflockd --max-lease-ttl``)."""
DEFAULT_BEAT_LEASE_TTL_S: Final = 10
"""Lease of beat's leader lock: a hung beat is replaced this many seconds after its last
renewal."""
DEFAULT_BEAT_KEY_PREFIX: Final = "celery-beat:"
"""Beat's leader lock key, when ``dflock_beat_lock_key`` is not set: this and ``app.main``."""
DEFAULT_BEAT_SCHEDULER: Final = "celery.beat:PersistentScheduler"
"""The scheduler beat wraps, when ``dflock_beat_scheduler`` is not set."""


@dataclass(frozen=True, slots=True)
class Spec:
    """One lock option, or one app-wide or beat setting."""

    name: str
    """The lock option (task attribute, call option, ``dflock_task_locks`` entry key); for a
    setting with no per-task option, the setting."""
    setting: str | None
    """The ``app.conf`` setting that gives it (a lock option's: its app-wide default)."""
    default: object
    """The value when nothing sets it."""
    check: Check
    """``(value, where) -> value`` normalised, or `DflockConfigError`."""
    meaning: str
    shown: str | None = None
    """The default as the settings reference shows it, when not ``repr(default)``."""

    def read(self, value: object, where: str) -> object:
        """The value as set (checked), or the default when it is unset (None)."""
        return self.default if value is None else self.check(value, where)


def _setting(
    name: str, default: object, check: Check, meaning: str, shown: str | None = None
) -> Spec:
    return Spec(name, name, default, check, meaning, shown)


# --------------------------------------------------------------------------- lock options


LOCK_OPTION_SPECS: Final = (
    Spec(
        "lock_key",
        None,
        None,
        check_key,
        "A format template over the task's arguments (defaults applied): "
        '`"report:{customer_id}"`; or a callable taking the task\'s arguments and returning '
        "the key; or `None`: the task "
        "name plus a digest of all arguments (canonical JSON, so UUID, datetime and Decimal "
        "arguments work). Keys with whitespace or over 256 bytes are made valid (readable "
        "prefix + digest).",
    ),
    Spec(
        "lock_timeout",
        "dflock_lock_timeout",
        None,
        check_timeout,
        "Seconds to wait in the key's FIFO queue before `on_locked` applies (whole seconds on "
        'the wire, rounded up). `None`: 30 s with `on_locked="retry"` (the run waits for the '
        'key in the worker, holding its pool slot, then retries), 0 with `"skip"` and '
        '`"raise"`.',
    ),
    Spec(
        "lock_ttl",
        "dflock_lock_ttl",
        None,
        check_ttl,
        "Lease in seconds (`None`: the server's, 33 s by default); renewed every "
        "`lock_ttl * dflock_renew_ratio` while the body runs.",
    ),
    Spec(
        "on_locked",
        "dflock_on_locked",
        "retry",
        check_on_locked,
        'The lock is busy: `"retry"` (sent again with a countdown, exponential backoff and '
        "jitter, up to `lock_max_retries` times, then the task fails with `LockNotAcquired` "
        'saying the retries ran out), `"skip"` (the run fails at once with `LockSkipped`) or '
        '`"raise"` (the run fails with `LockNotAcquired`).',
    ),
    Spec(
        "lock_limit",
        None,
        None,
        check_limit_value,
        "Let up to N runs per key proceed at once (a semaphore); `None`: a plain lock. A key "
        "is one resource: while runs with one limit hold it, a run with another (a lock is "
        "limit 1) is refused at once and `on_locked` applies.",
    ),
    Spec(
        "on_lock_lost",
        "dflock_on_lock_lost",
        "interrupt",
        check_on_lock_lost,
        'The lock is lost mid-run (renewal refused or server gone): `"interrupt"` raises '
        '`LockLost` in the body; `"flag"` only sets `self.lock.lost`; `"terminate"` kills a '
        "prefork pool child (elsewhere it interrupts). `lock_lost` is sent in every case.",
    ),
    Spec(
        "lock_retry_countdown",
        "dflock_lock_retry_countdown",
        DEFAULT_RETRY_COUNTDOWN_S,
        check_countdown,
        'First retry countdown of `on_locked="retry"`, doubled per retry.',
    ),
    Spec(
        "lock_retry_backoff_max",
        "dflock_lock_retry_backoff_max",
        DEFAULT_RETRY_BACKOFF_MAX_S,
        check_countdown,
        "Longest retry countdown.",
    ),
    Spec(
        "lock_max_retries",
        "dflock_lock_max_retries",
        None,
        check_max_retries,
        'Most retries of `on_locked="retry"`; `None`: retry as long as the key is busy, so no '
        "run is dropped because its key was busy. Counted apart from Celery's `retries`: the "
        "task's `max_retries` is left to its own `self.retry` calls.",
    ),
    Spec(
        "lock_retry_jitter",
        "dflock_lock_retry_jitter",
        True,
        check_bool,
        "Randomise each countdown between half and all of it.",
    ),
    Spec(
        "lock_from",
        "dflock_lock_from",
        "run",
        check_lock_from,
        '`"run"`: the key is taken when the run starts. `"publish"` (queue-once): the key is '
        "taken when the task is sent (`delay`, `apply_async`, canvas, beat) and held until its "
        "run ends, so a duplicate is never queued (`on_duplicate` says what the duplicate "
        "gets); needs celery-dflock's server. Not with `lock_limit`.",
    ),
    Spec(
        "on_duplicate",
        "dflock_on_duplicate",
        "return",
        check_on_duplicate,
        'A publish while the key is held (`lock_from="publish"`): `"return"` sends nothing '
        "and returns the `AsyncResult` of the task holding the key; "
        '`"raise"` raises `AlreadyQueued` (`.task_id`: the holder\'s).',
    ),
    Spec(
        "lock_pending_ttl",
        "dflock_lock_pending_ttl",
        DEFAULT_PENDING_TTL_S,
        check_lease,
        'Seconds a message sent with `lock_from="publish"` may wait holding its key, counted '
        "from the send (a longer `countdown`/`eta` extends it to the due time); a message no "
        "worker takes by then (a purged queue, a lost message) frees it. A retry keeps the key "
        "as long. At most the server's `--max-lease-ttl` (300 s unless raised).",
    ),
)
_BY_NAME: Final = {spec.name: spec for spec in LOCK_OPTION_SPECS}

LOCK_OPTIONS: Final = tuple(spec.name for spec in LOCK_OPTION_SPECS)
"""Every lock option name (task attribute, call option, ``dflock_task_locks`` entry key)."""
DEFAULTS: Final[Mapping[str, object]] = MappingProxyType(
    {spec.name: spec.default for spec in LOCK_OPTION_SPECS}
)
"""The built-in default of every lock option."""
SETTINGS: Final[Mapping[str, str]] = MappingProxyType(
    {spec.name: spec.setting for spec in LOCK_OPTION_SPECS if spec.setting is not None}
)
"""Lock option name -> the ``app.conf`` setting that gives its app-wide default: the option's
name with ``dflock_`` in front."""


def validate_option(name: str, value: object, where: str) -> object:
    """Check one lock option (``where`` names its source in the error), return it normalised."""
    spec = _BY_NAME.get(name)
    if spec is None:
        raise DflockConfigError(
            f"{where}: unknown lock option {name!r}{close_matches(name, LOCK_OPTIONS)} "
            f"(the lock options: {', '.join(LOCK_OPTIONS)})"
        )
    return spec.check(value, where)


def check_options(
    options: object, where: str, *, allow_callables: bool = True
) -> dict[str, object]:
    """A mapping of lock options (a ``dflock_task_locks`` entry, a call's options), checked."""
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


def check_call_options(options: Mapping[str, object], where: str) -> dict[str, object]:
    """Validate per-call lock options; they travel in a message, so no callables."""
    return check_options(options, where, allow_callables=False)


def check_combination(options: Mapping[str, object], where: str) -> None:
    """Refuse lock options that cannot work together (``where`` names their source)."""
    if options.get("lock_from") == "publish" and options.get("lock_limit") is not None:
        raise DflockConfigError(
            f"{where}: lock_from='publish' cannot be combined with "
            f"lock_limit={options['lock_limit']!r}: a key held from publish lets one message "
            f"of the key wait in the queue (a lock, not a semaphore); remove lock_limit, or "
            f"use lock_from='run' (a semaphore slot is taken when the run starts)"
        )


def looks_like_lock_option(name: str) -> bool:
    """Whether ``name``, which is no lock option, is most likely a misspelt one (``lock_tll``,
    ``on_lock``, ``lockttl``): it starts like one, or is one letter or two away from one.

    A ``lock_X`` option mirrors Celery's own task option ``X`` (``lock_retry_backoff_max`` and
    ``retry_backoff_max``, ``lock_max_retries`` and ``max_retries``): a name close to ``X``
    itself is Celery's option (or a slip in it), never a lock option missing its prefix, and
    passes through untouched."""
    lowered = name.lower()
    if lowered in LOCK_OPTIONS:
        return False
    if lowered.startswith(("lock_", "on_lock")):
        return True
    close = difflib.get_close_matches(lowered, LOCK_OPTIONS, n=1, cutoff=_MISSPELT)
    if not close:
        return False
    celerys = close[0].removeprefix("lock_")
    return celerys == close[0] or _similarity(lowered, celerys) < _MISSPELT


_MISSPELT: Final = 0.8
"""How alike (difflib's ratio) a name and a lock option are when the name is taken for a slip."""


def _similarity(a: str, b: str) -> float:
    return difflib.SequenceMatcher(None, a, b).ratio()


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


def check_task_locks(value: object, where: str) -> object:
    """``dflock_task_locks``: task name -> lock options, each entry checked."""
    if not isinstance(value, Mapping):
        raise DflockConfigError(
            f"{where} must map task names to lock options, e.g. "
            "{'proj.tasks.report': {'lock_key': 'report:{customer_id}'}}; "
            f"got {value!r}"
        )
    task_locks: dict[str, Mapping[str, object]] = {}
    for name, options in cast("Mapping[object, object]", value).items():
        if not isinstance(name, str):
            raise DflockConfigError(f"{where} keys must be task names, got {name!r}")
        task_locks[name] = check_options(options, f"{where}[{name!r}]")
    return task_locks


# --------------------------------------------------------------------------- settings

APP_SETTING_SPECS: Final = (
    _setting(
        "dflock_servers",
        DEFAULT_SERVERS,
        parse_servers,
        '`"host:port,host:port"` or a list of `(host, port)`; keys are sharded over them. Every '
        "worker and beat of one deployment must name the same servers in the same order.",
        shown=repr(",".join(f"{host}:{port}" for host, port in DEFAULT_SERVERS)),
    ),
    _setting(
        "dflock_sharding_strategy",
        None,
        check_sharding,
        '`"stable_hash"` (crc32, like every dflockd client), `"rendezvous"`, '
        '`"module:function"` or a callable `(key, n_servers) -> index`; or `"cluster"`: '
        "`dflock_servers` are seeds of a cluster (`dflockd --cluster`), which says where each "
        "key lives.",
        shown=repr("stable_hash"),
    ),
    _setting("dflock_auth_token", None, check_auth, "Shared secret, when the servers require one."),
    _setting("dflock_ssl", None, check_ssl, "`True` (TLS, system CAs) or an `ssl.SSLContext`."),
    _setting(
        "dflock_connect_timeout",
        DEFAULT_CONNECT_TIMEOUT_S,
        check_connect_timeout,
        "Seconds to connect to a server.",
    ),
    _setting(
        "dflock_renew_ratio",
        DEFAULT_RENEW_RATIO,
        check_renew_ratio_value,
        "Renew a held lock at this fraction of its lease.",
    ),
    _setting(
        "dflock_key_prefix",
        "",
        check_string,
        "Put in front of every key (several projects on one server).",
    ),
    _setting(
        "dflock_task_locks",
        MappingProxyType[str, Mapping[str, object]]({}),
        check_task_locks,
        "Task name -> lock options, for tasks you cannot edit (installed by "
        "`celery_dflock.signals.install(app)`).",
        shown="{}",
    ),
)
"""App-wide settings that are not a lock option's default (those are in `LOCK_OPTION_SPECS`)."""
BEAT_SETTING_SPECS: Final = (
    _setting(
        "dflock_beat_lock_key",
        None,
        check_non_empty_string,
        "Key of the leader lock (with `dflock_key_prefix` in front).",
        shown=repr(DEFAULT_BEAT_KEY_PREFIX + "<app.main>"),
    ),
    _setting(
        "dflock_beat_scheduler",
        DEFAULT_BEAT_SCHEDULER,
        as_given,  # a class or "module:Class": resolved and checked by celery_dflock.beat
        'The scheduler that does the work: `"module:Class"` or the class.',
    ),
    _setting(
        "dflock_beat_lease_ttl",
        DEFAULT_BEAT_LEASE_TTL_S,
        check_beat_lease,
        "Lease seconds of the leader lock: how long a hung beat blocks a failover.",
    ),
    _setting(
        "dflock_beat_nonoverlap",
        False,
        check_bool,
        "Every task beat sends runs under a per-entry lock (`beat-entry:<entry name>`), "
        '`on_locked="skip"`.',
    ),
)
"""The singleton beat's settings (read by `celery_dflock.beat.BeatSettings`)."""

APP_SETTINGS: Final = tuple(spec.name for spec in APP_SETTING_SPECS)
"""App-wide settings that are not a lock option's default (see `SETTINGS` for those)."""
BEAT_SETTINGS: Final = tuple(spec.name for spec in BEAT_SETTING_SPECS)
"""The singleton beat's settings (read by :mod:`celery_dflock.beat`)."""
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
"""Old setting name -> its name now; the old names are still read, with a DeprecationWarning."""
KNOWN_SETTINGS: Final = frozenset(
    (*APP_SETTINGS, *SETTINGS.values(), *BEAT_SETTINGS, *RENAMED_SETTINGS)
)
"""Every ``dflock_*`` setting this package reads (the old names of renamed ones too)."""


# --------------------------------------------------------------------------- for the docs


class SettingDoc(NamedTuple):
    """One app-wide or beat setting as the settings reference shows it (`setting_table`)."""

    name: str
    default: str
    meaning: str


def option_table() -> list[tuple[str, str | None, object, str]]:
    """(option, app.conf setting, default, meaning) for every lock option (for docs)."""
    return [(spec.name, spec.setting, spec.default, spec.meaning) for spec in LOCK_OPTION_SPECS]


def setting_table(kind: Literal["app", "beat"]) -> list[SettingDoc]:
    """The app-wide (``"app"``) or beat (``"beat"``) settings with defaults and meanings, for
    the generated settings reference (lock options' settings: :func:`option_table`)."""
    specs = APP_SETTING_SPECS if kind == "app" else BEAT_SETTING_SPECS
    return [
        SettingDoc(
            spec.name, repr(spec.default) if spec.shown is None else spec.shown, spec.meaning
        )
        for spec in specs
    ]
