# pyright: reportMissingTypeStubs=false, reportAttributeAccessIssue=false, reportUnknownMemberType=false, reportUnknownVariableType=false, reportUnknownArgumentType=false
# (Celery's @app.task and Django's managers are untyped.)
"""The Celery app of the paused-holder tests: one locked task that writes to a fenced store.

Workers load it as ``-A tests.fencing.fencing_app``, configured like the apps of tests/celery
(settings as JSON in the environment, the run log through ``record``), with the PostgreSQL
schema of the test module in ``DFLOCK_FENCING_SCHEMA``. Django is configured here, at import,
before the pool forks (no connection is opened until a child's first query).

:func:`credit` takes ``fencing:<store>:<account>``, logs ``granted`` with its fence, waits for
its go file (if any: the test holds the run there, then stops its worker), then writes ``+1``
to the account through the store's fenced write with ``self.lock.fence`` and logs ``applied``.
A refused write fails the run with `StaleFence`, which its result carries. The stores: the
updates of an existing row (``django``, ``sqlalchemy``, ``redis``), the inserts-or-updates
(``django-upsert``, ``sqlalchemy-upsert``), and the asyncio faces from an async task body, the
way a Celery task runs async code, ``asyncio.run(...)`` (``sqlalchemy-aio``: an upsert through
psycopg 3's async driver; ``redis-aio``: ``redis.asyncio``).
"""

from __future__ import annotations

import asyncio
import functools
import os
import time
from pathlib import Path

import redis
import redis.asyncio
import sqlalchemy as sa

from celery_dflock import LockedTask
from tests.celery.apps.common import record, worker_app
from tests.fencing.stores import (
    ACCOUNTS,
    CREDIT,
    SCHEMA_ENV,
    STORE_REDIS_URL,
    async_engine_for,
    configure_django,
    engine_for,
    redis_key,
)

LEASE_S = 2
"""The runs' lease (renewed every second while a run is not stopped)."""
GO_POLL_S = 0.02
STEP_LIMIT_S = 60.0

configure_django(os.environ[SCHEMA_ENV])
app = worker_app("tests.fencing.fencing_app")


@functools.cache
def _engine() -> sa.Engine:
    """This process's engine (made in the pool child, after the fork)."""
    return engine_for(os.environ[SCHEMA_ENV])


@functools.cache
def _redis() -> redis.Redis:
    return redis.Redis.from_url(STORE_REDIS_URL)


def _wait(go_file: str | None) -> None:
    if go_file is None:
        return
    deadline = time.monotonic() + STEP_LIMIT_S
    while not Path(go_file).exists() and time.monotonic() < deadline:
        time.sleep(GO_POLL_S)


async def _write_async(store: str, account: int, label: str, fence: int | None) -> None:
    """``+1`` to ``account`` through an asyncio face (its client made and closed on this
    run's loop)."""
    if store == "sqlalchemy-aio":
        from celery_dflock.fencing.sqlalchemy_aio import fenced_upsert

        engine = async_engine_for(os.environ[SCHEMA_ENV])
        try:
            async with engine.begin() as db:
                await fenced_upsert(
                    db,
                    ACCOUNTS,
                    key={"id": account},
                    fence=fence,
                    values={"balance": 1},
                    update={"balance": ACCOUNTS.c.balance + 1},
                )
        finally:
            await engine.dispose()
    else:
        from celery_dflock.fencing.redis_aio import fenced_hset

        client = redis.asyncio.Redis.from_url(STORE_REDIS_URL)
        try:
            key = redis_key(os.environ[SCHEMA_ENV], account)
            await fenced_hset(client, key, {"writer": label}, fence=fence)
            await client.incr(f"{key}:writes")
        finally:
            await client.aclose()


def _write(store: str, account: int, label: str, fence: int | None) -> None:
    """``+1`` to ``account`` in ``store``, fenced: the line a task writes."""
    if store.endswith("-aio"):
        asyncio.run(_write_async(store, account, label, fence))
    elif store == "django-upsert":
        from django.db.models import F

        from celery_dflock.fencing.django import fenced_upsert as django_upsert
        from tests.fencing.models import Account

        update = {"balance": F("balance") + 1}
        django_upsert(Account, fence, key={"id": account}, values={"balance": 1}, update=update)
    elif store == "sqlalchemy-upsert":
        from celery_dflock.fencing.sqlalchemy import fenced_upsert

        with _engine().begin() as db:
            fenced_upsert(
                db,
                ACCOUNTS,
                key={"id": account},
                fence=fence,
                values={"balance": 1},
                update={"balance": ACCOUNTS.c.balance + 1},
            )
    elif store == "django":
        from django.db.models import F

        from celery_dflock.fencing.django import fenced_update
        from tests.fencing.models import Account

        fenced_update(Account.objects.filter(pk=account), fence, balance=F("balance") + 1)
    elif store == "sqlalchemy":
        from celery_dflock.fencing.sqlalchemy import fenced_update

        with _engine().begin() as db:
            fenced_update(
                db,
                ACCOUNTS,
                ACCOUNTS.c.id == account,
                fence=fence,
                values={"balance": ACCOUNTS.c.balance + 1},
            )
    else:
        from celery_dflock.fencing.redis import fenced_hset

        key = redis_key(os.environ[SCHEMA_ENV], account)
        fenced_hset(_redis(), key, {"writer": label}, fence=fence)
        _redis().incr(f"{key}:writes")  # counts the writes that landed


@app.task(
    bind=True,
    base=LockedTask,
    name=CREDIT,
    lock_key="fencing:{store}:{account}",
    lock_ttl=LEASE_S,
    lock_timeout=30,
    on_locked="raise",
    on_lock_lost="flag",
)
def credit(
    self: LockedTask, store: str, account: int, label: str, go_file: str | None = None
) -> int:
    lock = self.lock
    assert lock is not None
    record("granted", label=label, fence=lock.fence, task_id=self.request.id)
    _wait(go_file)
    _write(store, account, label, lock.fence)
    record("applied", label=label, fence=lock.fence, lost=lock.lost)
    return 1
