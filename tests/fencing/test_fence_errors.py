"""The errors a fenced write gives instead of the misleading ones it gave (issue 72): a client of
the other face named with the face to use, a table without the fence column named with the
line that adds it, and a refusal that says another key may have written the row; against the
real stores and lock server."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis
import redis.asyncio
import sqlalchemy as sa
from sqlalchemy.orm import Session

from celery_dflock.client import DistributedLock
from celery_dflock.client.errors import InvalidValueError
from celery_dflock.fencing import (
    FenceColumnMissing,
    FenceMissing,
    StaleFence,
    redis as redis_fencing,
    redis_aio,
    sqlalchemy_aio,
)
from celery_dflock.fencing.sqlalchemy import (
    add_fence_column,
    check_fence_column,
    fence_column,
    fenced_update,
    fenced_upsert,
)
from dflockd_server.testing import ServerThread
from tests.fencing.stores import ACCOUNTS, STORE_REDIS_URL, async_engine_for


async def test_the_blocking_sqlalchemy_face_names_the_async_one(pg_schema: str) -> None:
    """It said ``AttributeError: 'coroutine' object has no attribute 'rowcount'``."""
    engine = async_engine_for(pg_schema)
    try:
        async with engine.begin() as db:
            with pytest.raises(
                TypeError,
                match=r"fenced_update is the blocking face and runs on a Connection or a "
                r"Session, not an AsyncConnection: use "
                r"celery_dflock\.fencing\.sqlalchemy_aio\.fenced_update \(await it\)",
            ):
                fenced_update(
                    db,  # pyright: ignore[reportArgumentType]
                    ACCOUNTS,
                    ACCOUNTS.c.id == 1,
                    fence=1,
                    values={"balance": 1},
                )
            with pytest.raises(TypeError, match=r"sqlalchemy_aio\.fenced_upsert"):
                fenced_upsert(
                    db,  # pyright: ignore[reportArgumentType]
                    ACCOUNTS,
                    key={"id": 1},
                    fence=1,
                    values={"balance": 1},
                )
    finally:
        await engine.dispose()


async def test_the_async_sqlalchemy_face_names_the_blocking_one(engine: sa.Engine) -> None:
    with (
        engine.begin() as db,
        pytest.raises(
            TypeError,
            match=r"is the asyncio face .* not a Connection: use "
            r"celery_dflock\.fencing\.sqlalchemy\.fenced_upsert",
        ),
    ):
        await sqlalchemy_aio.fenced_upsert(
            db,  # pyright: ignore[reportArgumentType]
            ACCOUNTS,
            key={"id": 1},
            fence=1,
            values={"balance": 1},
        )
    with pytest.raises(TypeError, match=r"runs on a Connection or a Session .* not Engine"):
        fenced_update(
            engine,  # pyright: ignore[reportArgumentType]
            ACCOUNTS,
            ACCOUNTS.c.id == 1,
            fence=1,
            values={"balance": 1},
        )


async def test_the_redis_faces_name_each_other_and_send_nothing(
    store_redis: redis.Redis,
) -> None:
    """The blocking face said ``ValueError: invalid literal for int() ... '<coroutine ...>'``."""
    key = f"fencing-test:{uuid.uuid4().hex}"
    client = redis.asyncio.Redis.from_url(STORE_REDIS_URL)
    try:
        with pytest.raises(
            TypeError,
            match=r"fenced_set is the blocking face and runs on redis\.Redis, not "
            r"redis\.asyncio\.client\.Redis: use celery_dflock\.fencing\.redis_aio\.fenced_set",
        ):
            redis_fencing.fenced_set(client, key, "x", fence=1)  # pyright: ignore[reportArgumentType]
        with pytest.raises(TypeError, match=r"redis_aio\.fenced_hset"):
            redis_fencing.fenced_hset(client, key, {"x": 1}, fence=1)  # pyright: ignore[reportArgumentType]
        with pytest.raises(
            TypeError, match=r"is the asyncio face .* use celery_dflock\.fencing\.redis\.fenced_set"
        ):
            await redis_aio.fenced_set(store_redis, key, "x", fence=1)  # pyright: ignore[reportArgumentType]
        assert store_redis.exists(key) == 0
    finally:
        await client.aclose()


async def test_a_pipeline_is_refused_before_anything_is_queued(store_redis: redis.Redis) -> None:
    """A pipeline answers at ``execute()``: the blocking face said ``int() argument must be ...
    not 'Pipeline'`` with the script already queued, its answer (a refusal) left unread; the
    asyncio face said to use the blocking one."""
    key = f"fencing-test:{uuid.uuid4().hex}"
    pipeline = store_redis.pipeline()
    with pytest.raises(TypeError, match=r"fenced_set runs on a client, not a pipeline"):
        redis_fencing.fenced_set(pipeline, key, "x", fence=1)
    with pytest.raises(TypeError, match=r"fenced_hset runs on a client, not a pipeline"):
        redis_fencing.fenced_hset(pipeline, key, {"x": 1}, fence=1)
    assert pipeline.execute() == []
    client = redis.asyncio.Redis.from_url(STORE_REDIS_URL)
    try:
        queued = client.pipeline()
        with pytest.raises(TypeError, match=r"redis\.asyncio\.client\.Pipeline\): a pipeline"):
            await redis_aio.fenced_set(queued, key, "x", fence=1)
        assert await queued.execute() == []
    finally:
        await client.aclose()
    assert store_redis.exists(key) == 0


def test_a_table_without_the_fence_column_is_named_with_the_lines_that_add_it(
    engine: sa.Engine,
) -> None:
    """It said ``KeyError: 'dflock_fence'``."""
    bare = sa.Table(
        "bare",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("v", sa.Text),
    )
    with engine.begin() as db:
        bare.create(db)
        db.execute(sa.insert(bare).values(id=1, v="old"))
    with engine.begin() as db, pytest.raises(FenceColumnMissing) as missing:
        fenced_update(db, bare, bare.c.id == 1, fence=1, values={"v": "new"})
    said = str(missing.value)
    assert "table 'bare': the Table has no column 'dflock_fence'" in said
    assert "fence_column()" in said and "add_fence_column(connection, bare)" in said
    assert "op.add_column('bare', sa.Column('dflock_fence', sa.BigInteger()" in said
    with engine.begin() as db, pytest.raises(FenceColumnMissing, match="the Table has no"):
        fenced_upsert(db, bare, key={"id": 1}, fence=1, values={"v": "new"})

    # The Table declares it, the database was not migrated: the database's error, named.
    declared = sa.Table(
        "bare",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("v", sa.Text),
        sa.Column("dflock_fence", sa.BigInteger, nullable=False, server_default="0"),
    )
    for write in (
        lambda db: fenced_update(db, declared, declared.c.id == 1, fence=1, values={"v": "x"}),
        lambda db: fenced_upsert(db, declared, key={"id": 1}, fence=1, values={"v": "x"}),
    ):
        with engine.begin() as db, pytest.raises(FenceColumnMissing) as missing:
            write(db)
        assert "the database table has no column 'dflock_fence'" in str(missing.value)
        assert "op.add_column('bare'" in str(missing.value)
    with engine.connect() as db:
        assert db.execute(sa.select(bare.c.v)).scalar() == "old"

    # The deploy's check says the same before a task writes, for every table at once.
    with engine.connect() as db:
        check_fence_column(db, ACCOUNTS)
        with pytest.raises(
            FenceColumnMissing,
            match=r"fenced tables not ready: table 'bare' has no column 'dflock_fence' in the "
            r"database: declare it",
        ):
            check_fence_column(db, ACCOUNTS, declared)
    uncreated = sa.Table(  # it said: NoSuchTableError: uncreated
        "uncreated", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True), fence_column()
    )
    with engine.connect() as db, pytest.raises(FenceColumnMissing) as missing:
        check_fence_column(db, ACCOUNTS, uncreated)
    assert str(missing.value) == (
        "fenced tables not ready: table 'uncreated' is not in the database: create it "
        "(metadata.create_all(connection), or its migration)"
    )
    with Session(engine) as session:  # on a session too, as the writes
        check_fence_column(session, ACCOUNTS)
        with pytest.raises(FenceColumnMissing, match="table 'bare' has no column"):
            check_fence_column(session, ACCOUNTS, declared)


def test_update_and_upsert_check_the_fence_before_the_column(engine: sa.Engine) -> None:
    """A write without a fence to a table without the fence column: both writes say the fence
    is missing (the upsert said the column was, the update the fence), whether the Table or
    only the database lacks the column (the database can say so only at the write, after the
    fence's check); a bad fence likewise. Nothing is written."""
    bare = sa.Table("bare", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True))
    declared = sa.Table(
        "bare",
        sa.MetaData(),
        sa.Column("id", sa.Integer, primary_key=True),
        sa.Column("dflock_fence", sa.BigInteger, nullable=False, server_default="0"),
    )
    with engine.begin() as db:
        bare.create(db)
    for table in (bare, declared):
        for fence, error in ((None, FenceMissing), (-1, InvalidValueError)):
            with engine.begin() as db, pytest.raises(error):
                fenced_update(db, table, table.c.id == 1, fence=fence, values={})
            with engine.begin() as db, pytest.raises(error):
                fenced_upsert(db, table, key={"id": 1}, fence=fence, values={})
    with engine.begin() as db, pytest.raises(FenceColumnMissing):
        fenced_upsert(db, bare, key={}, fence=1, values={})  # the column, then the key
    with engine.connect() as db:
        assert db.execute(sa.select(sa.func.count()).select_from(bare)).scalar() == 0


