"""Lock keys from task arguments (acceptance 5): no worker needed."""

from __future__ import annotations

import datetime
import decimal
import os
import uuid
from typing import Any, cast

import pytest
from kombu.utils.json import dumps, loads

from celery_dflock.keys import (
    DIGEST_SEPARATOR,
    KeyBuilder,
    KeyDerivationError,
    check_template,
    safe_key,
)
from celery_dflock.task import LockedTask
from dflockd_server.constants import MAX_LINE_BYTES
from dflockd_server.testing import ServerThread
from tests.support.apps import make_app


def report(customer_id: int, kind: str = "daily", *, fmt: str = "pdf") -> None:
    """A task body stand-in."""


def key_of(source: Any, *args: Any, **kwargs: Any) -> str:
    return KeyBuilder(source, task_name="proj.report", run=report).key(args, kwargs)


def assert_protocol_safe(key: str) -> None:
    assert key
    assert len(key.encode("utf-8")) <= MAX_LINE_BYTES
    assert not any(ch.isspace() for ch in key)


def test_positional_and_keyword_calls_with_defaults_give_the_same_default_key() -> None:
    keys = {
        key_of(None, 7),
        key_of(None, 7, "daily"),
        key_of(None, customer_id=7),
        key_of(None, 7, kind="daily", fmt="pdf"),
        key_of(None, kind="daily", customer_id=7),
    }
    assert len(keys) == 1
    (key,) = keys
    assert key.startswith("proj.report:")
    assert_protocol_safe(key)


def test_positional_and_keyword_calls_give_the_same_template_key() -> None:
    template = "report:{customer_id}:{kind}"
    assert key_of(template, 7) == key_of(template, customer_id=7, kind="daily") == "report:7:daily"


def test_different_arguments_give_different_keys() -> None:
    assert key_of(None, 7) != key_of(None, 8)
    assert key_of(None, 7) != key_of(None, 7, "weekly")
    assert key_of(None, 7) != key_of(None, 7, fmt="csv")
    assert key_of(None, 1) != key_of(None, "1")


def test_uuid_datetime_and_decimal_arguments_work_and_survive_serialisation() -> None:
    value = (
        uuid.UUID("12345678-1234-5678-1234-567812345678"),
        datetime.datetime(2024, 5, 6, 7, 8, 9, tzinfo=datetime.UTC),
        decimal.Decimal("10.50"),
    )
    before = key_of(None, value[0], kind=str(value[1]), fmt=str(value[2]))
    assert_protocol_safe(before)
    direct = key_of(None, {"u": value[0], "d": value[1], "m": value[2]})
    # The worker sees the arguments after a JSON round trip through kombu.
    after = key_of(None, loads(dumps({"u": value[0], "d": value[1], "m": value[2]})))
    assert direct == after
    assert key_of(None, {"m": decimal.Decimal("10.5")}) != key_of(None, {"m": 10.5})


def test_template_with_spaces_becomes_a_valid_distinct_key() -> None:
    a = key_of("report {customer_id} {kind}", 7)
    b = key_of("report_{customer_id}_{kind}", 7)
    assert_protocol_safe(a)
    assert a.startswith("report_7_daily" + DIGEST_SEPARATOR)
    assert a != b


def test_long_keys_are_digested_keeping_a_readable_prefix() -> None:
    long_a = "tenant:" + "x" * 400 + "a"
    long_b = "tenant:" + "x" * 400 + "b"
    ka, kb = safe_key(long_a), safe_key(long_b)
    assert_protocol_safe(ka)
    assert_protocol_safe(kb)
    assert ka != kb
    assert ka.startswith("tenant:xxx")
    # Multi-byte characters are never cut in half.
    kc = safe_key("é" * 300)
    assert_protocol_safe(kc)
    kc.encode("utf-8").decode("utf-8")


def test_valid_keys_are_kept_as_they_are() -> None:
    assert safe_key("report:7") == "report:7"
    exact = "k" * MAX_LINE_BYTES
    assert safe_key(exact) == exact
    assert safe_key("") != ""


