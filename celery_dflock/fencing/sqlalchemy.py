"""Fenced writes through SQLAlchemy (Core or ORM; needs ``celery-dflock[sqlalchemy]``).

The table keeps, in each row, the highest fence a write to that row carried: a column
``dflock_fence BIGINT NOT NULL DEFAULT 0`` (`fence_column` declares it, `add_fence_column`
adds it to a table that exists). `fenced_update` is one statement::

    UPDATE <table> SET <values>, dflock_fence = :fence
    WHERE <where> AND dflock_fence <= :fence

so the check and the write are one atomic step of the database, under whatever isolation
level: a row another holder wrote with a higher fence is not matched, and nothing is written
to it. When no row was updated, one ``SELECT max(dflock_fence)`` tells a refusal (the row is
there with a higher fence: `StaleFence`) from a row that is not there (0 is returned, as an
``UPDATE`` that matched nothing). ``where`` should name one row (its primary key): the fence
guards rows, one at a time. The caller's transaction commits the write (``engine.begin()``,
``session.commit()``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.engine import Connection, CursorResult
from sqlalchemy.exc import CompileError
from sqlalchemy.orm import Session

from celery_dflock.fencing.errors import StaleFence
from celery_dflock.fencing.fences import FENCE_COLUMN, require_fence

__all__ = ["add_fence_column", "fence_column", "fenced_update"]


def fence_column(name: str = FENCE_COLUMN) -> sa.Column[int]:
    """The fence column of a Core ``Table``: ``BIGINT NOT NULL DEFAULT 0`` (a row never
    written under a lock carries 0, below every fence). In an ORM model, the same as
    ``dflock_fence: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")``."""
    return sa.Column(name, sa.BigInteger, nullable=False, default=0, server_default=sa.text("0"))


def add_fence_column(connection: Connection, table: sa.Table, name: str = FENCE_COLUMN) -> bool:
    """Add the fence column to ``table``, an existing table (``ALTER TABLE ... ADD COLUMN
    <name> BIGINT NOT NULL DEFAULT 0``: every existing row gets 0). True if it was added,
    False if the table has it already. For a migration tool (Alembic), the same column in its
    own ``add_column``."""
    present = sa.inspect(connection).get_columns(table.name, schema=table.schema)
    if any(column["name"] == name for column in present):
        return False
    quote = connection.dialect.identifier_preparer
    connection.execute(
        sa.text(
            f"ALTER TABLE {quote.format_table(table)} "
            f"ADD COLUMN {quote.quote(name)} BIGINT NOT NULL DEFAULT 0"
        )
    )
    return True


def fenced_update(
    connection: Connection | Session,
    table: sa.Table | type[Any],
    where: sa.ColumnElement[bool],
    *,
    fence: int | None,
    values: Mapping[str, Any],
    fence_name: str = FENCE_COLUMN,
) -> int:
    """``UPDATE table SET values, fence WHERE where AND fence <= :fence``; the number of rows
    updated (0 when ``where`` matches no row).

    ``table``: a Core ``Table`` or an ORM mapped class (``values`` then names its attributes).
    ``fence``: the lock's fence (``self.lock.fence``); a fence equal to the row's is accepted
    (one holder writes several times), a lower one raises `StaleFence` and None raises
    `FenceMissing`, both without writing. ``fence_name``: the fence column, if not
    ``dflock_fence``.
    """
    statement = sa.update(table)
    target = cast("sa.Table", statement.table)

    def label() -> str:  # compiled for a message only
        return f"{target.fullname} where {_described(where)}"

    fence = require_fence(fence, label)
    column = target.c[fence_name]
    assigned: dict[Any, Any] = {**values, column: fence}
    # "fetch": an ORM session updates the objects it holds from the rows the database updated
    # (on PostgreSQL, RETURNING), never from its own, possibly stale, idea of their fence.
    statement = statement.where(where, column <= fence).values(assigned)
    result = connection.execute(statement.execution_options(synchronize_session="fetch"))
    updated = cast("CursorResult[Any]", result).rowcount
    if updated:
        return updated
    highest = connection.execute(sa.select(sa.func.max(column)).where(where)).scalar()
    if highest is not None and int(highest) > fence:
        raise StaleFence.refused(label(), fence, int(highest))
    return 0


def _described(where: sa.ColumnElement[bool]) -> str:
    """``where`` as SQL with its values in line, for a message (as bound SQL if it cannot)."""
    try:
        return str(where.compile(compile_kwargs={"literal_binds": True}))
    except (CompileError, NotImplementedError):
        return str(where)
