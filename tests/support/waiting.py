"""Polling for state that no event announces (server queues, connection counts, files)."""

from __future__ import annotations

import time
from collections.abc import Callable

POLL_S = 0.01


def wait_until(
    predicate: Callable[[], object], *, timeout: float = 10.0, what: str = "", poll: float = POLL_S
) -> float:
    """Poll ``predicate`` until it returns something true, or fail saying ``what`` was
    awaited (the predicate itself when ``what`` is empty) after ``timeout`` seconds. Returns
    the seconds it waited."""
    start = time.monotonic()
    deadline = start + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(poll)
    return time.monotonic() - start
