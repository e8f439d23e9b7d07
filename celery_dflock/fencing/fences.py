"""The rule every store's fenced write follows: the fence is present, an int within a
``BIGINT``, and not below the one the store keeps."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final, cast

from celery_dflock.client.errors import InvalidValueError
from celery_dflock.fencing.errors import FenceMissing, StaleFence

FENCE_COLUMN: Final = "dflock_fence"
"""The default column, hash field or key suffix where a store keeps its highest fence."""
MAX_FENCE: Final = (1 << 63) - 1
"""The largest fence a store here takes (a signed 64-bit ``BIGINT``)."""


def require_fence(fence: int | None, target: str | Callable[[], str]) -> int:
    """``fence`` checked for a write to ``target`` (a callable is called only for an error)."""
    if isinstance(fence, int) and not isinstance(fence, bool) and 0 <= fence <= MAX_FENCE:
        return fence
    if callable(target):
        target = target()
    if fence is None:
        raise FenceMissing(
            f"fenced write to {target} refused: it carries no fence (None). The lock server "
            "that granted the lock issues no fencing tokens (lock.fence is None on dflockd "
            "0.4/0.5 and the Go server), or the write ran outside a locked run; run "
            "dflockd-server, whose tokens are fences, and pass self.lock.fence"
        )
    if isinstance(fence, bool) or not isinstance(fence, int):  # pyright: ignore[reportUnnecessaryIsInstance]
        raise InvalidValueError(
            f"fenced write to {target}: fence must be the lock's fence, an int "
            f"(self.lock.fence), not {type(fence).__name__} {fence!r}"
        )
    raise InvalidValueError(
        f"fenced write to {target}: fence {fence} is outside 0..{MAX_FENCE}, which no "
        "lock server issues; pass self.lock.fence"
    )


def refuse_below(target: str | Callable[[], str], fence: int, kept: object) -> None:
    """Raise `StaleFence` when ``kept``, the fence the store holds for ``target`` (None: none),
    is above ``fence``, the write's."""
    if kept is not None and (held := int(cast("Any", kept))) > fence:
        raise StaleFence.refused(target() if callable(target) else target, fence, held)


def refuse_unwritten(target: str | Callable[[], str], fence: int, kept: object, rows: int) -> None:
    """After a fenced write that wrote nothing to the ``rows`` rows of ``target`` it named:
    `StaleFence` when ``kept``, their highest fence, is above ``fence``; `InvalidValueError`
    when there are rows all the same (their fence is NULL, which no fence compares with)."""
    refuse_below(target, fence, kept)
    if rows and kept is None:
        raise InvalidValueError(
            f"fenced write to {target() if callable(target) else target} refused: the row's "
            "fence column holds NULL, which no fence compares with, so nothing was written; "
            "make the column NOT NULL DEFAULT 0 and set it to 0 where it is NULL"
        )


def refuse_key_misuse(
    target: str | Callable[[], str], key: Mapping[str, Any], values: Mapping[Any, Any]
) -> None:
    """An upsert's ``key`` with a None value (NULL conflicts with no row, so each call would
    insert a new row no fence guards), or ``values`` giving a column of ``key`` another value."""
    nulls = [name for name, value in key.items() if value is None]
    both = [name for name in key if name in values and _differs(values[name], key[name])]
    if not nulls and not both:
        return
    where = f"fenced upsert into {target() if callable(target) else target}"
    if nulls:
        raise InvalidValueError(
            f"{where}: key {', '.join(nulls)} is None, and NULL matches no row of a unique key: "
            "each call would insert a new row that no fence guards; give the key's value"
        )
    raise InvalidValueError(
        f"{where}: values give the key's {', '.join(both)} another value; the row's key is "
        "key's (leave it out of values)"
    )


def _differs(given: object, key: object) -> bool:
    """Whether ``given`` is not the key's value; an expression counts as another value (a
    SQLAlchemy clause's ``!=`` builds a clause, whose truth raises ``TypeError``)."""
    try:
        return bool(given != key)
    except TypeError:
        return True


def upsert_elsewhere(target: str) -> InvalidValueError:
    """An upsert into ``target`` that found no row at its key afterwards (MySQL's ``ON
    DUPLICATE KEY UPDATE`` takes a conflict on any unique key)."""
    return InvalidValueError(
        f"fenced upsert into {target}: the row collided with another row on a unique key other "
        "than key, so the row of key was not written (and the other row may have been: roll "
        "the transaction back); name in key the unique key of the row, and give values no "
        "other row holds in a unique column"
    )


_NO_UNIQUE_KEY: Final = (
    "no unique or exclusion constraint matching the on conflict",  # PostgreSQL
    "does not match any primary key or unique constraint",  # SQLite
)
"""What the databases say, in their first line, of ``ON CONFLICT`` on columns that are no
unique key (PostgreSQL then quotes the statement: another error may show ``ON CONFLICT``)."""


def key_not_unique(target: str, key: Iterable[str], said: str) -> InvalidValueError | None:
    """The database's refusal (``said``) of an upsert into ``target`` whose ``key`` is not
    a unique key (PostgreSQL's and SQLite's ``ON CONFLICT``), in the caller's terms; None for
    another error."""
    first = (said.strip().splitlines() or [""])[0]
    if not any(words in first.lower() for words in _NO_UNIQUE_KEY):
        return None
    return InvalidValueError(
        f"fenced upsert into {target}: key names {', '.join(key)}, which is not the primary key "
        f"or a unique key of the table (the database said: {first}); "
        "name in key every column of the primary key or of one unique constraint, or add that "
        "constraint"
    )


_NO_SUCH_COLUMN: Final = ("does not exist", "no such column", "unknown column", "has no column")
"""What the databases say of a column that is not there (with its name)."""


def no_such_column(said: str, column: str) -> bool:
    """Whether a database's error text ``said`` says ``column`` is not there."""
    said = said.lower()
    return column.lower() in said and any(words in said for words in _NO_SUCH_COLUMN)
