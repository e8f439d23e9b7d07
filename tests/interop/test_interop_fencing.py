# pyright: reportMissingTypeStubs=false, reportAttributeAccessIssue=false, reportUnknownMemberType=false, reportUnknownVariableType=false, reportUnknownArgumentType=false, reportFunctionMemberAccess=false
# (Celery's @app.task and Django's managers are untyped.)
"""A lock from a server without fencing tokens (the real dflockd 0.5.0) has no fence
(``self.lock.fence`` is None), and each fenced store refuses the write it carries with
`FenceMissing`, writing nothing: PostgreSQL through Django and through SQLAlchemy, and Redis.
The runs are LockedTask runs, in process (eager), on a PostgreSQL schema of the test's own."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from celery_dflock import LockedTask
from celery_dflock.fencing import FenceMissing
from tests.fencing.stores import (
    ACCOUNTS,
    STORE_REDIS_URL,
    configure_django,
    create_schema,
    drop_schema,
    engine_for,
    new_schema_name,
    point_django_at,
)
from tests.interop.interop_helpers import ForeignServer
from tests.support.apps import make_app
from tests.support.services import require_postgres, require_redis


@pytest.fixture
def schema() -> Iterator[str]:
    require_postgres()
    require_redis()
    made = new_schema_name()
    create_schema(made)
    try:
        yield made
    finally:
        drop_schema(made)


def test_a_lock_without_a_fence_writes_nothing_to_any_fenced_store(
    dflockd_050: ForeignServer, schema: str
) -> None:
    from django.db import connection
    from django.db.models import F

    from celery_dflock.fencing.django import fenced_update as django_update
    from celery_dflock.fencing.redis import fence_key_of, fenced_set
    from celery_dflock.fencing.sqlalchemy import fenced_update as sqlalchemy_update

    configure_django(None)
    point_django_at(schema)
    from tests.fencing.models import Account

    engine = engine_for(schema)
    store = redis.Redis.from_url(STORE_REDIS_URL)
    key = f"fencing-interop:{uuid.uuid4().hex}"
    with engine.begin() as db:
        db.execute(sa.text("INSERT INTO account (id) VALUES (1)"))
        db.execute(sa.text("INSERT INTO fencing_account (id) VALUES (1)"))
    app = make_app("interop-fencing", eager=True, servers=[dflockd_050.address])
    fences: list[int | None] = []

    @app.task(bind=True, base=LockedTask, lock_key="fencing-interop:{where}")
    def credit(self: LockedTask, where: str) -> None:
        lock = self.lock
        assert lock is not None and lock.token  # held, on the foreign server
        fences.append(lock.fence)
        if where == "django":
            django_update(Account.objects.filter(pk=1), lock.fence, balance=F("balance") + 1)
        elif where == "sqlalchemy":
            with engine.begin() as db:
                values: dict[str, Any] = {"balance": ACCOUNTS.c.balance + 1}
                sqlalchemy_update(db, ACCOUNTS, ACCOUNTS.c.id == 1, fence=lock.fence, values=values)
        else:
            fenced_set(store, key, "written", fence=lock.fence)

    try:
        for where in ("django", "sqlalchemy", "redis"):
            with pytest.raises(FenceMissing, match="carries no fence"):
                credit.delay(where).get()
        assert fences == [None, None, None]
        with engine.connect() as db:
            for table in ("account", "fencing_account"):
                row = db.execute(sa.text(f"SELECT balance, dflock_fence FROM {table}")).one()
                assert tuple(row) == (0, 0), table
        assert store.exists(key, fence_key_of(key)) == 0
    finally:
        connection.close()
        store.close()
        engine.dispose()
        app.close()
