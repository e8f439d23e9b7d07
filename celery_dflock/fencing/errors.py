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

    @classmethod
    def refused(cls, target: str, fence: int, highest: int) -> StaleFence:
        """The refusal of a write to ``target`` with ``fence``, the store holding ``highest``:
        its message says what happened and that nothing was written (every store's)."""
        return cls(
            f"fenced write to {target} refused: its fence {fence} is lower than {highest}, "
            "which a later holder of the lock wrote with; this run lost its lock (its lease "
            "ran out while it was paused, or it was told and went on), and nothing was written",
            target,
            fence,
            highest,
        )


class FenceMissing(DflockError):
    """A fenced write came without a fence (``None``): the lock server that granted the lock
    issues no fencing tokens (a dflockd 0.4/0.5 or the Go server, whose ``lock.fence`` is
    None), or the write was called outside a locked run. Nothing was written: there is nothing
    safe to compare, and writing unfenced would silently give up the protection."""
