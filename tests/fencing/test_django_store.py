# pyright: reportMissingTypeStubs=false, reportUnknownMemberType=false, reportUnknownVariableType=false, reportUnknownArgumentType=false, reportAttributeAccessIssue=false
# (Django is untyped: its managers and querysets read as unknown.)
"""`celery_dflock.fencing.django` against a real PostgreSQL through Django's ORM (psycopg 3),
configured in-process, on a schema of each test's own."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from celery_dflock.client.errors import InvalidValueError
from celery_dflock.fencing import FenceMissing, StaleFence
from tests.fencing.stores import (
    MARIADB_ALIAS,
    REPLICA_ALIAS,
    SQLITE_ALIAS,
    mariadb_database,
    point_django_alias_at,
    postgres_database,
)
from tests.support.services import require_mariadb


@pytest.fixture
def account(django_schema: str) -> int:
    from tests.fencing.models import Account

    Account.objects.create(id=7, balance=0)
    return 7


def state(account: int, using: str = "default") -> tuple[int, int]:
    from tests.fencing.models import Account

    found = Account.objects.using(using).get(pk=account)
    return found.balance, found.dflock_fence


@pytest.fixture(params=["postgresql", "sqlite", "mariadb"])
def alias(request: pytest.FixtureRequest, django_schema: str, tmp_path: Path) -> Iterator[str]:
    """A Django database alias with the model's table, on each database whose upsert is
    written (PostgreSQL is ``default``, on this test's schema)."""
    from django.db import connections

    from tests.fencing.models import Account

    if request.param == "postgresql":
        yield "default"
        return
    if request.param == "mariadb":
        require_mariadb()
    with mariadb_database() if request.param == "mariadb" else _sqlite(tmp_path) as name:
        used = MARIADB_ALIAS if request.param == "mariadb" else SQLITE_ALIAS
        point_django_alias_at(used, name)
        with connections[used].schema_editor() as editor:
            editor.create_model(Account)
        try:
            yield used
        finally:
            connections[used].close()


@contextlib.contextmanager
def _sqlite(tmp_path: Path) -> Iterator[str]:
    yield str(tmp_path / "fenced.db")


def test_a_write_with_a_fence_at_least_the_rows_lands_and_keeps_it(account: int) -> None:
    from django.db.models import F

    from celery_dflock.fencing.django import fenced_update
    from tests.fencing.models import Account

    assert state(account) == (0, 0)  # a new row: fence_field()'s default
    rows = Account.objects.filter(pk=account)
    assert fenced_update(rows, 100, balance=F("balance") + 1) == 1
    assert fenced_update(rows, 100, balance=F("balance") + 1) == 1  # the same holder again
    assert fenced_update(rows, 250, balance=F("balance") + 1) == 1
    assert state(account) == (3, 250)


def test_a_lower_fence_is_refused_and_nothing_is_written(account: int) -> None:
    from celery_dflock.fencing.django import fenced_update
    from tests.fencing.models import Account

    rows = Account.objects.filter(pk=account)
    fenced_update(rows, 250, balance=1)
    with pytest.raises(StaleFence, match=r"fence 249 is lower than 250") as refused:
        fenced_update(rows, 249, balance=1000)
    assert state(account) == (1, 250)
    assert "fencing.Account" in str(refused.value) and '"id" = 7' in str(refused.value)
    # Setting the fence field itself would move it anywhere, back included (it said: update()
    # got multiple values for keyword argument 'dflock_fence').
    with pytest.raises(ValueError, match="the field 'dflock_fence' holds the fence"):
        fenced_update(rows, 250, balance=2, dflock_fence=1)
    assert state(account) == (1, 250)


def test_a_write_without_a_fence_is_refused_and_nothing_is_written(account: int) -> None:
    """``lock.fence`` is None on a lock server without fencing tokens: refused, not applied."""
    from celery_dflock.fencing.django import fenced_update
    from tests.fencing.models import Account

    with pytest.raises(FenceMissing, match="carries no fence"):
        fenced_update(Account.objects.filter(pk=account), None, balance=1000)
    assert state(account) == (0, 0)


def test_a_model_stands_for_all_its_rows_and_no_row_updates_nothing(account: int) -> None:
    from celery_dflock.fencing.django import fenced_update
    from tests.fencing.models import Account

    assert fenced_update(Account.objects.filter(pk=8), 5, balance=1) == 0
    assert fenced_update(Account, 5, balance=2) == 1
    assert fenced_update(Account.objects, 6, balance=3) == 1
    with pytest.raises(StaleFence):
        fenced_update(Account, 4, balance=4)
    assert state(account) == (3, 6)
    with pytest.raises(TypeError, match="a queryset, a manager or a model, not str"):
        fenced_update("Account", 7, balance=5)


def test_the_migration_adds_the_field_with_0_for_existing_rows(django_schema: str) -> None:
    """What ``makemigrations`` writes for ``dflock_fence = fence_field()`` on an existing model
    (an ``AddField``), applied by the schema editor as ``migrate`` applies it."""
    from django.db import connection, models

    from celery_dflock.fencing.django import fence_field

    class Legacy(models.Model):
        name = models.TextField()

        class Meta:
            app_label = "fencing"
            db_table = "fencing_legacy"

    with connection.schema_editor() as editor:
        editor.create_model(Legacy)
    Legacy.objects.create(name="old")
    field = fence_field()
    field.set_attributes_from_name("dflock_fence")
    with connection.schema_editor() as editor:
        editor.add_field(Legacy, field)
    with connection.cursor() as cursor:
        cursor.execute("SELECT dflock_fence FROM fencing_legacy")
        assert cursor.fetchall() == [(0,)]


def test_an_upsert_inserts_then_updates_only_under_a_fence_not_lower(alias: str) -> None:
    from django.db.models import F

    from celery_dflock.client.errors import InvalidValueError
    from celery_dflock.fencing.django import fenced_upsert
    from tests.fencing.models import Account

    def credit(fence: int | None, amount: int = 1) -> None:
        fenced_upsert(
            Account,
            fence,
            key={"id": 9},
            values={"balance": amount},
            update={"balance": F("balance") + amount},
            using=alias,
        )

    credit(100, amount=5)
    assert state(9, alias) == (5, 100)
    credit(100)  # the same holder again: accepted
    credit(250)
    assert state(9, alias) == (7, 250)
    with pytest.raises(StaleFence, match="its fence 249 is lower than 250") as refused:
        credit(249, amount=1000)
    assert "fencing.Account row id=9" in str(refused.value)
    with pytest.raises(FenceMissing):
        credit(None)
    assert state(9, alias) == (7, 250)
    fenced_upsert(Account, 300, key={"id": 9}, values={"balance": 0}, using=alias)  # the row
    assert state(9, alias) == (0, 300)
    with pytest.raises(ValueError, match="the field 'dflock_fence' holds the fence"):
        fenced_upsert(Account, 301, key={"id": 9}, values={"dflock_fence": 1})
    with pytest.raises(InvalidValueError, match="key id is None"):
        fenced_upsert(Account, 301, key={"id": None}, values={"balance": 1}, using=alias)
    with pytest.raises(InvalidValueError, match="values give the key's id another value"):
        fenced_upsert(Account, 301, key={"id": 9}, values={"id": 10, "balance": 1}, using=alias)
    assert state(9, alias) == (0, 300)
    with pytest.raises(TypeError, match="takes a model class, not QuerySet"):
        fenced_upsert(Account.objects.all(), 301, key={"id": 9}, values={"balance": 1})


def test_the_upserts_fence_never_goes_back(alias: str) -> None:
    import random

    from celery_dflock.fencing.django import fenced_upsert
    from tests.fencing.models import Account

    fences = list(range(1, 31))
    random.Random(72).shuffle(fences)
    highest = 0
    for fence in fences:
        try:
            fenced_upsert(Account, fence, key={"id": 1}, values={"balance": fence}, using=alias)
        except StaleFence as refused:
            assert fence < highest and refused.highest == highest
        else:
            assert fence > highest
            highest = fence
        assert state(1, alias) == (highest, highest)


def test_a_model_without_the_fence_field_is_named_with_the_lines_that_add_it(
    django_schema: str,
) -> None:
    from django.db import connection, models

    from celery_dflock.fencing import FenceColumnMissing
    from celery_dflock.fencing.django import (
        check_fence_field,
        fence_field,
        fenced_update,
        fenced_upsert,
    )
    from tests.fencing.models import Account

    class Plain(models.Model):
        name = models.TextField()

        class Meta:
            app_label = "fencing"
            db_table = "fencing_plain"

    with pytest.raises(FenceColumnMissing) as missing:
        fenced_update(Plain.objects.filter(pk=1), 5, name="x")
    said = str(missing.value)
    assert "fencing.Plain: the model has no field 'dflock_fence'" in said
    assert "add dflock_fence = fence_field() (from celery_dflock.fencing.django) to Plain" in said
    assert "manage.py makemigrations fencing and manage.py migrate" in said
    with pytest.raises(FenceColumnMissing, match="the model has no field"):
        fenced_upsert(Plain, 5, key={"id": 1}, values={"name": "x"})
    # Without a fence, both say the fence is missing: the fence is checked before the model.
    with pytest.raises(FenceMissing):
        fenced_update(Plain.objects.filter(pk=1), None, name="x")
    with pytest.raises(FenceMissing):
        fenced_upsert(Plain, None, key={"id": 1}, values={"name": "x"})

    # The model has the field, its migration was not applied: the database's error, named.
    class Unmigrated(models.Model):
        name = models.TextField()
        dflock_fence = fence_field()

        class Meta:
            app_label = "fencing"
            db_table = "fencing_plain"

    with connection.schema_editor() as editor:
        editor.create_model(Plain)
    Plain.objects.create(id=1, name="old")
    with pytest.raises(FenceColumnMissing) as missing:
        fenced_update(Unmigrated.objects.filter(pk=1), 5, name="x")
    assert "its table 'fencing_plain' has no column 'dflock_fence' in the database" in str(
        missing.value
    )
    assert "manage.py migrate" in str(missing.value)
    with pytest.raises(FenceColumnMissing, match="has no column 'dflock_fence' in the database"):
        fenced_upsert(Unmigrated, 5, key={"id": 1}, values={"name": "x"})
    assert Plain.objects.get(pk=1).name == "old"

    # The deploy's check, before a task writes: every model at once.
    check_fence_field(Account)
    with pytest.raises(TypeError, match="check_fence_field takes a model class, not str"):
        check_fence_field("fencing.Account")  # it said: 'str' object has no attribute '_meta'
    with pytest.raises(FenceColumnMissing) as missing:
        check_fence_field(Account, Plain, Unmigrated)
    said = str(missing.value)
    assert said.startswith("fenced models not ready: fencing.Plain has no field 'dflock_fence'")
    assert "fencing.Unmigrated's table 'fencing_plain' has no column 'dflock_fence'" in said

    class Uncreated(models.Model):  # a model whose migration never ran: no table at all
        dflock_fence = fence_field()

        class Meta:
            app_label = "fencing"
            db_table = "fencing_uncreated"

    with pytest.raises(FenceColumnMissing) as missing:  # it said: relation ... does not exist
        check_fence_field(Account, Uncreated)
    assert str(missing.value) == (
        "fenced models not ready: fencing.Uncreated's table 'fencing_uncreated' is not in the "
        "database: run manage.py makemigrations fencing and manage.py migrate (an AddField: "
        "existing rows get 0)"
    )


def test_an_upsert_whose_key_names_no_unique_key_is_not_silent(alias: str) -> None:
    """MariaDB's ``ON DUPLICATE KEY UPDATE`` takes a conflict on any unique key: an upsert
    whose ``key`` is no unique key of the row (here ``balance``) met row 9 on its primary key
    and, refused by its fence, wrote nothing, then found no row at its key and returned as if
    it had written. PostgreSQL and SQLite refuse such a key themselves: that refusal names the
    key and what to do (it was the driver's raw error)."""
    from celery_dflock.client.errors import InvalidValueError
    from celery_dflock.fencing.django import fenced_upsert
    from tests.fencing.models import Account

    Account.objects.using(alias).create(id=9, balance=7, dflock_fence=250)
    for fence in (100, 300):  # refused by row 9's fence; accepted by it (and rolled back)
        with pytest.raises(InvalidValueError) as error:
            fenced_upsert(Account, fence, key={"balance": 1}, values={"id": 9}, using=alias)
        if alias == MARIADB_ALIAS:
            assert "another row on a unique key other than key" in str(error.value)
        else:
            assert "key names balance, which is not the primary key or a unique key" in str(
                error.value
            )
    assert state(9, alias) == (7, 250)


def test_a_row_whose_fence_is_null_is_not_passed_over_in_silence(account: int) -> None:
    """A fence column made nullable by hand: NULL compares with no fence, so the guarded
    ``UPDATE`` wrote nothing and the call answered 0, as for no row."""
    from django.db import connection

    from celery_dflock.client.errors import InvalidValueError
    from celery_dflock.fencing.django import fenced_update, fenced_upsert
    from tests.fencing.models import Account

    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE fencing_account ALTER COLUMN dflock_fence DROP NOT NULL")
        cursor.execute("UPDATE fencing_account SET dflock_fence = NULL")
    with pytest.raises(InvalidValueError, match="holds NULL"):
        fenced_update(Account.objects.filter(pk=account), 5, balance=1)
    with pytest.raises(InvalidValueError, match="holds NULL"):
        fenced_upsert(Account, 5, key={"id": account}, values={"balance": 1})
    assert Account.objects.get(pk=account).balance == 0


def test_a_name_that_is_no_field_of_the_model_is_named_with_its_fields(account: int) -> None:
    """A misspelt field raised Django's ``FieldDoesNotExist: Account has no field named
    'balanse'``, which is no ValueError and said nothing of the model's fields; as the
    SQLAlchemy face names the table's columns."""
    from celery_dflock.fencing.django import fenced_update, fenced_upsert
    from tests.fencing.models import Account

    fields = "(its fields: id, balance, dflock_fence); name the model's fields"
    for call, where in (
        (lambda: fenced_update(Account.objects.filter(pk=account), 5, balanse=1), "values"),
        (lambda: fenced_upsert(Account, 5, key={"idd": 7}, values={"balance": 1}), "key"),
        (lambda: fenced_upsert(Account, 5, key={"id": 7}, values={"balanse": 1}), "values"),
        (
            lambda: fenced_upsert(Account, 5, key={"id": 7}, values={}, update={"balanse": 1}),
            "update",
        ),
    ):
        with pytest.raises(InvalidValueError) as refused:
            call()
        said = str(refused.value)
        assert f": {where} names " in said and "which is no field of fencing.Account" in said
        assert said.endswith(fields), said
    assert state(account) == (0, 0)


@pytest.mark.parametrize("alias", ["mariadb"], indirect=True)
def test_a_stale_update_after_a_read_in_its_transaction_is_refused(alias: str) -> None:
    """A paused holder that read the row in its transaction, then wrote once a later holder
    had, on MariaDB at its own default isolation, repeatable read (Django's default there is
    read committed): the check of the refused ``UPDATE`` read the row's fence from the
    transaction's snapshot, older than the later holder's, so the call returned 0, as for a
    row that is not there."""
    import sqlalchemy as sa
    from django.db import connections, transaction

    from celery_dflock.fencing.django import fenced_update
    from tests.fencing.models import Account
    from tests.support.services import MARIADB_URL

    atomic: Any = transaction.atomic  # untyped
    connection = connections[alias]
    connection.close()
    connection.settings_dict["OPTIONS"] = {"isolation_level": "repeatable read"}
    later = sa.create_engine(
        f"mysql+pymysql://{urlsplit(MARIADB_URL).netloc}/{connection.settings_dict['NAME']}"
    )
    try:
        Account.objects.using(alias).create(id=7, balance=0)
        rows = Account.objects.using(alias).filter(pk=7)
        with atomic(using=alias):
            assert rows.get().balance == 0
            with later.begin() as db:  # the later holder's write, committed
                db.execute(sa.text("UPDATE fencing_account SET balance = 100, dflock_fence = 250"))
            with pytest.raises(StaleFence, match=r"fence 249 is lower than 250"):
                fenced_update(rows, 249, balance=1000)
        assert state(7, alias) == (100, 250)
    finally:
        later.dispose()
        connection.close()
        connection.settings_dict["OPTIONS"] = {}


@pytest.fixture
def replica(django_schema: str) -> Iterator[str]:
    """A PostgreSQL database of this test's own with the model's table, on Django's alias
    ``REPLICA_ALIAS``, standing for a replica of ``default`` that lags; dropped after."""
    from django.db import connections

    from tests.fencing.models import Account

    with postgres_database() as name:
        point_django_alias_at(REPLICA_ALIAS, name)
        try:
            with connections[REPLICA_ALIAS].schema_editor() as editor:
                editor.create_model(Account)
            yield REPLICA_ALIAS
        finally:
            connections[REPLICA_ALIAS].close()


class _ReadsFromTheReplica:
    """A primary/replica router: reads go to the replica, writes to ``default``."""

    def db_for_read(self, model: object, **hints: object) -> str:
        return REPLICA_ALIAS

    def db_for_write(self, model: object, **hints: object) -> str:
        return "default"


def test_a_refusal_is_told_from_no_row_on_the_database_written_not_a_lagging_replica(
    account: int, replica: str
) -> None:
    """With a router that reads from a replica, the check of a refused ``UPDATE`` (routed to
    the primary) read the replica: a stale write to a row whose copy there was older, or not
    there yet, returned 0, as for a row that is not there, and a row deleted from the primary
    but not yet from the replica raised `StaleFence` for a fence the primary never held."""
    from django.test import override_settings

    from celery_dflock.fencing.django import fenced_update, fenced_upsert
    from tests.fencing.models import Account

    fenced_update(Account.objects.filter(pk=account), 250, balance=1)  # the primary's row 7
    Account.objects.create(id=8, balance=1, dflock_fence=250)  # not on the replica yet
    Account.objects.using(replica).create(id=account, balance=0, dflock_fence=100)  # older
    Account.objects.using(replica).create(id=9, balance=0, dflock_fence=300)  # deleted since
    with override_settings(DATABASE_ROUTERS=[_ReadsFromTheReplica()]):
        for pk in (account, 8):
            with pytest.raises(StaleFence, match=r"fence 249 is lower than 250"):
                fenced_update(Account.objects.filter(pk=pk), 249, balance=1000)
        assert fenced_update(Account.objects.filter(pk=9), 5, balance=1000) == 0  # no row
        with pytest.raises(StaleFence, match=r"fence 249 is lower than 250"):  # as given
            fenced_update(Account.objects.using("default").filter(pk=8), 249, balance=1000)
        with pytest.raises(StaleFence, match=r"fence 249 is lower than 250"):
            fenced_upsert(Account, 249, key={"id": account}, values={"balance": 1000})
    assert [state(pk) for pk in (account, 8)] == [(1, 250), (1, 250)]
    assert not Account.objects.filter(pk=9).exists()
    assert [state(pk, replica) for pk in (account, 9)] == [(0, 100), (0, 300)]
