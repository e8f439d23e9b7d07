"""A simulated process: alive or killed, running or paused, with a monotonic clock of its own.

Every event meant for a process goes through ``Process.later`` (its timers) or ``Process.run``
(a delivery from the network): while it is paused the event waits for the pause's end, in its
order; once it is killed (or restarted: a new ``life``), events of its earlier lives are dropped.
"""

from __future__ import annotations

from collections.abc import Callable

from tests.sim.loop import Loop, Timer

__all__ = ["Process"]


class Process:
    """One process of the run (a server or a client)."""

    def __init__(self, loop: Loop, name: str, *, clock_offset: float) -> None:
        self.loop = loop
        self.name = name
        self.clock_offset = clock_offset
        """What its monotonic clock reads at the run's start."""
        self.alive = True
        self.life = 0
        """Counts its starts: an event of an earlier life is dropped."""
        self.paused_until = 0.0
        self._deferred: list[Callable[[], None]] = []
        self._resume: Timer | None = None

    def clock(self) -> float:
        """Its monotonic clock (``time.monotonic()`` as the process reads it)."""
        return self.loop.now + self.clock_offset

    @property
    def paused(self) -> bool:
        return self.loop.now < self.paused_until

    def later(self, delay: float, callback: Callable[[], None]) -> Timer:
        """A timer of this life of the process."""
        life = self.life
        return self.loop.later(delay, lambda: self._fire(life, callback))

    def run(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` in the process now (or at the end of its pause; never once dead)."""
        self._fire(self.life, callback)

    def _fire(self, life: int, callback: Callable[[], None]) -> None:
        if not self.alive or life != self.life:
            return
        if self.paused:
            self._deferred.append(callback)
            return
        callback()

    def pause(self, seconds: float) -> None:
        """Freeze the process (SIGSTOP, a long GC, a VM stall) for ``seconds``."""
        self.paused_until = max(self.paused_until, self.loop.now + seconds)
        self.loop.note(f"{self.name} paused for {seconds:.2f} s")
        if self._resume is not None:
            self._resume.cancel()
        self._resume = self.loop.at(self.paused_until, self._resumed)

    def _resumed(self) -> None:
        self._resume = None
        self.loop.note(f"{self.name} resumes")
        deferred, self._deferred = self._deferred, []
        life = self.life
        for callback in deferred:
            self._fire(life, callback)

    def kill(self) -> None:
        """SIGKILL: nothing of this life runs again."""
        self.alive = False
        self.paused_until = 0.0
        self._deferred = []
        self.loop.note(f"{self.name} killed")

    def start(self) -> None:
        """A new life (after a kill): its earlier life's events stay dropped."""
        self.alive = True
        self.life += 1
        self.paused_until = 0.0
        self._deferred = []
