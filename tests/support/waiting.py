"""Polling for state that no event announces (server queues, connection counts, files)."""

from __future__ import annotations

import time
from collections.abc import Callable

POLL_S = 0.01
"""The first pause between two polls."""
POLL_MAX_S = 0.2
"""The longest pause between two polls: each pause is half as long again as the one before.
A state that comes at once is seen within about ``POLL_S``; a long wait polls five times a
second, not a hundred (predicates that scrape a server's metrics or read etcd's whole shard
map, polled every 10 ms by several tests at once, kept CI's two cores busy)."""


def wait_until(
    predicate: Callable[[], object],
    *,
    timeout: float = 10.0,
    what: str = "",
    poll: float = POLL_S,
    poll_max: float = POLL_MAX_S,
) -> float:
    """Poll ``predicate`` until it returns something true, or fail saying ``what`` was
    awaited (the predicate itself when ``what`` is empty) after ``timeout`` seconds. Returns
    the seconds it waited. The pause between polls starts at ``poll`` and grows to
    ``poll_max`` (pass the same for a fixed one)."""
    start = time.monotonic()
    deadline = start + timeout
    pause = poll
    while not predicate():
        now = time.monotonic()
        if now > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or predicate}")
        time.sleep(min(pause, max(deadline - now, 0.0) + 0.001))
        pause = min(pause * 1.5, max(poll_max, poll))
    return time.monotonic() - start
