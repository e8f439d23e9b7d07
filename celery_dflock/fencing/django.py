# pyright: reportMissingTypeStubs=false
"""Fenced writes through Django's ORM (needs ``celery-dflock[django]`` and a configured Django);
the statements and their answers are in [Fenced writes](../fencing.md#django).

The check and the write are one ``UPDATE``. When it wrote nothing, the highest fence is read
on the database written (not a replica a router reads from), ``FOR UPDATE`` on MySQL and
MariaDB in a transaction (repeatable read's snapshot may be older than the write that refused
the update), to tell a refusal (`StaleFence`) from a queryset that matches no row. The upsert
is the database's own, written here: Django's ``bulk_create(update_conflicts=True)`` takes no
condition.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Mapping
from contextlib import contextmanager
from typing import Any, cast

import django.db
import django.db.models.sql
import django.db.transaction  # pyright: ignore[reportUnusedImport]  # _db.transaction
from django.core.exceptions import FieldDoesNotExist
from django.db import models

from celery_dflock.client.errors import InvalidValueError
from celery_dflock.fencing.errors import FenceColumnMissing
from celery_dflock.fencing.fences import (
    FENCE_COLUMN,
    key_not_unique,
    no_such_column,
    refuse_key_misuse,
    refuse_unwritten,
    require_fence,
    upsert_elsewhere,
)

# Django is untyped: what its database layer answers reads as partly unknown, so it is `Any`.
_db: Any = django.db
_Query: Any = django.db.models.sql.Query


def fence_field() -> Any:
    """The fence field of a model (``dflock_fence = fence_field()``): a
    ``BigIntegerField(default=0)``, not editable in forms or the admin."""
    big_integer: Any = models.BigIntegerField  # Django is untyped
    return big_integer(
        default=0,
        editable=False,
        help_text="The highest fencing token a write to this row carried (celery-dflock).",
    )


def fenced_update(
    target: Any, fence: int | None, /, *, fence_name: str = FENCE_COLUMN, **values: Any
) -> int:
    """``target.filter(<fence_name>__lte=fence).update(<fence_name>=fence, **values)``; the
    number of rows updated (0 when ``target`` matches no row).

    ``target``: a queryset (``Account.objects.filter(pk=7)``), or a manager or a model (all
    its rows). ``fence``: ``self.lock.fence``; one equal to the row's is accepted, a lower one
    raises `StaleFence` and None `FenceMissing`, both without writing. ``values``: what
    ``update()`` takes (``F()`` expressions included).
    """
    queryset = _queryset(target)

    def label() -> str:  # compiled for a message only
        return f"{queryset.model._meta.label} rows {_described(queryset)}"

    fence = require_fence(fence, label)
    field = _fence_field(queryset.model, fence_name)
    if fence_name in values:
        raise ValueError(f"fenced write to {label()}: the field {fence_name!r} holds the fence")
    _refuse_unknown(queryset.model, label, values=values)
    with _column_checked(queryset.model, field):
        fenced = queryset.filter(**{f"{fence_name}__lte": fence})
        updated = int(fenced.update(**values, **{fence_name: fence}))
        if updated:
            return updated
        # read where the update went (a router's reads may go to a replica that lags)
        written = queryset.using(fenced.db)
        connection: Any = _db.connections[fenced.db]
        if connection.vendor != "mysql" or connection.get_autocommit():
            seen = written.aggregate(highest=models.Max(fence_name), rows=models.Count("pk"))
            highest, rows = seen["highest"], seen["rows"]
        else:  # the latest committed, not repeatable read's snapshot: a locking read
            ordered = written.select_for_update().order_by(f"-{fence_name}")  # NULLs last
            found = list(ordered.values_list(fence_name, flat=True)[:1])
            highest, rows = (found[0], 1) if found else (None, 0)
    refuse_unwritten(label, fence, highest, rows)
    return 0


def fenced_upsert(
    model: Any,
    fence: int | None,
    /,
    *,
    key: Mapping[str, Any],
    values: Mapping[str, Any],
    update: Mapping[str, Any] | None = None,
    fence_name: str = FENCE_COLUMN,
    using: str | None = None,
) -> None:
    """Insert the row ``key`` + ``values`` of ``model`` with ``fence``, or, when a row of that
    ``key`` exists, set ``update`` (default: ``values``) and the fence on it if its fence is
    not higher; one statement. Refusals as `fenced_update`; on MySQL and MariaDB, a row that
    collides on another unique key than ``key`` is left alone, raising `InvalidValueError`.

    ``key``: the primary or a unique key's fields and values (``{"id": 7}``). ``update``: what
    an existing row gets, expressions included (``{"balance": F("balance") + 10}``).
    ``using``: the database alias. Another database than PostgreSQL, SQLite, MySQL and
    MariaDB raises `ValueError`.
    """
    options: Any = _model_class("fenced_upsert", model)._meta
    row = ", ".join(f"{name}={value!r}" for name, value in key.items())
    label = f"{options.label} row {row}"
    checked = require_fence(fence, label)
    field = _fence_field(model, fence_name)
    alias: str = using or _db.router.db_for_write(model)
    connection: Any = _db.connections[alias]
    if not key:
        raise ValueError(f"fenced upsert into {label}: key names no field ({{'id': 7}})")
    if fence_name in values or (update is not None and fence_name in update):
        raise ValueError(f"fenced upsert into {label}: the field {fence_name!r} holds the fence")
    _refuse_unknown(model, label, key=key, values=values, update=update or {})
    refuse_key_misuse(label, key, values)
    sql, params = _upsert_sql(model, connection, field, checked, key, values, update)
    quote = connection.ops.quote_name
    keyed = " AND ".join(f"{quote(options.get_field(name).column)} = %s" for name in key)
    key_params = [options.get_field(n).get_db_prep_value(v, connection) for n, v in key.items()]
    lock = " FOR UPDATE" if connection.features.has_select_for_update else ""
    with _column_checked(model, field, (label, key)), _db.transaction.atomic(using=alias):
        cursor: Any
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            if connection.vendor != "mysql" and cursor.fetchone() is not None:
                return
            cursor.execute(
                f"SELECT {quote(field.column)} FROM {quote(options.db_table)} WHERE {keyed}{lock}",
                key_params,
            )
            kept = cursor.fetchone()
            if kept is None:  # raised in the atomic block: the other row's write rolls back
                raise upsert_elsewhere(label)
    refuse_unwritten(label, checked, kept[0], 1)


def check_fence_field(
    *checked: Any, fence_name: str = FENCE_COLUMN, using: str | None = None
) -> None:
    """Raise `FenceColumnMissing` unless every model of ``checked`` has the fence field
    ``fence_name`` and its database table the column (for a deploy step, after
    ``manage.py migrate``)."""
    lacking: list[str] = []
    for model in checked:
        options: Any = _model_class("check_fence_field", model)._meta
        if (field := _field(options, fence_name)) is None:
            lacking.append(
                f"{options.label} has no field {fence_name!r}: {_adding(model, fence_name)}"
            )
            continue
        connection: Any = _db.connections[using or _db.router.db_for_write(model)]
        with connection.cursor() as cursor:
            if options.db_table not in connection.introspection.table_names(cursor):
                lacking.append(
                    f"{options.label}'s table {options.db_table!r} is not in the database: "
                    f"{_migrating(model)}"
                )
                continue
            description = connection.introspection.get_table_description(cursor, options.db_table)
        if all(column.name != field.column for column in description):
            lacking.append(
                f"{options.label}'s table {options.db_table!r} has no column {field.column!r} "
                f"in the database: {_migrating(model)}"
            )
    if lacking:
        raise FenceColumnMissing(f"fenced models not ready: {'; '.join(lacking)}")


def _upsert_sql(  # noqa: PLR0917  # one private call site, every argument needed
    model: Any,
    connection: Any,
    fence_field: Any,
    fence: int,
    key: Mapping[str, Any],
    values: Mapping[str, Any],
    update: Mapping[str, Any] | None,
) -> tuple[str, list[Any]]:
    """The one upsert statement of ``connection``'s database, and its parameters."""
    options: Any = model._meta
    quote = connection.ops.quote_name
    table = quote(options.db_table)
    fence_column = quote(fence_field.column)
    columns: list[str] = []
    params: list[Any] = []
    for name, value in {**key, **values}.items():
        field: Any = options.get_field(name)
        columns.append(quote(field.column))
        params.append(field.get_db_prep_save(value, connection))
    columns.append(fence_column)
    params.append(fence)
    inserted = (
        f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({', '.join(['%s'] * len(columns))})"
    )
    mysql = connection.vendor == "mysql"
    if connection.vendor not in {"postgresql", "sqlite", "mysql"}:
        raise ValueError(
            f"fenced upsert into {options.label}: Django's {connection.vendor} backend has no "
            "upsert here (PostgreSQL, SQLite, MySQL and MariaDB have one): create the row "
            "first with fence 0 (the field's default), then write it with fenced_update"
        )

    def new(column: str) -> str:  # the inserted row's value of ``column``
        return f"VALUES({column})" if mysql else f"EXCLUDED.{column}"

    query: Any = _Query(model)
    compiler: Any = query.get_compiler(connection=connection)
    keyed = [quote(options.get_field(name).column) for name in key]
    not_lower = f"{table}.{fence_column} <= {new(fence_column)}"
    # MySQL's guard: a fence not lower, on the row of key (see _sql.py)
    guard = " AND ".join([not_lower, *(f"{table}.{c} = {new(c)}" for c in keyed)])

    def assign(column: str, sql: str) -> str:  # MySQL's guarded by the fence and the key
        guarded = f"CASE WHEN {guard} THEN {sql} ELSE {table}.{column} END"
        return f"{column} = {guarded if mysql else sql}"

    assignments: list[str] = []
    for name, value in (values if update is None else update).items():
        field = options.get_field(name)
        column = quote(field.column)
        if update is None:
            sql, more = new(column), []
        elif hasattr(value, "resolve_expression"):
            resolved = value.resolve_expression(query, allow_joins=False, for_save=True)
            sql, more = compiler.compile(resolved)
        else:
            sql, more = "%s", [field.get_db_prep_save(value, connection)]
        assignments.append(assign(column, sql))
        params.extend(more)
    # MySQL assigns left to right: the fence last, after the guards that read it.
    assignments.append(assign(fence_column, new(fence_column)))
    if mysql:
        return f"{inserted} ON DUPLICATE KEY UPDATE {', '.join(assignments)}", params
    return (
        f"{inserted} ON CONFLICT ({', '.join(keyed)}) DO UPDATE SET {', '.join(assignments)} "
        f"WHERE {not_lower} RETURNING {table}.{fence_column}",
        params,
    )


