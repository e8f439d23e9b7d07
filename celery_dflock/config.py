# pyright: reportMissingTypeStubs=false
"""The ``dflock_*`` settings of an app, read once into a :class:`DflockConfig` (cached on the
app), and the names the settings reference and its checks use.

Every lock option and setting, with its default and its check, is declared once, in the table
of `celery_dflock._specs` (`option_table`, `setting_table`). A lock option is resolved the way
Celery resolves its own task options, first match wins (`celery_dflock._plan`):

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
import ssl
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Final, Protocol

from celery_dflock._specs import (
    APP_SETTING_SPECS,
    APP_SETTINGS,
    BEAT_SETTINGS,
    DEFAULTS,
    KNOWN_SETTINGS,
    LOCK_OPTIONS,
    RENAMED_SETTINGS,
    SETTINGS,
    Spec,
    option_table,
    setting_table,
    validate_option,
)
from celery_dflock._values import DflockConfigError, parse_servers
from celery_dflock.client.clients import (
    DEFAULT_CONNECT_TIMEOUT_S,
    DEFAULT_RENEW_RATIO,
    DEFAULT_SERVERS,
    Client,
    ClientSettings,
    check_servers,
)
from celery_dflock.client.sharding import Routing, stable_hash_shard

__all__ = [
    "APP_SETTINGS",
    "BEAT_SETTINGS",
    "DEFAULTS",
    "LOCK_OPTIONS",
    "RENAMED_SETTINGS",
    "SETTINGS",
    "DflockConfig",
    "DflockConfigError",
    "check_setting_names",
    "get_config",
    "option_table",
    "parse_servers",
    "read_setting",
    "read_settings",
    "reset_config",
    "setting_table",
]

_CONFIG_ATTR: Final = "_dflock_config"
_FIELDS: Final = {
    "dflock_servers": "servers",
    "dflock_auth_token": "auth_token",
    "dflock_ssl": "ssl_context",
    "dflock_connect_timeout": "connect_timeout_s",
    "dflock_renew_ratio": "renew_ratio",
    "dflock_sharding_strategy": "sharding_strategy",
    "dflock_key_prefix": "key_prefix",
    "dflock_task_locks": "task_locks",
}
"""App-wide setting -> the `DflockConfig` field it is read into (checked, see `_specs`)."""


class _App(Protocol):
    """The part of a Celery app this module reads."""

    @property
    def conf(self) -> Any: ...


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


def read_settings(conf: Any, specs: tuple[Spec, ...]) -> dict[str, object]:
    """Setting name -> its value in ``conf``, checked, or its default when unset."""
    return {spec.name: spec.read(read_setting(conf, spec.name), spec.name) for spec in specs}


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
    task_locks: Mapping[str, Mapping[str, object]] = field(
        default_factory=lambda: MappingProxyType({})
    )
    """``dflock_task_locks``: task name -> lock options."""

    @classmethod
    def from_conf(cls, conf: Any) -> DflockConfig:
        """Read and validate the ``dflock_*`` settings of a Celery ``app.conf``."""
        check_setting_names(conf)
        got = read_settings(conf, APP_SETTING_SPECS)
        defaults = dict(DEFAULTS)
        for option, setting in SETTINGS.items():
            value = read_setting(conf, setting)
            if value is not None:
                defaults[option] = validate_option(option, value, f"app.conf.{setting}")
        fields: dict[str, Any] = {field: got[name] for name, field in _FIELDS.items()}
        return cls(**fields, defaults=defaults)

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
