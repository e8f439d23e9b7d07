"""Fenced writes through SQLAlchemy, Core or ORM (needs ``celery-dflock[sqlalchemy]``); the
statements and their answers are in [Fenced writes](../fencing.md#sqlalchemy), the asyncio face
is `celery_dflock.fencing.sqlalchemy_aio`.

The check and the write are one statement, atomic under any isolation level, committed by the
caller's transaction. When it wrote nothing, the row's fence is read on the connection the
write ran on (a Session's for the bind it chose, not a replica its reads are routed to), ``FOR
UPDATE`` on MySQL and MariaDB (the latest committed fence, not repeatable read's snapshot), to
tell a refusal (`StaleFence`) from a row that is not there.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeAlias, cast

import sqlalchemy as sa
from sqlalchemy.engine import Connection, CursorResult
from sqlalchemy.orm import Mapper, Session, scoped_session

from celery_dflock.fencing._sql import (
    MYSQL,
    FencedUpdate,
    FencedUpsert,
    Target,
    adding_lines,
    column_checked,
    table_of,
    wrong_face,
)
from celery_dflock.fencing.errors import FenceColumnMissing
from celery_dflock.fencing.fences import FENCE_COLUMN, refuse_unwritten, upsert_elsewhere

_Blocking: TypeAlias = Connection | Session | scoped_session[Any]
"""What the blocking face writes on: a ``Connection``, a ``Session`` or a ``scoped_session``."""


def fence_column(name: str = FENCE_COLUMN) -> sa.Column[int]:
    """The fence column of a Core ``Table``: ``BIGINT NOT NULL DEFAULT 0``. In an ORM model:
    ``dflock_fence: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")``."""
    return sa.Column(name, sa.BigInteger, nullable=False, default=0, server_default=sa.text("0"))


def add_fence_column(connection: Connection, table: sa.Table, name: str = FENCE_COLUMN) -> bool:
    """Add the fence column to the existing ``table`` (every existing row gets 0); False if
    the table has it already."""
    table = table_of(table, "add_fence_column")
    present = sa.inspect(connection).get_columns(table.name, schema=table.schema)
    if any(column["name"] == name for column in present):
        return False
    quote = connection.dialect.identifier_preparer
    column = f"{quote.quote(name)} BIGINT NOT NULL DEFAULT 0"
    connection.execute(sa.text(f"ALTER TABLE {quote.format_table(table)} ADD COLUMN {column}"))
    return True


def check_fence_column(
    connection: Connection | Session | scoped_session[Any],
    *tables: sa.Table | type[Any],
    name: str = FENCE_COLUMN,
) -> None:
    """Raise `FenceColumnMissing` unless every one of ``tables`` (Core tables or ORM classes)
    has the fence column ``name`` in its declaration and in the database (for a deploy step,
    before a task writes). ``connection``: a ``Connection`` or ``Session``, as for the writes."""
    if isinstance(connection, Session | scoped_session):
        connection = connection.connection()
    elif not isinstance(connection, Connection):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise wrong_face("check_fence_column", connection, blocking=True)
    inspector = sa.inspect(connection)
    lacking: list[str] = []
    for table in (table_of(given, "check_fence_column") for given in tables):
        if name in table.c and not inspector.has_table(table.name, schema=table.schema):
            lacking.append(
                f"table {table.fullname!r} is not in the database: create it "
                "(metadata.create_all(connection), or its migration)"
            )
        elif name not in table.c or all(
            c["name"] != name for c in inspector.get_columns(table.name, schema=table.schema)
        ):
            lacking.append(
                f"table {table.fullname!r} has no column {name!r} in the database: "
                f"{adding_lines(table, name)}"
            )
    if lacking:
        raise FenceColumnMissing(f"fenced tables not ready: {'; '.join(lacking)}")


def fenced_update(
    connection: Connection | Session | scoped_session[Any],
    table: sa.Table | type[Any],
    where: sa.ColumnElement[bool],
    *,
    fence: int | None,
    values: Mapping[str, Any],
    fence_name: str = FENCE_COLUMN,
) -> int:
    """``UPDATE table SET values, fence WHERE where AND fence <= :fence``; the number of rows
    updated (0 when ``where`` matches no row).

    ``connection``: a ``Connection`` or ``Session``. ``table``: a Core ``Table`` or an ORM
    mapped class. ``fence``: ``self.lock.fence``; one equal to the row's is accepted, a lower
    one raises `StaleFence` and None `FenceMissing`, both without writing. A table without
    the ``fence_name`` column raises `FenceColumnMissing`.
    """
    if not isinstance(connection, Connection | Session | scoped_session):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise wrong_face("fenced_update", connection, blocking=True)
    fenced = FencedUpdate.build(table, where, fence, fence_name)
    update = fenced.update(table, values)
    with column_checked(fenced):
        if updated := cast("CursorResult[Any]", connection.execute(update)).rowcount:
            return updated
        written = _written_on(connection, update, table)
        seen = written.execute(fenced.highest(written.dialect)).one()
    refuse_unwritten(fenced.label, fenced.fence, seen[0], seen[1])
    return 0


def fenced_upsert(
    connection: Connection | Session | scoped_session[Any],
    table: sa.Table | type[Any],
    *,
    key: Mapping[str, Any],
    fence: int | None,
    values: Mapping[str, Any],
    update: Mapping[str, Any] | None = None,
    fence_name: str = FENCE_COLUMN,
) -> None:
    """Insert the row ``key`` + ``values`` with ``fence``, or, when a row of that ``key``
    exists, set ``update`` (default: ``values``) and the fence on it if its fence is not
    higher; one statement. Refusals as `fenced_update`; on MySQL and MariaDB, a row that
    collides on another unique key than ``key`` is left alone, raising `InvalidValueError`.

    ``key``: the primary or a unique key's columns and values (``{"id": 7}``). ``update``:
    what an existing row gets, expressions over its columns included
    (``{"balance": accounts.c.balance + 10}``). Another database than PostgreSQL, SQLite,
    MySQL and MariaDB raises `ValueError`. An ORM session's objects are not refreshed.
    """
    if not isinstance(connection, Connection | Session | scoped_session):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise wrong_face("fenced_upsert", connection, blocking=True)
    fenced = FencedUpsert.build(table, key, fence, fence_name)
    if isinstance(connection, Connection):
        dialect = connection.dialect
    else:  # the bind the Session writes the table to
        dialect = connection.get_bind(clause=fenced.table).dialect
    statement = fenced.statement(dialect, values, update)
    with column_checked(fenced):
        result = connection.execute(statement)
        if dialect.name not in MYSQL and result.scalar() is not None:
            return
        written = _written_on(connection, statement, fenced.table)
        kept = written.execute(fenced.kept()).one_or_none()
    if kept is None:
        raise upsert_elsewhere(fenced.label())
    refuse_unwritten(fenced.label, fenced.fence, kept[0], 1)


def _written_on(connection: _Blocking, statement: sa.Executable, table: Target) -> Connection:
    """The connection that ``statement``, a write to ``table``, ran on: a Session's for the
    bind it chose for it (a Session that routes by statement, as SQLAlchemy's read/write
    splitting recipe, would send the read that checks the write to a replica that lags)."""
    if isinstance(connection, Connection):
        return connection
    subject: object = sa.inspect(table)  # an ORM mapped class's Mapper, given for the write
    mapper = cast("Mapper[Any]", subject) if isinstance(subject, Mapper) else None
    return connection.connection(bind_arguments={"clause": statement, "mapper": mapper})