def _fence_field(model: Any, name: str) -> Any:
    """``model``'s fence field, or `FenceColumnMissing` saying how to add it."""
    if (field := _field(model._meta, name)) is None:
        raise FenceColumnMissing(
            f"fenced write to {model._meta.label}: the model has no field {name!r}, where a "
            f"fenced model keeps the highest fence written to each row; {_adding(model, name)}"
        )
    return field


def _refuse_unknown(model: Any, label: str | Callable[[], str], **given: Mapping[str, Any]) -> None:
    """`InvalidValueError` for a name in one of ``given`` (``values=...``) that is no field of
    ``model`` (Django's ``FieldDoesNotExist`` names none of its fields)."""
    options: Any = model._meta
    for where, names in given.items():
        if unknown := [name for name in names if _field(options, name) is None]:
            fields = ", ".join(field.name for field in options.concrete_fields)
            raise InvalidValueError(
                f"fenced write to {label() if callable(label) else label}: {where} names "
                f"{', '.join(unknown)}, which is no field of {options.label} (its fields: "
                f"{fields}); name the model's fields"
            )


def _field(options: Any, name: str) -> Any:
    """The model's field ``name`` (``options``: its ``_meta``), or None."""
    try:
        return options.get_field(name)
    except FieldDoesNotExist:
        return None