def test_callable_key_takes_the_task_arguments() -> None:
    def by_customer(customer_id: int, kind: str = "daily", *, fmt: str = "pdf") -> str:
        return f"cust {customer_id}"

    key = key_of(by_customer, 7)
    assert_protocol_safe(key)
    assert key.startswith("cust_7")


def test_callable_returning_a_non_string_is_a_clear_error() -> None:
    with pytest.raises(KeyDerivationError, match="returned int, expected str"):
        key_of(lambda *a, **k: 5, 7)


def test_template_naming_an_unknown_argument_is_a_clear_error() -> None:
    with pytest.raises(KeyDerivationError, match=r"customer\b.*not among the task's arguments"):
        key_of("report:{customer}", 7)
    with pytest.raises(
        KeyDerivationError, match=r"\{customer\}.*its signature is report\(customer_id, kind"
    ):
        check_template("report:{customer}", report, task_name="proj.report")
    with pytest.raises(KeyDerivationError, match="positional field"):
        check_template("report:{0}", report, task_name="proj.report")
    check_template("report:{customer_id}:{kind}", report, task_name="proj.report")


@pytest.mark.parametrize(
    ("template", "customer_id", "says"),
    [
        ("report:{customer_id:d}", None, "TypeError: unsupported format string"),
        ("report:{customer_id[0]}", 7, "TypeError: 'int' object is not subscriptable"),
        ("report:{customer_id:d}", "x", "ValueError: Unknown format code 'd'"),
        ("report:{customer_id.region}", 7, "AttributeError: 'int' object has no attribute"),
    ],
)
def test_a_template_that_cannot_format_the_arguments_is_a_clear_error(
    template: str, customer_id: object, says: str
) -> None:
    """A template valid as a format string whose fields do not fit the values given: a raw
    TypeError came out of the run, and the others were said to be no format string or to name
    no argument."""
    with pytest.raises(KeyDerivationError) as failure:
        key_of(template, customer_id)
    assert str(failure.value).startswith(
        f"lock_key template {template!r} of task 'proj.report' cannot be filled from the "
        f"task's arguments (customer_id, fmt, kind): {says}"
    )


def test_arguments_that_do_not_match_the_signature_are_a_clear_error() -> None:
    with pytest.raises(KeyDerivationError, match="do not match its signature"):
        key_of(None, 1, 2, 3, 4)


def test_unserialisable_arguments_ask_for_a_lock_key() -> None:
    with pytest.raises(KeyDerivationError, match="set lock_key"):
        key_of(None, object())


def test_prefix_is_applied_to_every_key_source() -> None:
    for source in (None, "report:{customer_id}", lambda *a, **k: "x"):
        key = KeyBuilder(source, task_name="proj.report", run=report, prefix="app1:").key((7,), {})
        assert key.startswith("app1:")


def test_binding_collects_var_positional_and_var_keyword() -> None:
    def f(a: int, *rest: int, **extra: int) -> None: ...

    template = "{a}:{rest[0]}:{rest[1]}:{extra[z]}"
    assert KeyBuilder(template, task_name="t", run=f).key((1, 2, 3), {"z": 4}) == "1:2:3:4"


def test_a_file_name_that_is_not_utf8_makes_a_valid_key_and_the_task_runs(
    dflock_server: ServerThread,
) -> None:
    """A name from the file system that is not UTF-8 (``os.fsdecode`` keeps its bytes as lone
    surrogates, and JSON carries them) failed the run with a raw ``UnicodeEncodeError`` from
    the key, in a template and in the default key alike."""
    name = os.fsdecode(b"report-\xff.csv")
    other = os.fsdecode(b"report-\xfe.csv")
    for source in ("file:{customer_id}", None):
        keys = {key_of(source, name), key_of(source, other), key_of(source, "report-?.csv")}
        assert len(keys) == 3  # never collapsed into one
        for key in keys:
            assert_protocol_safe(key)
            key.encode("utf-8")  # the wire's text
    app = make_app("keys-fs", eager=True, servers=dflock_server)

    @app.task(shared=False, base=LockedTask, lock_key="file:{path}")
    def ingest(path: str) -> str:
        return f"ingested {path!r}"

    @app.task(shared=False, base=LockedTask)
    def ingest_default(path: str) -> str:
        return f"ingested {path!r}"

    task: Any = ingest
    default: Any = ingest_default
    assert task(name) == f"ingested {name!r}"
    assert default(name) == f"ingested {name!r}"
    app.close()


