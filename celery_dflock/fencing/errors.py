"""The two ways a fenced write is refused, in the `DflockError` tree.

Each carries a single message string that names the row or key, both fences and what to do (so
it pickles, and a Celery result shows it whole); the numbers are attributes too.
"""

from __future__ import annotations

from celery_dflock.client.errors import DflockError, LockLost

__all__ = ["FenceMissing", "StaleFence"]


class StaleFence(LockLost):
    """The store refused a write: it has seen a higher fence for this row or key, so another
    holder was granted the lock after this one (this run's lease ran out while it was paused,
    or its lock was lost). Nothing was written.

    A `LockLost`: the store is where a holder that did not notice its loss learns of it, so
    ``except LockLost`` covers both. ``target`` names the row or key, ``fence`` the write's
    fence and ``highest`` the one the store holds (0 when the message was rebuilt from text).
    """

    def __init__(self, message: str, target: str = "", fence: int = 0, highest: int = 0) -> None:
        super().__init__(message)
        self.target = target
        self.fence = fence
        self.highest = highest

    def __reduce__(self) -> tuple[type[StaleFence], tuple[str, str, int, int]]:
        return type(self), (str(self), self.target, self.fence, self.highest)


class FenceMissing(DflockError):
    """A fenced write came without a fence (``None``): the lock server that granted the lock
    issues no fencing tokens (a dflockd 0.4/0.5 or the Go server, whose ``lock.fence`` is
    None), or the write was called outside a locked run. Nothing was written: there is nothing
    safe to compare, and writing unfenced would silently give up the protection."""
