"""The dflock_* settings and the resolution order of lock options: no worker needed."""

from __future__ import annotations

import collections.abc
import types
from dataclasses import fields
from typing import Any, Literal, Union, cast, get_args, get_origin, get_type_hints

import pytest
from celery import Celery
from celery.exceptions import ImproperlyConfigured

from celery_dflock._settings import (
    LOCK_OPTION_SPECS,
    LOCK_OPTIONS,
    NO_OPTIONS,
    GivenOptions,
    option_table,
    parse_servers,
    read_attributes,
    read_call_options,
)
from celery_dflock.client.clients import Client, Lease, lease_seconds
from celery_dflock.config import (
    DflockConfig,
    DflockConfigError,
    LockOptions,
    get_config,
    reset_config,
    resolve_options,
)
from celery_dflock.task import LockedTask
from tests.support.apps import make_app


def config_app(**settings: Any) -> Celery:
    return make_app("cfgtest", settings)


def attributes(**values: object) -> GivenOptions:
    """Task attributes of a task named 't', checked as a run's plan checks them."""
    return read_attributes(values, "t")


def call_options(**values: object) -> GivenOptions:
    """Per-call options of task 't', checked as a run reads them from its message."""
    return read_call_options(values, "call options of task 't'")


def test_defaults_without_any_setting() -> None:
    config = get_config(config_app())
    assert config.client.servers == (("127.0.0.1", 6388),)
    options = resolve_options(config, "t", NO_OPTIONS)
    assert options.on_locked == "retry"
    assert options.on_lock_lost == "interrupt"
    assert options.timeout == 30  # on_locked="retry" waits in the key's queue first
    assert options.ttl is None
    assert options.limit is None
    assert options.key is None
    for policy in ("skip", "raise"):  # these give up at once
        assert resolve_options(config, "t", attributes(on_locked=policy)).timeout == 0
    assert resolve_options(config, "t", attributes(lock_timeout=0)).timeout == 0


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("a:1,b:2", (("a", 1), ("b", 2))),
        (" a:1 , b:2 ,", (("a", 1), ("b", 2))),
        ([("a", 1), ("b", 2)], (("a", 1), ("b", 2))),
        (["a:1", ["b", "2"]], (("a", 1), ("b", 2))),
        (("a", 1), (("a", 1),)),
        ("[::1]:6388", (("::1", 6388),)),
    ],
)
def test_servers_forms(value: object, expected: tuple[tuple[str, int], ...]) -> None:
    assert parse_servers(value) == expected


@pytest.mark.parametrize("value", ["a", "a:0", "a:70000", "a:x", "", [], 5, [("a",)], ":1"])
def test_bad_servers_name_the_setting(value: object) -> None:
    with pytest.raises(DflockConfigError, match="dflock_servers"):
        parse_servers(value)


@pytest.mark.parametrize(
    "value", ["dflockd://127.0.0.1:6388", "tcp://a:1,b:2", ["b:2", ("redis://a", 1)], "my host:1"]
)
def test_a_server_written_as_a_url_is_refused_at_start_naming_the_setting(value: object) -> None:
    """``dflockd://host:port`` (written like ``broker_url``) was accepted: every run then met
    'cannot reach the lock server at dflockd://host:port' and was retried as an outage."""
    with pytest.raises(ImproperlyConfigured, match=r"^dflock_servers: server host '.*' is not a"):
        get_config(config_app(dflock_servers=value))


@pytest.mark.parametrize("value", ["a:1,b:2,a:1", [("a", 1), ("A", 1)], ["a:1", ("a", "1")]])
def test_a_server_listed_twice_is_refused_naming_it(value: object) -> None:
    """A key's server is its index in the list: a second entry for one server would skew the
    sharding against a worker that lists it once, so it is refused, not merged."""
    with pytest.raises(DflockConfigError, match=r"dflock_servers: server a:1 is listed twice"):
        parse_servers(value)