def account_key(account_id: int, verbose: bool = False) -> str:
    return f"account:{account_id}"


def test_a_function_given_as_lock_key_takes_the_tasks_arguments(
    dflock_server: ServerThread,
) -> None:
    """``@app.task(base=LockedTask, lock_key=some_function)``, as the docs give it: Celery makes
    every option a class attribute of the task, where a function becomes a method, so the
    key function was called with the task in front of the arguments: a run failed ("takes 1
    positional argument but 2 were given"), or, where the task fitted a parameter, took a key
    of its own."""
    app = make_app("keys-callable", eager=True, servers=dflock_server)

    @app.task(shared=False, base=LockedTask, lock_key=account_key)
    def refresh(account_id: int, verbose: bool = False) -> str | None:
        lock = cast("Any", refresh).lock  # this run's lock
        return None if lock is None else str(lock.key)

    @app.task(
        shared=False, bind=True, base=LockedTask, lock_key=lambda account_id: f"a:{account_id}"
    )
    def refresh_bound(self: Any, account_id: int) -> str | None:
        lock = self.lock
        return None if lock is None else str(lock.key)

    @app.task(shared=False, bind=True, base=LockedTask, lock_key=account_key)
    def report(self: Any, account_id: int, verbose: bool = False) -> str | None:
        lock = self.lock
        return None if lock is None else str(lock.key)

    plain: Any = refresh
    bound: Any = refresh_bound
    named: Any = report
    # the key was "account:<@task: ... at 0x7f...>", the task's repr with its address: a key
    # of its own in every worker process, so two runs of one account never excluded each other
    assert plain(7) == "account:7"
    assert bound(7) == "a:7"
    assert named(8, verbose=True) == "account:8"
    app.close()


class _KeyedReport(LockedTask):
    """A class-based task whose ``lock_key`` is a function set as a class attribute."""

    name = "tests.keyed_report"
    lock_key = account_key

    def run(self, account_id: int, verbose: bool = False) -> str | None:
        lock = self.lock
        return None if lock is None else str(lock.key)


class _Keyed(LockedTask):
    abstract = True
    lock_key = account_key


class _KeyedByMethod(LockedTask):
    """A class-based task whose ``lock_key`` is a method written in its body: it keeps its
    ``self``."""

    name = "tests.keyed_by_method"
    region = "eu"

    def lock_key(self, account_id: int) -> str:  # pyright: ignore[reportIncompatibleVariableOverride]
        return f"{self.region}:{account_id}"

    def run(self, account_id: int) -> str | None:
        lock = self.lock
        return None if lock is None else str(lock.key)


def test_a_function_set_as_a_class_attribute_lock_key_takes_the_tasks_arguments(
    dflock_server: ServerThread,
) -> None:
    """ "Every option ... per task (``@app.task(...)`` or a class attribute)": a function set as
    the ``lock_key`` class attribute, on the task's class or a base it inherits from, is a
    method there too; it got the task in front of the arguments (KeyDerivationError)."""
    app = make_app("keys-class-attribute", eager=True, servers=dflock_server)
    report: Any = app.register_task(_KeyedReport())

    @app.task(shared=False, base=_Keyed)
    def refresh(account_id: int) -> str | None:
        lock = cast("Any", refresh).lock
        return None if lock is None else str(lock.key)

    inherited: Any = refresh
    by_method: Any = app.register_task(_KeyedByMethod())
    assert report.apply(args=(7,)).get() == "account:7"
    assert inherited.apply(args=(8,)).get() == "account:8"
    assert by_method.apply(args=(9,)).get() == "eu:9"
    app.close()
