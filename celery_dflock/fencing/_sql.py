"""The statements of `celery_dflock.fencing.sqlalchemy` (docs/fencing.md shows them). On MySQL
and MariaDB every assignment of the upsert keeps the row's value unless the fence is at least
the row's and the row is the one of ``key`` (``ON DUPLICATE KEY UPDATE`` takes a conflict on
any unique key), the fence's assignment last (MySQL assigns left to right); the row's fence is
then read ``FOR UPDATE`` (the statement locked the row).
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final, TypeAlias, cast

import sqlalchemy as sa
from sqlalchemy.dialects import mysql, postgresql, sqlite
from sqlalchemy.exc import ArgumentError, CompileError, DBAPIError

from celery_dflock.client.errors import InvalidValueError
from celery_dflock.fencing.errors import FenceColumnMissing
from celery_dflock.fencing.fences import (
    FENCE_COLUMN,
    key_not_unique,
    no_such_column,
    refuse_key_misuse,
    require_fence,
)

MYSQL: Final = frozenset({"mysql", "mariadb"})
"""The dialects whose upsert is ``ON DUPLICATE KEY UPDATE`` (it returns no fence)."""
Target: TypeAlias = sa.Table | type[Any]
"""What a fenced write names as its table: a Core ``Table`` or an ORM mapped class."""


def table_of(table: Target, helper: str) -> sa.Table:
    """A Core ``Table`` as it is; an ORM mapped class's table; else `TypeError` for ``helper``."""
    try:
        return cast("sa.Table", sa.update(table).table)
    except ArgumentError:
        kind = type(cast("object", table)).__name__
        raise TypeError(
            f"{helper} takes a Table or an ORM mapped class, not {kind} {table!r}"
        ) from None


def adding_lines(table: sa.Table, name: str) -> str:
    """What adds the fence column ``name`` to ``table``: its declaration and its migration."""
    named = "" if name == FENCE_COLUMN else f"{name!r}"
    extra = "" if name == FENCE_COLUMN else f", {name!r}"
    return (
        f"declare it (Core: fence_column({named}) in the Table; ORM: {name}: Mapped[int] = "
        "mapped_column(BigInteger, default=0, server_default='0')) and add it to the "
        f"database: add_fence_column(connection, {table.name}{extra}), or in an Alembic "
        f"migration op.add_column({table.name!r}, sa.Column({name!r}, sa.BigInteger(), "
        "nullable=False, server_default='0')); existing rows get 0"
    )


def fence_column_of(table: sa.Table, name: str) -> sa.Column[Any]:
    """``table``'s fence column, or `FenceColumnMissing` saying how to add it."""
    try:
        return table.c[name]
    except KeyError:
        raise FenceColumnMissing(
            f"fenced write to table {table.fullname!r}: the Table has no column {name!r}, "
            "where a fenced table keeps the highest fence written to each row; "
            f"{adding_lines(table, name)}"
        ) from None


@contextmanager
def column_checked(fenced: _Fenced) -> Generator[None]:
    """Runs the block, turning the database's word that the table has no fence column into
    `FenceColumnMissing`, and SQLAlchemy's that the values name no column of it (and the
    database's that an upsert's key is no unique key) into `InvalidValueError`."""
    table, name = fenced.table, fenced.column.name
    upsert = fenced if isinstance(fenced, FencedUpsert) else None
    try:
        yield
    except CompileError as error:
        unknown = str(error).partition("Unconsumed column names: ")[2]
        if not unknown:
            raise
        doing = "upsert into" if upsert else "update of"
        raise InvalidValueError(
            f"fenced {doing} {fenced.label()}: values name {unknown}, which is no column of "
            f"table {table.fullname!r} (its columns: {', '.join(table.c.keys())}); name "
            "the table's columns (or the mapped class's attributes)"
        ) from None
    except DBAPIError as error:
        said = str(error.orig)
        if upsert is not None and (refused := key_not_unique(upsert.label(), upsert.key, said)):
            raise refused from error
        if not no_such_column(said, name):
            raise
        raise FenceColumnMissing(
            f"fenced write to table {table.fullname!r}: the database table has no column "
            f"{name!r} (the Table declares it, the database was not migrated; the database "
            f"said: {said.strip().splitlines()[0]}); {adding_lines(table, name)}"
        ) from error