def _adding(model: Any, name: str) -> str:
    return (
        f"add {name} = fence_field() (from celery_dflock.fencing.django) to "
        f"{model._meta.object_name}, then {_migrating(model)}"
    )


def _migrating(model: Any) -> str:
    return (
        f"run manage.py makemigrations {model._meta.app_label} and manage.py migrate "
        "(an AddField: existing rows get 0)"
    )


@contextmanager
def _column_checked(
    model: Any, field: Any, upsert: tuple[str, Mapping[str, Any]] | None = None
) -> Generator[None]:
    """The database's error that ``model``'s table lacks ``field``'s column as
    `FenceColumnMissing` (and that the key of ``upsert``, (its label, key), is no unique key,
    as `InvalidValueError`)."""
    try:
        yield
    except _db.DatabaseError as error:
        if upsert is not None and (refused := key_not_unique(*upsert, str(error))):
            raise refused from error
        if not no_such_column(str(error), field.column):
            raise
        raise FenceColumnMissing(
            f"fenced write to {model._meta.label}: its table {model._meta.db_table!r} has no "
            f"column {field.column!r} in the database (the database said: "
            f"{str(error).strip().splitlines()[0]}); {_migrating(model)}"
        ) from error


def _model_class(helper: str, given: object, takes: str = "a model class") -> Any:
    """``given``, checked to be a model class (``takes``: what ``helper`` takes, in words)."""
    if not (isinstance(given, type) and issubclass(given, models.Model)):
        kind: str = type(cast("object", given)).__name__
        raise TypeError(f"{helper} takes {takes}, not {kind}")
    return given


def _queryset(target: Any) -> Any:
    """A queryset as it is; a manager's or a model's (its default manager's) rows."""
    if isinstance(target, models.QuerySet):
        return cast("Any", target)
    if isinstance(target, models.Manager):
        return cast("Any", target).all()
    takes = "a queryset, a manager or a model"
    return _model_class("fenced_update", target, takes)._default_manager.all()


def _described(queryset: Any) -> str:
    """The queryset's ``WHERE`` clause, for a message ("(all)" without one)."""
    try:
        sql = str(queryset.query)
    except Exception:  # a queryset that cannot be written as SQL (an empty one: .none())
        return "(not expressible as SQL)"
    _, found, where = sql.partition(" WHERE ")
    return f"where {where}" if found else "(all)"
