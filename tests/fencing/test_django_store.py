# pyright: reportMissingTypeStubs=false, reportUnknownMemberType=false, reportUnknownVariableType=false, reportUnknownArgumentType=false, reportAttributeAccessIssue=false
# (Django is untyped: its managers and querysets read as unknown.)
"""`celery_dflock.fencing.django` against a real PostgreSQL through Django's ORM (psycopg 3),
configured in-process, on a schema of each test's own."""

from __future__ import annotations

import pytest

from celery_dflock.fencing import FenceMissing, StaleFence


@pytest.fixture
def account(django_schema: str) -> int:
    from tests.fencing.models import Account

    Account.objects.create(id=7, balance=0)
    return 7


def state(account: int) -> tuple[int, int]:
    from tests.fencing.models import Account

    found = Account.objects.get(pk=account)
    return found.balance, found.dflock_fence


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
