"""The two signals a locked run sends, defined below the run's machinery that sends them
(public as `celery_dflock.signals.lock_lost` and `celery_dflock.signals.lock_skipped`, which
documents their arguments).
"""

from __future__ import annotations

from typing import Any, Final

from celery_dflock._celery import Signal

__all__ = ["lock_lost", "lock_skipped"]

lock_lost: Final[Any] = Signal(name="lock_lost")
"""A running task's lock was lost (renewal refused, or its server unreachable)."""
lock_skipped: Final[Any] = Signal(name="lock_skipped")
"""A task run was skipped because its lock was busy (``on_locked="skip"``)."""