def wrong_face(helper: str, given: object, *, blocking: bool) -> TypeError:
    """A connection that the face ``helper`` of one kind (``blocking`` or not) cannot run on."""
    kind = type(given).__name__
    if blocking and kind in {"AsyncConnection", "AsyncSession", "async_scoped_session"}:
        return TypeError(
            f"{helper} is the blocking face and runs on a Connection or a Session, not an "
            f"{kind}: use celery_dflock.fencing.sqlalchemy_aio.{helper} "
            "(await it) for SQLAlchemy's asyncio extension"
        )
    if not blocking and kind in {"Connection", "Session", "scoped_session"}:
        return TypeError(
            f"{helper} is the asyncio face and runs on an AsyncConnection or an AsyncSession, "
            f"not a {kind}: use celery_dflock.fencing.sqlalchemy.{helper} for a blocking one"
        )
    wanted = (
        "a Connection or a Session (engine.begin(), Session(engine))"
        if blocking
        else "an AsyncConnection or an AsyncSession (engine.begin(), AsyncSession(engine))"
    )
    return TypeError(
        f"{helper} runs on {wanted}, not {kind}: the write and its check need one "
        "connection's transaction"
    )


def described(where: sa.ColumnElement[bool]) -> str:
    """``where`` as SQL with its values in line, for a message (as bound SQL if it cannot)."""
    try:
        return str(where.compile(compile_kwargs={"literal_binds": True}))
    except (CompileError, NotImplementedError):
        return str(where)


def refuse_fence_in(values: Mapping[Any, Any], name: str, label: Callable[[], str]) -> None:
    """`ValueError` when ``values`` (by column name or ``Column``) sets the fence column
    ``name``: it would move the row's fence to any number, back included."""
    if any((k if isinstance(k, str) else getattr(k, "name", None)) == name for k in values):
        raise ValueError(f"fenced write to {label()}: the column {name!r} holds the fence")


@dataclass(frozen=True, slots=True)
class _Fenced:
    """What a fenced write names: the table, its fence column, the write's fence (checked) and
    the label of its rows in a message."""

    table: sa.Table
    column: sa.Column[Any]
    fence: int
    label: Callable[[], str]


@dataclass(frozen=True, slots=True)
class FencedUpdate(_Fenced):
    """The statements of one fenced update."""

    where: sa.ColumnElement[bool]

    @classmethod
    def build(
        cls, table: Target, where: sa.ColumnElement[bool], fence: int | None, fence_name: str
    ) -> FencedUpdate:
        target = table_of(table, "fenced_update")
        if isinstance(where, bool | None):  # pyright: ignore[reportUnnecessaryIsInstance]
            raise InvalidValueError(
                f"fenced_update of {target.fullname}: where is {where}, not a condition on the "
                "columns (None, False: no row; True: every row); name the row: table.c.id == 7"
            )

        def label() -> str:  # compiled for a message only
            return f"{target.fullname} where {described(where)}"

        checked = require_fence(fence, label)
        return cls(target, fence_column_of(target, fence_name), checked, label, where)

    def update(self, table: Target, values: Mapping[str, Any]) -> sa.Update:
        """The ``UPDATE`` (on ``table`` as given, so an ORM session's objects stay in step)."""
        refuse_fence_in(values, self.column.name, self.label)
        assigned: dict[Any, Any] = {**values, self.column: self.fence}
        statement = sa.update(table).where(self.where, self.column <= self.fence).values(assigned)
        return statement.execution_options(synchronize_session="fetch")

    def highest(self, dialect: sa.Dialect) -> sa.Select[Any, int]:
        """The highest fence of the rows ``where`` names, and how many there are; on MySQL and
        MariaDB read ``FOR UPDATE``, the latest committed (a plain read under their repeatable
        read is of the transaction's snapshot, older than the write that refused the update)."""
        highest = sa.select(sa.func.max(self.column), sa.func.count()).where(self.where)
        return highest.with_for_update() if dialect.name in MYSQL else highest


