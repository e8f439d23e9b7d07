"""Fenced writes through SQLAlchemy's asyncio extension (``AsyncConnection``, ``AsyncSession``;
needs ``celery-dflock[sqlalchemy]``, ``sqlalchemy[asyncio]`` and an async driver; tested with
psycopg 3's and aiosqlite).

The blocking face's functions (`celery_dflock.fencing.sqlalchemy`), awaited, with the same
arguments and answers. `check_fence_column` checks a deploy's database::

    async with engine.connect() as db:
        await check_fence_column(db, accounts)

A task body runs the coroutine with ``asyncio.run(...)``; an engine is bound to the loop it
was first used on, so make and dispose of it inside the coroutine, or use ``NullPool``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import CursorResult
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, async_scoped_session

from celery_dflock.fencing._sql import (
    MYSQL,
    FencedUpdate,
    FencedUpsert,
    check_columns,
    column_checked,
    dialect_of,
    wrong_face,
)
from celery_dflock.fencing.fences import FENCE_COLUMN

__all__ = ["check_fence_column", "fenced_update", "fenced_upsert"]


async def check_fence_column(
    connection: AsyncConnection, *tables: sa.Table | type[Any], name: str = FENCE_COLUMN
) -> None:
    """The blocking face's `check_fence_column` on an ``AsyncConnection``."""
    if not isinstance(connection, AsyncConnection):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise wrong_face("check_fence_column", connection, blocking=False)
    await connection.run_sync(check_columns, tables, name)


async def fenced_update(
    connection: AsyncConnection | AsyncSession | async_scoped_session[Any],
    table: sa.Table | type[Any],
    where: sa.ColumnElement[bool],
    *,
    fence: int | None,
    values: Mapping[str, Any],
    fence_name: str = FENCE_COLUMN,
) -> int:
    """The blocking face's `~celery_dflock.fencing.sqlalchemy.fenced_update`, awaited."""
    if not isinstance(connection, AsyncConnection | AsyncSession | async_scoped_session):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise wrong_face("fenced_update", connection, blocking=False)
    fenced = FencedUpdate.build(table, where, fence, fence_name)
    with column_checked(fenced.table, fenced.column.name):
        result = await connection.execute(fenced.update(table, values))
        if updated := cast("CursorResult[Any]", result).rowcount:
            return updated
        fenced.refuse_below((await connection.execute(fenced.highest())).scalar())
    return 0


async def fenced_upsert(
    connection: AsyncConnection | AsyncSession | async_scoped_session[Any],
    table: sa.Table | type[Any],
    *,
    key: Mapping[str, Any],
    fence: int | None,
    values: Mapping[str, Any],
    update: Mapping[str, Any] | None = None,
    fence_name: str = FENCE_COLUMN,
) -> None:
    """The blocking face's `~celery_dflock.fencing.sqlalchemy.fenced_upsert`, awaited."""
    if not isinstance(connection, AsyncConnection | AsyncSession | async_scoped_session):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise wrong_face("fenced_upsert", connection, blocking=False)
    fenced = FencedUpsert.build(table, key, fence, fence_name)
    dialect = dialect_of(connection)
    statement = fenced.statement(dialect, values, update)
    with column_checked(fenced.table, fenced.column.name):
        result = await connection.execute(statement)
        if dialect.name not in MYSQL and result.scalar() is not None:
            return
        fenced.refuse_below((await connection.execute(fenced.kept())).scalar())