@pytest.mark.parametrize(
    ("setting", "value", "match"),
    [
        ("dflock_lock_ttl", 0, "dflock_lock_ttl must be between 1 and"),
        ("dflock_lock_ttl", 1.5, "whole number"),
        ("dflock_lock_timeout", -1, "dflock_lock_timeout must be >= 0"),
        ("dflock_on_locked", "wait", "dflock_on_locked must be one of 'retry', 'skip', 'raise'"),
        ("dflock_on_lock_lost", "ignore", "'interrupt', 'flag', 'terminate'"),
        ("dflock_renew_ratio", 1.5, "dflock_renew_ratio"),
        ("dflock_auth_token", "", "dflock_auth_token"),
        # a secret read from a file with its newline: named as the setting, not `auth_token`
        ("dflock_auth_token", "s3cret\n", "^dflock_auth_token must not contain line breaks"),
        ("dflock_auth_token", "x" * 70_000, "^dflock_auth_token is longer than the protocol"),
        ("dflock_ssl", "yes", "dflock_ssl"),
        ("dflock_servers", "nohost", "dflock_servers"),
        ("dflock_task_locks", ["x"], "dflock_task_locks must map"),
        (
            "dflock_task_locks",
            {"t": {"lock_tll": 5}},
            "unknown lock option 'lock_tll'; did you mean 'lock_ttl'?",
        ),
        ("dflock_task_locks", {"t": {"lock_limit": 0}}, r"\['t'\]\['lock_limit'\]"),
        ("dflock_sharding_strategy", "nope", "dflock_sharding_strategy"),
        ("dflock_sharding_strategy", ".relative:shard", "dflock_sharding_strategy: cannot import"),
        ("dflock_sharding_strategy", lambda key: 0, "cannot be called as"),
        ("dflock_connect_timeout", 0, "dflock_connect_timeout"),
        ("dflock_connect_timeout", 1e12, "dflock_connect_timeout .* up to 9000000000"),
        ("dflock_lock_retry_jitter", "yes", "dflock_lock_retry_jitter"),
    ],
)
def test_bad_settings_raise_improperly_configured_naming_the_setting(
    setting: str, value: object, match: str
) -> None:
    with pytest.raises(ImproperlyConfigured, match=match):
        get_config(config_app(**{setting: value}))


def test_resolution_order_call_then_task_locks_then_attribute_then_conf_then_default() -> None:
    config = get_config(
        config_app(
            dflock_lock_ttl=10,
            dflock_on_locked="skip",
            dflock_task_locks={"t": {"lock_timeout": 3}},
        )
    )
    attrs = attributes(lock_timeout=2, lock_ttl=20, on_locked=None)
    resolved = resolve_options(config, "t", attrs)
    assert resolved.timeout == 3  # dflock_task_locks beats the attribute
    assert resolved.ttl == 20  # the attribute beats app.conf
    assert resolved.on_locked == "skip"  # app.conf beats the default
    assert resolved.on_lock_lost == "interrupt"  # the default
    called = resolve_options(config, "t", attrs, call_options(lock_timeout=1, lock_ttl=5))
    assert (called.timeout, called.ttl) == (1, 5)
    other = resolve_options(config, "other", attrs)
    assert other.timeout == 2
    # beat's non-overlap (a message of a beat entry) ranks below the attribute, above app.conf
    beat = call_options(lock_key="beat-entry:e", on_locked="raise", lock_ttl=30)
    from_beat = resolve_options(config, "other", attrs, None, beat)
    assert (from_beat.key, from_beat.on_locked, from_beat.ttl) == ("beat-entry:e", "raise", 20)
    # None is not set (docs/locked-tasks.md): it does not undo an app-wide setting
    unset = resolve_options(config, "other", attributes(lock_ttl=None), call_options(lock_ttl=None))
    assert unset.ttl == 10


def test_lock_ttl_is_checked_once_where_it_enters_and_the_client_takes_it_as_it_is() -> None:
    """Issue 53: ``lock_ttl`` is checked where it enters (app.conf, the task attribute, the
    call option) and carried as a checked ``Lease``; the client's own check hands a ``Lease``
    back untouched, so the value is not checked a second time on its way to the socket."""
    config = get_config(config_app(dflock_lock_ttl=10))
    assert type(config.defaults.ttl) is Lease
    resolved = resolve_options(config, "t", attributes(lock_ttl=20))
    assert type(resolved.ttl) is Lease and resolved.ttl == 20
    called = resolve_options(config, "t", attributes(), call_options(lock_ttl=5))
    assert type(called.ttl) is Lease
    assert lease_seconds("lease_ttl_s", called.ttl) is called.ttl  # no second check
    plain = lease_seconds("lease_ttl_s", 7)  # a user's int is checked, then carried the same
    assert type(plain) is Lease and plain == 7
    with pytest.raises(DflockConfigError, match="lock_ttl"):
        resolve_options(config, "t", attributes(lock_ttl=0))
    client = Client([("127.0.0.1", 1)])
    try:
        client.lock("k", lease_ttl_s=called.ttl)  # taken as it is: a Lease is checked
    finally:
        client.close()


