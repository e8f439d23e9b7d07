# pyright: reportMissingTypeStubs=false
"""The ``dflock_*`` settings of an app, read once into a `DflockConfig` (cached on the
app), and a run's lock options resolved from them (`LockOptions`, `resolve_options`).

Every lock option and setting, with its default and its check, is declared once, in the table
of `celery_dflock._settings`. A lock option resolves as Celery resolves its own task options,
first match wins: per call, the task's ``dflock_task_locks`` entry (as ``task_annotations``, it
lets an operator lock or tune a task without editing it), the task attribute, the app-wide
``dflock_*`` setting, the default ([Locked tasks](../locked-tasks.md)). Bad values raise
`DflockConfigError` naming the setting or option.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final

from celery_dflock import _settings
from celery_dflock._settings import (
    LOCK_OPTION_SPECS,
    LOCK_OPTIONS,
    NO_OPTIONS,
    RENAMED_SETTINGS,
    SETTINGS,
    DflockConfigError,
    GivenOptions,
    check_combination,
    close_matches,
    option_table,
    setting_table,
)
from celery_dflock.client.clients import Client, ClientSettings, Lease

__all__ = [
    "LOCK_OPTIONS", "RENAMED_SETTINGS", "RETRY_WAIT_S", "SETTINGS", "DflockConfig",
    "DflockConfigError", "GivenOptions", "LockOptions", "check_setting_names", "get_config",
    "option_table", "read_settings", "reset_config", "resolve_options", "setting_table",
]  # fmt: skip

_CONFIG_ATTR: Final = "_dflock_config"
_CLIENT_FIELDS: Final = {
    "dflock_servers": "servers", "dflock_auth_token": "auth_token", "dflock_ssl": "ssl_context",
    "dflock_connect_timeout": "connect_timeout_s", "dflock_session_ttl": "session_ttl_s",
    "dflock_renew_ratio": "renew_ratio", "dflock_sharding_strategy": "sharding_strategy",
}  # fmt: skip
"""App-wide setting -> the `ClientSettings` field it is read into."""


def _spelt(conf: Any, name: str) -> tuple[str, object]:
    """(the spelling of setting ``name`` that ``conf`` has, its value); (``name``, None):
    unset. The upper-case spelling is read too (``DFLOCK_SERVERS``; with ``namespace="CELERY"``
    Celery maps ``CELERY_DFLOCK_SERVERS`` to ``dflock_servers``); an old name's spelling warns.
    Two spellings set to different values are refused: which one counts would be a guess."""
    old = [old for old, renamed in RENAMED_SETTINGS.items() if renamed == name]
    spellings = (name, name.upper(), *old, *(o.upper() for o in old))
    given = [
        (spelling, value) for spelling in spellings if (value := conf.get(spelling)) is not None
    ]
    if not given:
        return name, None
    spelling, value = given[0]
    if other := next(((s, v) for s, v in given[1:] if v != value), None):
        raise DflockConfigError(
            f"app.conf.{spelling}={value!r} and app.conf.{other[0]}={other[1]!r} are one "
            f"setting ({name}) given twice: set one of them"
        )
    if spelling.lower() != name:
        warnings.warn(
            f"app.conf.{spelling} is deprecated: rename it to {name} (each lock "
            f"option's app-wide setting is its name with dflock_ in front)",
            DeprecationWarning,
            stacklevel=3,
        )
    return spelling, value


def check_setting_names(conf: Any, namespace: str | None = None) -> None:
    """Refuse a ``dflock_*`` setting (any case; with the app's ``namespace``, ``CELERY``, also
    ``CELERY_DFLOCK_*``) that this package does not read."""
    spaced = f"{namespace.lower()}_" if namespace else ""
    for name in map(str, list(conf.keys())):
        lowered = name.lower().removeprefix(spaced)
        if not lowered.startswith("dflock_") or lowered in _settings.KNOWN_SETTINGS:
            continue
        current = sorted(_settings.KNOWN_SETTINGS - RENAMED_SETTINGS.keys())
        raise DflockConfigError(
            f"app.conf.{name} is not a celery-dflock setting"
            f"{close_matches(lowered, current, cutoff=0.6)} (the settings: {', '.join(current)})"
        )


def read_settings(conf: Any, specs: tuple[_settings.Spec[Any], ...]) -> dict[str, Any]:
    """Setting name -> its value in ``conf``, checked, or its default when unset."""
    return {spec.name: spec.read(_spelt(conf, spec.name)[1], spec.name) for spec in specs}


@dataclass(frozen=True, slots=True)
class DflockConfig:
    """Every ``dflock_*`` setting of one app, validated (see `get_config`)."""

    client: ClientSettings = field(default_factory=ClientSettings)
    """The settings of this app's `Client` (servers, sharding, auth, TLS, times)."""
    key_prefix: str = ""
    defaults: GivenOptions = NO_OPTIONS
    """The app-wide lock options: the ``dflock_*`` setting of each (None: not set)."""
    task_locks: Mapping[str, GivenOptions] = field(default_factory=lambda: MappingProxyType({}))
    """``dflock_task_locks``: task name -> lock options."""

    @classmethod
    def from_conf(cls, conf: Any, namespace: str | None = None) -> DflockConfig:
        """Read and validate the ``dflock_*`` settings of a Celery ``app.conf`` (``namespace``:
        the app's, as `check_setting_names` takes it)."""
        check_setting_names(conf, namespace)
        got = read_settings(conf, _settings.APP_SETTING_SPECS)
        spelt = {option: _spelt(conf, setting) for option, setting in SETTINGS.items()}
        defaults = _settings.read_options(
            {option: value for option, (_, value) in spelt.items()},
            lambda option: f"app.conf.{spelt[option][0]}",
            what="the dflock_* settings",
        )
        client = ClientSettings(**{field: got[name] for name, field in _CLIENT_FIELDS.items()})
        return cls(client, got["dflock_key_prefix"], defaults, got["dflock_task_locks"])

    def new_client(self) -> Client:
        """A new `Client` on these settings."""
        return Client.from_settings(self.client)


