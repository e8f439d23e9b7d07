"""The simulator's event loop: a discrete-event scheduler on a virtual clock, one seed.

Events are ``(time, sequence number, callback)``: two events at the same time run in the order
they were scheduled, so nothing depends on the order of a set or on object ids. Every event that
matters is written to the run's trace (``note``), whose digest is how a test sees that a seed
replays exactly.
"""

from __future__ import annotations

import hashlib
import heapq
import random
from collections import Counter, deque
from collections.abc import Callable

__all__ = ["MAX_EVENTS", "Loop", "Runaway", "Timer"]

MAX_EVENTS = 200_000
"""A run's events at most (a few thousand are usual): more is a loop that never waits."""


class Runaway(Exception):
    """The run passed ``MAX_EVENTS``."""


class Timer:
    """One scheduled callback; ``cancel`` stops it from running."""

    __slots__ = ("callback", "cancelled", "when")

    def __init__(self, when: float, callback: Callable[[], None]) -> None:
        self.when = when
        self.callback = callback
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True


class Loop:
    """The virtual clock (``now``, seconds from the run's start), the event queue, the run's
    random generator and its trace."""

    def __init__(self, seed: int, *, keep_lines: int = 400) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.now = 0.0
        self._queue: list[tuple[float, int, Timer]] = []
        self._seq = 0
        self._digest = hashlib.sha256()
        self.lines: deque[str] = deque(maxlen=keep_lines)
        """The trace's last lines (shown when a run fails)."""
        self.events = 0
        self.seen: Counter[str] = Counter()
        """How often each kind of thing happened (``count``): what a test reads to see that
        the faults it relies on still happen."""

    def at(self, when: float, callback: Callable[[], None]) -> Timer:
        """Run ``callback`` at virtual time ``when`` (not before now)."""
        timer = Timer(max(when, self.now), callback)
        self._seq += 1
        heapq.heappush(self._queue, (timer.when, self._seq, timer))
        return timer

    def later(self, delay: float, callback: Callable[[], None]) -> Timer:
        return self.at(self.now + max(0.0, delay), callback)

    def run_until(self, end: float) -> None:
        """Run every event due up to ``end``; the clock then reads ``end``."""
        queue = self._queue
        while queue and queue[0][0] <= end:
            when, _, timer = heapq.heappop(queue)
            if timer.cancelled:
                continue
            self.now = when
            self.events += 1
            if self.events > MAX_EVENTS:
                raise Runaway(
                    f"more than {MAX_EVENTS} events by {when:.3f} s: a loop that never waits"
                )
            timer.callback()
        self.now = max(self.now, end)

    def note(self, text: str) -> None:
        """Add one line to the trace."""
        line = f"{self.now:10.4f} {text}"
        self._digest.update(line.encode())
        self._digest.update(b"\n")
        self.lines.append(line)

    def count(self, kind: str) -> None:
        self.seen[kind] += 1

    def digest(self) -> str:
        """The trace's digest so far: equal for two runs of one seed."""
        return self._digest.hexdigest()

    def uniform(self, low: float, high: float) -> float:
        return self.rng.uniform(low, high)

    def chance(self, p: float) -> bool:
        return self.rng.random() < p
