"""The one thing the tests do not make real: time, for the pure parts that take a clock."""

from __future__ import annotations


class FakeClock:
    """A clock a test sets by hand (``clock.now += 5``); pass it where a ``() -> float``
    monotonic clock is wanted."""

    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now