def test_a_row_written_under_two_keys_is_refused_saying_so(
    engine: sa.Engine, dflock_server: ServerThread
) -> None:
    """Fences are one sequence across keys: a run holding key A (never lost) that writes a
    row written since under key B, granted later, is refused, and the message says a holder
    of another key may have written it (it said only "this run lost its lock")."""
    with engine.begin() as db:
        db.execute(sa.insert(ACCOUNTS).values(id=1, balance=0))
    servers = [dflock_server.address]
    with (
        DistributedLock("fencing:two-keys:a", servers=servers) as lock_a,
        DistributedLock("fencing:two-keys:b", servers=servers) as lock_b,
    ):
        fence_a, fence_b = lock_a.fence, lock_b.fence
        assert fence_a is not None and fence_b is not None and fence_b > fence_a
        with engine.begin() as db:
            fenced_update(db, ACCOUNTS, ACCOUNTS.c.id == 1, fence=fence_b, values={})
        with engine.begin() as db, pytest.raises(StaleFence) as refused:
            fenced_update(db, ACCOUNTS, ACCOUNTS.c.id == 1, fence=fence_a, values={})
        assert not lock_a.lost
    said = str(refused.value)
    assert f"its fence {fence_a} is lower than {fence_b}, the fence the store holds" in said
    assert "a holder of another lock key that writes the same row or key" in said
    assert "write each row under one lock key" in said


def test_a_table_given_by_its_name_is_refused_naming_what_to_pass(engine: sa.Engine) -> None:
    """A table's name where a Table (or a mapped class) goes: SQLAlchemy's ``ArgumentError:
    subject table for an INSERT, UPDATE or DELETE expected, got 'account'`` from the writes and
    the check, and ``AttributeError: 'str' object has no attribute 'name'`` from
    add_fence_column."""
    said = "takes a Table or an ORM mapped class, not str 'account'"
    name: Any = "account"
    calls = (
        lambda db: fenced_update(db, name, ACCOUNTS.c.id == 1, fence=1, values={}),
        lambda db: fenced_upsert(db, name, key={"id": 1}, fence=1, values={}),
        lambda db: check_fence_column(db, name),
        lambda db: add_fence_column(db, name),
    )
    for call in calls:
        with engine.begin() as db, pytest.raises(TypeError, match=said):
            call(db)
