"""Fenced writes through SQLAlchemy's asyncio extension (needs ``celery-dflock[sqlalchemy]``,
``sqlalchemy[asyncio]`` and an async driver; see [Async stores](../fencing.md#async-stores)).

The blocking face's functions (`celery_dflock.fencing.sqlalchemy`), awaited, with the same
arguments and answers, on an ``AsyncConnection`` or an ``AsyncSession``: each runs the blocking
one through ``run_sync``. An engine is bound to the loop it was first used on: make and dispose
of it inside the coroutine ``asyncio.run`` runs, or use ``NullPool``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncSession, async_scoped_session

from celery_dflock.fencing import sqlalchemy as blocking
from celery_dflock.fencing._sql import wrong_face
from celery_dflock.fencing.fences import FENCE_COLUMN


async def check_fence_column(
    connection: AsyncConnection | AsyncSession | async_scoped_session[Any],
    *tables: sa.Table | type[Any],
    name: str = FENCE_COLUMN,
) -> None:
    """The blocking face's `~celery_dflock.fencing.sqlalchemy.check_fence_column`, awaited."""
    await _runner(connection, "check_fence_column").run_sync(
        blocking.check_fence_column, *tables, name=name
    )


def _runner(
    connection: AsyncConnection | AsyncSession | async_scoped_session[Any], helper: str
) -> AsyncConnection | AsyncSession:
    if isinstance(connection, async_scoped_session):
        return connection()
    if not isinstance(connection, AsyncConnection | AsyncSession):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise wrong_face(helper, connection, blocking=False)
    return connection


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
    return await _runner(connection, "fenced_update").run_sync(
        blocking.fenced_update, table, where, fence=fence, values=values, fence_name=fence_name
    )


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
    await _runner(connection, "fenced_upsert").run_sync(
        blocking.fenced_upsert,
        table,
        key=key,
        fence=fence,
        values=values,
        update=update,
        fence_name=fence_name,
    )
