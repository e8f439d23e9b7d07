"""The asyncio faces, `celery_dflock.fencing.sqlalchemy_aio` (PostgreSQL through psycopg 3's
async driver, SQLite through aiosqlite) and `celery_dflock.fencing.redis_aio` (``redis.asyncio``),
against the real stores: the same answers as the blocking faces."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine

from celery_dflock.client.errors import InvalidValueError
from celery_dflock.fencing import (
    FenceColumnMissing,
    FenceMissing,
    StaleFence,
    redis_aio,
    sqlalchemy_aio,
)
from celery_dflock.fencing.redis import fence_key_of, highest_fence
from tests.fencing.stores import ACCOUNTS, METADATA, STORE_REDIS_URL, async_engine_for
from tests.support.services import require_redis


@pytest.fixture(params=["postgresql", "sqlite"])
async def async_engine(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[AsyncEngine]:
    if request.param == "postgresql":
        made = async_engine_for(request.getfixturevalue("pg_schema"))
    else:
        made = create_async_engine(f"sqlite+aiosqlite:///{tmp_path / 'fenced.db'}")
        async with made.begin() as db:
            await db.run_sync(METADATA.create_all)
    try:
        yield made
    finally:
        await made.dispose()


async def row(engine: AsyncEngine, account: int) -> tuple[int, int] | None:
    async with engine.connect() as db:
        found = (
            await db.execute(
                sa.select(ACCOUNTS.c.balance, ACCOUNTS.c.dflock_fence).where(
                    ACCOUNTS.c.id == account
                )
            )
        ).one_or_none()
    return None if found is None else (int(found[0]), int(found[1]))


async def test_the_async_upsert_and_update_keep_the_highest_fence(
    async_engine: AsyncEngine,
) -> None:
    async with async_engine.begin() as db:
        await sqlalchemy_aio.fenced_upsert(
            db, ACCOUNTS, key={"id": 7}, fence=100, values={"balance": 5}
        )
        await sqlalchemy_aio.fenced_upsert(
            db,
            ACCOUNTS,
            key={"id": 7},
            fence=250,
            values={"balance": 1},
            update={"balance": ACCOUNTS.c.balance + 1},
        )
        where = ACCOUNTS.c.id == 7
        updated = await sqlalchemy_aio.fenced_update(
            db, ACCOUNTS, where, fence=250, values={"balance": ACCOUNTS.c.balance + 1}
        )
        assert updated == 1
    assert await row(async_engine, 7) == (7, 250)
    with pytest.raises(StaleFence, match="its fence 249 is lower than 250"):
        async with async_engine.begin() as db:
            await sqlalchemy_aio.fenced_upsert(
                db, ACCOUNTS, key={"id": 7}, fence=249, values={"balance": 0}
            )
    with pytest.raises(StaleFence, match="its fence 249 is lower than 250"):
        async with async_engine.begin() as db:
            await sqlalchemy_aio.fenced_update(
                db, ACCOUNTS, ACCOUNTS.c.id == 7, fence=249, values={"balance": 0}
            )
    with pytest.raises(FenceMissing):
        async with async_engine.begin() as db:
            await sqlalchemy_aio.fenced_update(
                db, ACCOUNTS, ACCOUNTS.c.id == 7, fence=None, values={"balance": 0}
            )
    assert await row(async_engine, 7) == (7, 250)
    async with async_engine.begin() as db:  # a row that is not there: nothing to update
        assert (
            await sqlalchemy_aio.fenced_update(
                db, ACCOUNTS, ACCOUNTS.c.id == 8, fence=1, values={"balance": 1}
            )
            == 0
        )
    with pytest.raises(InvalidValueError, match="where is None"):  # it updated nothing: 0
        async with async_engine.begin() as db:
            nowhere: Any = None
            await sqlalchemy_aio.fenced_update(db, ACCOUNTS, nowhere, fence=1, values={})


async def test_the_async_face_through_an_async_session(async_engine: AsyncEngine) -> None:
    async with AsyncSession(async_engine) as session:
        await sqlalchemy_aio.fenced_upsert(
            session, ACCOUNTS, key={"id": 3}, fence=10, values={"balance": 1}
        )
        await session.commit()
        with pytest.raises(StaleFence, match="its fence 9 is lower than 10"):
            await sqlalchemy_aio.fenced_update(
                session, ACCOUNTS, ACCOUNTS.c.id == 3, fence=9, values={"balance": 0}
            )
        await session.rollback()
    assert await row(async_engine, 3) == (1, 10)


async def test_the_async_check_of_the_fence_column(async_engine: AsyncEngine) -> None:
    bare = sa.Table("bare", sa.MetaData(), sa.Column("id", sa.Integer, primary_key=True))
    async with async_engine.begin() as db:
        await db.run_sync(bare.create)
        await sqlalchemy_aio.check_fence_column(db, ACCOUNTS)
        with pytest.raises(FenceColumnMissing, match="table 'bare' has no column 'dflock_fence'"):
            await sqlalchemy_aio.check_fence_column(db, ACCOUNTS, bare)
    # On a session too, as the writes (it said "runs on an AsyncConnection or an AsyncSession
    # (...), not AsyncSession")
    async with AsyncSession(async_engine) as session:
        await sqlalchemy_aio.check_fence_column(session, ACCOUNTS)
        with pytest.raises(FenceColumnMissing, match="table 'bare' has no column 'dflock_fence'"):
            await sqlalchemy_aio.check_fence_column(session, ACCOUNTS, bare)


@pytest.fixture
async def async_redis() -> AsyncIterator[redis.asyncio.Redis]:
    require_redis()
    client = redis.asyncio.Redis.from_url(STORE_REDIS_URL)
    try:
        yield client
    finally:
        await client.aclose()


async def test_redis_asyncio_keeps_the_highest_fence(async_redis: redis.asyncio.Redis) -> None:
    key = f"fencing-test:{uuid.uuid4().hex}"
    try:
        await redis_aio.fenced_set(async_redis, key, "a", fence=100)
        await redis_aio.fenced_set(async_redis, key, "b", fence=100)
        with pytest.raises(StaleFence, match="its fence 99 is lower than 100"):
            await redis_aio.fenced_set(async_redis, key, "stale", fence=99)
        assert await async_redis.get(key) == b"b"
        assert highest_fence(await async_redis.get(fence_key_of(key))) == 100
        await redis_aio.fenced_hset(async_redis, f"{key}:h", {"total": 3}, fence=5)
        with pytest.raises(StaleFence, match="its fence 4 is lower than 5"):
            await redis_aio.fenced_hset(async_redis, f"{key}:h", {"total": 0}, fence=4)
        assert await async_redis.hget(f"{key}:h", "total") == b"3"
        with pytest.raises(FenceMissing):
            await redis_aio.fenced_set(async_redis, key, "x", fence=None)
        await async_redis.set(fence_key_of(key), "1.5")  # it let any write through
        with pytest.raises(InvalidValueError, match=r"holds '1\.5', not a fence"):
            await redis_aio.fenced_set(async_redis, key, "x", fence=100)
    finally:
        await async_redis.delete(key, fence_key_of(key), f"{key}:h")