@dataclass(frozen=True, slots=True)
class FencedUpsert(_Fenced):
    """The statements of one fenced insert-or-update of the row named by ``key``."""

    key: Mapping[str, Any]

    @classmethod
    def build(
        cls, table: Target, key: Mapping[str, Any], fence: int | None, fence_name: str
    ) -> FencedUpsert:
        target = table_of(table, "fenced_upsert")
        keyed = dict(key)

        def label() -> str:
            row = ", ".join(f"{name}={value!r}" for name, value in keyed.items())
            return f"{target.fullname} row {row}"

        checked = require_fence(fence, label)
        column = fence_column_of(target, fence_name)
        if not keyed:
            raise ValueError(
                f"fenced upsert into {target.fullname}: key names no column; give the "
                "primary key or a unique key of the row ({'id': 7})"
            )
        if unknown := sorted(set(keyed) - set(target.c.keys())):
            raise ValueError(
                f"fenced upsert into {label()}: key names {', '.join(unknown)}, which is no "
                f"column of table {target.fullname!r} (its columns: {', '.join(target.c.keys())})"
                "; name the columns of its primary key or of a unique key"
            )
        return cls(target, column, checked, label, keyed)

    def statement(
        self, dialect: sa.Dialect, values: Mapping[str, Any], update: Mapping[str, Any] | None
    ) -> sa.Insert:
        """The one upsert of ``dialect`` (see `celery_dflock.fencing.sqlalchemy`)."""
        name = self.column.name
        written = cast("dict[object, Any]", {**values, **(update or {})})  # or a Column's key
        refuse_fence_in(written, name, self.label)
        refuse_key_misuse(self.label, self.key, values)
        if unknown := sorted(k for k in written if isinstance(k, str) and k not in self.table.c):
            raise ValueError(
                f"fenced upsert into {self.label()}: no column {', '.join(unknown)} in values "
                f"or update (the table's columns: {', '.join(self.table.c.keys())})"
            )
        row = {**values, **self.key, name: self.fence}
        inserts = {"postgresql": postgresql.insert, "sqlite": sqlite.insert}
        if dialect.name not in inserts and dialect.name not in MYSQL:
            raise ValueError(
                f"fenced upsert into {self.label()}: SQLAlchemy's {dialect.name} dialect has no "
                "upsert here (PostgreSQL, SQLite, MySQL and MariaDB have one): insert the row "
                "first with fence 0 (the column's default), then write it with fenced_update"
            )
        insert = inserts.get(dialect.name, mysql.insert)(self.table).values(row)
        new = insert.inserted if isinstance(insert, mysql.Insert) else insert.excluded
        changes = {k: new[k] for k in values} if update is None else dict(update)
        changes[name] = new[name]  # last: MySQL's guards before it read the row's fence
        if not isinstance(insert, mysql.Insert):
            return insert.on_conflict_do_update(
                index_elements=[self.table.c[k] for k in self.key],
                set_=changes,
                where=self.column <= new[name],
            ).returning(self.column)
        later = sa.and_(self.column <= new[name], *(self.table.c[k] == new[k] for k in self.key))
        return insert.on_duplicate_key_update(
            [(k, sa.case((later, v), else_=self.table.c[k])) for k, v in changes.items()]
        )

    def kept(self) -> sa.Select[tuple[Any]]:
        """The row's fence, read under the row lock the upsert took (the latest committed)."""
        keyed = (self.table.c[name] == value for name, value in self.key.items())
        return sa.select(self.column).where(*keyed).with_for_update()
