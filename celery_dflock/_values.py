# pyright: reportMissingTypeStubs=false
"""The checks of setting and option values, and `DflockConfigError`.

Each check takes ``(value, where)`` (``where`` names the setting or option, and where it was
given) and returns the value normalised, or raises `DflockConfigError` saying what would be
accepted. The table of options and settings (`celery_dflock._specs`) names a check for each.
"""

from __future__ import annotations

import difflib
import importlib
import math
import ssl
from collections.abc import Callable, Iterable
from typing import Final, Literal, cast, get_args

from celery.exceptions import ImproperlyConfigured

from celery_dflock.client import sharding
from celery_dflock.client.clients import (
    check_auth_token,
    check_limit,
    check_renew_ratio,
    check_servers,
    positive_seconds,
)
from celery_dflock.client.errors import InvalidValueError
from celery_dflock.client.sharding import Routing
from celery_dflock.client.wire import MAX_NUMBER

__all__ = [
    "DflockConfigError",
    "LockFrom",
    "OnDuplicate",
    "OnLockLost",
    "OnLocked",
    "close_matches",
    "parse_servers",
]

OnLocked = Literal["retry", "skip", "raise"]
"""What a run does when its lock is busy (after the ``lock_timeout`` FIFO wait)."""
OnLockLost = Literal["interrupt", "flag", "terminate"]
"""What happens to a running body whose lock was lost."""
LockFrom = Literal["run", "publish"]
"""When a task's key is taken: when its run starts, or when it is published (queue-once)."""
OnDuplicate = Literal["return", "raise"]
"""What a publish does while the key is held (``lock_from="publish"``)."""

Check = Callable[[object, str], object]
"""A check: ``(value, where) -> value`` normalised, or `DflockConfigError`."""


class DflockConfigError(InvalidValueError, ImproperlyConfigured):
    """A ``dflock_*`` setting or a lock option has a value that cannot work.

    A `celery_dflock.DflockError` (and `ValueError`), and Celery's ``ImproperlyConfigured``.
    """


def close_matches(name: str, known: Iterable[str]) -> str:
    """``"; did you mean 'a' or 'b'?"`` for the names of ``known`` close to ``name``, or ``""``."""
    close = difflib.get_close_matches(name, sorted(known), n=3, cutoff=0.75)
    return f"; did you mean {' or '.join(map(repr, close))}?" if close else ""


# --------------------------------------------------------------------------- numbers


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


def check_timeout(value: object, where: str) -> object:
    if value is None:
        return None
    return _number(value, where, minimum=0, integer=False)


def check_ttl(value: object, where: str) -> object:
    if value is None:
        return None
    return check_lease(value, where)


def check_lease(value: object, where: str) -> object:
    """Whole seconds > 0."""
    return int(_number(value, where, minimum=0, integer=True, exclusive_min=True))


def check_countdown(value: object, where: str) -> object:
    return float(_number(value, where, minimum=0, integer=False))


def check_limit_value(value: object, where: str) -> object:
    return check_limit(value, where, error=DflockConfigError)


def check_max_retries(value: object, where: str) -> object:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise DflockConfigError(
            f"{where} must be None (retry while the key is busy, no limit) or a whole number "
            f"of retries >= 0; got {value!r}"
        )
    return value


def check_beat_lease(value: object, where: str) -> object:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DflockConfigError(f"{where} must be a whole number of seconds >= 1, got {value!r}")
    return value


def check_connect_timeout(value: object, where: str) -> object:
    return positive_seconds(where, cast("float", value), error=DflockConfigError)


def check_renew_ratio_value(value: object, where: str) -> object:
    return check_renew_ratio(value, where, error=DflockConfigError)


# --------------------------------------------------------------------------- words


def check_key(value: object, where: str) -> object:
    if value is None or isinstance(value, str) or callable(value):
        return value
    raise DflockConfigError(
        f"{where} must be a format template (str), a callable taking the task's arguments, "
        f"or None for the default key; got {value!r}"
    )


def one_of(choices: tuple[str, ...], meanings: str | None = None) -> Check:
    """A check that the value is one of ``choices`` (``meanings``: the error's own words for
    them, e.g. ``"'run' (...) or 'publish' (...)"``)."""
    accepted = meanings or ", ".join(map(repr, choices))
    lead = "" if meanings else "one of "

    def check(value: object, where: str) -> object:
        if value not in choices:
            raise DflockConfigError(f"{where} must be {lead}{accepted}; got {value!r}")
        return value

    return check


check_on_locked: Final = one_of(get_args(OnLocked))
check_on_lock_lost: Final = one_of(get_args(OnLockLost))
check_lock_from: Final = one_of(
    get_args(LockFrom),
    "'run' (the key is taken when the run starts) or 'publish' (taken when the task is sent, "
    "held until its run ends: queue-once)",
)
check_on_duplicate: Final = one_of(
    get_args(OnDuplicate),
    "'return' (the duplicate publish returns the queued task's AsyncResult) or 'raise' (it "
    "raises AlreadyQueued)",
)


def check_bool(value: object, where: str) -> object:
    if not isinstance(value, bool):
        raise DflockConfigError(f"{where} must be True or False, got {value!r}")
    return value


def check_string(value: object, where: str) -> object:
    if not isinstance(value, str):
        raise DflockConfigError(f"{where} must be a string, got {value!r}")
    return value


def check_non_empty_string(value: object, where: str) -> object:
    if not isinstance(value, str) or not value.strip():
        raise DflockConfigError(f"{where} must be a non-empty string, got {value!r}")
    return value


def check_auth(value: object, where: str) -> object:
    return check_auth_token(value, where, error=DflockConfigError)


def as_given(value: object, where: str) -> object:
    """No check here: the value is checked where it is used (named in the table)."""
    del where
    return value


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


def check_sharding(value: object, where: str) -> Routing:
    if callable(value):
        return cast("Callable[[str, int], int]", value)
    if isinstance(value, str):
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
