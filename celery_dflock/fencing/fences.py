"""The rule every store's fenced write follows: the fence is present, an int within a
``BIGINT``, and not below the one the store keeps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, cast

from celery_dflock.client.errors import InvalidValueError
from celery_dflock.fencing.errors import FenceMissing, StaleFence

__all__ = ["FENCE_COLUMN", "MAX_FENCE", "no_such_column", "refuse_below", "require_fence"]

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


def no_such_column(said: str, column: str) -> bool:
    """Whether a database's error text ``said`` says ``column`` is not there."""
    said = said.lower()
    return column.lower() in said and any(
        words in said
        for words in ("does not exist", "no such column", "unknown column", "has no column")
    )