def get_config(app: Any) -> DflockConfig:
    """The app's `DflockConfig`, read on first use and cached on the app: change
    ``dflock_*`` settings before the first locked task runs, or call `reset_config` after."""
    config: object = getattr(app, _CONFIG_ATTR, None)
    if not isinstance(config, DflockConfig):
        config = DflockConfig.from_conf(app.conf, getattr(app, "namespace", None))
        setattr(app, _CONFIG_ATTR, config)
    return config


def reset_config(app: Any) -> None:
    """Forget the cached config: the next `get_config` reads ``app.conf`` again."""
    if hasattr(app, _CONFIG_ATTR):
        delattr(app, _CONFIG_ATTR)


RETRY_WAIT_S: Final = 30.0
"""The default ``lock_timeout`` of ``on_locked="retry"`` (``"skip"`` and ``"raise"``: 0)."""


@dataclass(frozen=True, slots=True)
class LockOptions:
    """The lock options of one task run, every layer resolved (`resolve_options`): one field
    per `LOCK_OPTION_SPECS` row, as `GivenOptions`, and `timeout_given`."""

    key: _settings.KeySource
    timeout: float
    ttl: Lease | None
    on_locked: _settings.OnLocked
    limit: int | None
    on_lock_lost: _settings.OnLockLost
    retry_countdown: float
    retry_backoff_max: float
    max_retries: int | None
    retry_jitter: bool
    lock_from: _settings.LockFrom
    on_duplicate: _settings.OnDuplicate
    pending_ttl: Lease
    timeout_given: bool
    """Whether ``lock_timeout`` was set (False: ``timeout`` is the policy's default)."""


def resolve_options(
    config: DflockConfig,
    task_name: str,
    attributes: GivenOptions,
    call: GivenOptions | None = None,
    beat: GivenOptions | None = None,
) -> LockOptions:
    """Resolve every lock option: call > dflock_task_locks > attribute > beat's non-overlap >
    app.conf > default (every layer was checked where it entered)."""
    entry = config.task_locks.get(task_name, NO_OPTIONS)
    layers = (call or NO_OPTIONS, entry, attributes, beat or NO_OPTIONS, config.defaults)
    first: dict[str, Any] = {
        spec.attribute: next(
            (value for layer in layers if (value := getattr(layer, spec.attribute)) is not None),
            spec.default,
        )
        for spec in LOCK_OPTION_SPECS
    }
    check_combination(first["lock_from"], first["limit"], f"lock options of task {task_name!r}")
    given = first["timeout"] is not None
    if not given:
        first["timeout"] = RETRY_WAIT_S if first["on_locked"] == "retry" else 0.0
    return LockOptions(**first, timeout_given=given)
