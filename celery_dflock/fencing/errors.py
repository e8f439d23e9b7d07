"""The ways a fenced write is refused, in the `DflockError` tree.

Each carries one message string naming the row or key, both fences and what to do (so it
pickles, and a Celery result shows it whole).
"""

from __future__ import annotations

from celery_dflock.client.errors import DflockError, LockLost


class StaleFence(LockLost):
    """The store refused a write, nothing written: it has seen a higher fence for this row or
    key, so another holder wrote after this run was granted its lock (a later holder of the
    same key, or a holder of another key writing the same row: fences are one sequence).

    A `LockLost`, so ``except LockLost`` covers both. ``target`` names the row or key,
    ``fence`` the write's fence and ``highest`` the one the store holds.
    """

    def __init__(self, message: str, target: str = "", fence: int = 0, highest: int = 0) -> None:
        super().__init__(message)
        self.target = target
        self.fence = fence
        self.highest = highest

    @classmethod
    def refused(cls, target: str, fence: int, highest: int) -> StaleFence:
        """Every store's refusal of a write to ``target`` with ``fence`` below ``highest``."""
        return cls(
            f"fenced write to {target} refused: its fence {fence} is lower than {highest}, the "
            "fence the store holds, so another holder wrote after this run was granted its "
            "lock: either a later holder of this run's lock key (this run lost its lock: its "
            "lease ran out while it was paused, or it was told and went on), or a holder of "
            "another lock key that writes the same row or key (fences are one sequence across "
            "keys: write each row under one lock key). Nothing was written",
            target,
            fence,
            highest,
        )


class FenceMissing(DflockError):
    """A fenced write came without a fence (``None``: a lock server without fencing tokens,
    or a write outside a locked run). Nothing was written."""


class FenceColumnMissing(DflockError):
    """The table (or model) a fenced write names has no fence column, in its declaration or in
    the database; nothing was written. The message gives the lines that add it. Each store's
    ``check_fence_*`` raises it at deploy time."""