def test_bad_attribute_and_call_option_name_their_source() -> None:
    config = DflockConfig()
    with pytest.raises(DflockConfigError, match="attribute lock_limit of task 't'"):
        attributes(lock_limit=-1)
    with pytest.raises(DflockConfigError, match=r"call options of task 't'\['on_locked'\]"):
        call_options(on_locked="later")
    with pytest.raises(DflockConfigError, match="lock_from='publish' cannot be combined"):
        resolve_options(config, "t", attributes(lock_limit=2), call_options(lock_from="publish"))


def test_config_is_cached_on_the_app_until_reset() -> None:
    app = config_app(dflock_servers="a:1")
    first = get_config(app)
    assert get_config(app) is first
    app.conf.dflock_servers = "b:2"
    assert get_config(app).client.servers == (("a", 1),)
    reset_config(app)
    assert get_config(app).client.servers == (("b", 2),)


SAMPLES: dict[str, object] = {
    "lock_key": "k:{x}",
    "lock_timeout": 7.0,
    "lock_ttl": 9,
    "on_locked": "skip",
    "lock_limit": 3,
    "on_lock_lost": "flag",
    "lock_retry_countdown": 2.0,
    "lock_retry_backoff_max": 5.0,
    "lock_max_retries": 4,
    "lock_retry_jitter": False,
    "lock_from": "publish",
    "on_duplicate": "raise",
    "lock_pending_ttl": 11,
}
"""A value other than the default for every lock option."""


def fits(value: object, hint: object) -> bool:
    """Whether ``value`` is of the type ``hint`` (the hints the option shapes use)."""
    origin = get_origin(hint)
    if origin in {Union, types.UnionType}:
        return any(fits(value, arg) for arg in get_args(hint))
    if origin is Literal:
        return value in get_args(hint)
    if origin is collections.abc.Callable:
        return callable(value)
    return value is None if hint is type(None) else isinstance(value, cast("type", hint))


def test_each_lock_option_is_defined_once_and_every_listing_derives_from_it() -> None:
    """Issue 71, acceptance 4: ``LOCK_OPTION_SPECS`` is the one list of lock options. The
    typed shapes (`GivenOptions`, `LockOptions`) have one field per row, of the row's type;
    the names, defaults, settings, the reference's table and `LockedTask`'s attributes come
    from it; reading and resolving carry each option through. An option added in one place
    and forgotten in another fails here."""
    names = [spec.name for spec in LOCK_OPTION_SPECS]
    attrs = [spec.attribute for spec in LOCK_OPTION_SPECS]
    assert list(LOCK_OPTIONS) == names == [row[0] for row in option_table()]
    assert set(SAMPLES) == set(names)
    assert [field.name for field in fields(GivenOptions)] == attrs
    assert [field.name for field in fields(LockOptions)] == [*attrs, "timeout_given"]
    given, resolved = get_type_hints(GivenOptions), get_type_hints(LockOptions)
    attributes_of_task = {
        name: hint
        for name, hint in get_type_hints(LockedTask).items()
        if name in LockedTask.__annotations__
    }
    assert list(attributes_of_task) == names  # LockedTask's own annotations: one per option
    for spec in LOCK_OPTION_SPECS:
        attr, value = spec.attribute, SAMPLES[spec.name]
        assert given[attr] == resolved[attr] | None, spec.name  # "not given" is the one None
        assert fits(spec.default, resolved[attr] | None), spec.name  # (lock_timeout's is None)
        assert LockedTask.__dict__[spec.name] is None, spec.name
        (as_set,) = get_args(attributes_of_task[spec.name])  # ClassVar[X]: what a user sets
        assert fits(value, as_set) and fits(None, as_set), spec.name
        one = attributes(**{spec.name: value})
        assert fits(getattr(one, attr), given[attr]) and one.by_name() == {spec.name: value}
        assert call_options(**{spec.name: value}).by_name() == {spec.name: value}
        options = resolve_options(DflockConfig(), "t", one)
        assert getattr(options, attr) == value and fits(getattr(options, attr), resolved[attr])
        unset = resolve_options(DflockConfig(), "t", NO_OPTIONS)
        assert getattr(unset, attr) == (30.0 if attr == "timeout" else spec.default), spec.name
