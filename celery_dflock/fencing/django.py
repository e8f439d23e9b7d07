# pyright: reportMissingTypeStubs=false
"""Fenced writes through Django's ORM (needs ``celery-dflock[django]`` and a configured Django).

The model keeps, in each row, the highest fence a write to that row carried: a field
``dflock_fence = fence_field()`` (a ``BigIntegerField(default=0)``; ``makemigrations`` turns
it into an ``AddField`` that gives every existing row 0). `fenced_update` is one ``UPDATE``::

    queryset.filter(dflock_fence__lte=fence).update(dflock_fence=fence, **values)

so the check and the write are one atomic statement of the database: a row another holder
wrote with a higher fence is not matched, and nothing is written to it. When no row was
updated, one aggregate tells a refusal (`StaleFence`) from a queryset that matches no row (0 is
returned, as ``update()`` does). The queryset should name one row (``pk=...``).
"""

from __future__ import annotations

from typing import Any, cast

from django.db import models

from celery_dflock.fencing.errors import StaleFence
from celery_dflock.fencing.fences import FENCE_COLUMN, require_fence

__all__ = ["fence_field", "fenced_update"]


def fence_field() -> Any:
    """The fence field of a model (``dflock_fence = fence_field()``): a
    ``BigIntegerField(default=0)``, not editable in forms or the admin (a row never written
    under a lock carries 0, below every fence)."""
    big_integer: Any = models.BigIntegerField  # Django is untyped: its defaults read as types
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
    its rows).
    ``fence``: the lock's fence (``self.lock.fence``); a fence equal to the row's is accepted
    (one holder writes several times), a lower one raises `StaleFence` and None raises
    `FenceMissing`, both without writing. ``values``: what ``update()`` takes (``F()``
    expressions included). ``fence_name``: the fence field, if not ``dflock_fence``.
    """
    queryset = _queryset(target)

    def label() -> str:  # compiled for a message only
        return f"{queryset.model._meta.label} rows {_described(queryset)}"

    fence = require_fence(fence, label)
    updated = int(
        queryset.filter(**{f"{fence_name}__lte": fence}).update(**values, **{fence_name: fence})
    )
    if updated:
        return updated
    highest = queryset.aggregate(highest=models.Max(fence_name))["highest"]
    if highest is not None and int(highest) > fence:
        raise StaleFence.refused(label(), fence, int(highest))
    return 0


def _queryset(target: Any) -> Any:
    """A queryset as it is; a manager's or a model's (its default manager's) rows."""
    if isinstance(target, models.QuerySet):
        return cast("Any", target)
    if isinstance(target, models.Manager):
        return cast("Any", target).all()
    if isinstance(target, type) and issubclass(target, models.Model):
        return cast("Any", target)._default_manager.all()
    kind: str = type(cast("object", target)).__name__
    raise TypeError(f"fenced_update takes a queryset, a manager or a model, not {kind}")


def _described(queryset: Any) -> str:
    """The queryset's ``WHERE`` clause, for a message ("(all)" without one)."""
    try:
        sql = str(queryset.query)
    except Exception:  # a queryset that cannot be written as SQL (an empty one: .none())
        return "(not expressible as SQL)"
    _, found, where = sql.partition(" WHERE ")
    return f"where {where}" if found else "(all)"
