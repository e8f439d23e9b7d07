"""Lease renewal for the blocking locks: a heap of held locks and a few long-lived threads.

A `Renewer` keeps a heap of renewals ordered by when each is due. One of its threads (the
*leader*) sleeps until the earliest is due, takes it, passes the timekeeping on, and runs it.
While it runs, another thread keeps time for the others: an idle one, else a new one, started
only if every renewal under way has run over ``STALL_S``. So a silent server never holds up
renewals elsewhere, and a burst of renewals does not start a thread each. Threads exit after
``linger_s`` without work; a forked child starts from an empty schedule."""

from __future__ import annotations

import heapq
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Final

from celery_dflock.client._threads import leave_signals_to_the_main_thread
from celery_dflock.client._watch import ConnectionWatcher

__all__ = ["MAX_RENEWAL_THREADS", "Renewal", "Renewer"]

logger: Final = logging.getLogger("celery_dflock.client")

MAX_RENEWAL_THREADS: Final = 32
STALL_S: Final = 0.05  # a renewal under way this long counts as stalled (its server slow or gone)
EARLY_S: Final = 0.1  # a renewal due this soon runs now: the leader wakes once per 0.1 s at most
_COMPACT_AT: Final = 64  # rebuild the heap when cancelled renewals outnumber this and the live

RenewCallback = Callable[["Renewal"], bool]  # renews once; True: again after the interval


class Renewal:
    """One held lock's place in a renewal schedule (returned by `Renewer.schedule`)."""

    __slots__ = (
        "_schedule", "callback", "cancelled", "due", "interval", "next_in", "queued", "runner",
    )  # fmt: skip

    def __init__(
        self, schedule: _Schedule, callback: RenewCallback, interval: float, due: float
    ) -> None:
        self._schedule = schedule
        self.callback: RenewCallback | None = callback
        self.interval = interval
        self.due = due
        self.next_in: float | None = None  # set by the callback: the next call's delay, once
        self.cancelled = False
        self.queued = False
        self.runner: int | None = None  # ident of the thread running the callback now

    def cancel(self) -> None:
        """No renewal starts after this returns (one already running may still finish)."""
        self._schedule.cancel(self)

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for a running callback to end (not from inside it)."""
        runner = self.runner
        if runner is None or runner == threading.get_ident():
            return
        self._schedule.wait(self, timeout)


class Renewer:
    """Renews held locks at their intervals from long-lived daemon threads; ``linger_s``: how
    long an idle thread waits for work before it exits."""

    def __init__(self, *, linger_s: float, name: str = "dflock-renew") -> None:
        self._linger_s = linger_s
        self._name = name
        self._by_pid: dict[int, _Schedule] = {}
        self.watcher = ConnectionWatcher()  # for a close by the server of a held connection

    def _schedule(self) -> _Schedule:
        """This process's schedule (fresh in a fork child: the parent's mutex may be held)."""
        pid = os.getpid()
        current = self._by_pid.get(pid)
        if current is None:
            # setdefault: two threads of a new child agree on one schedule without a lock.
            current = self._by_pid.setdefault(pid, _Schedule(pid, self._linger_s, self._name))
            for other in [p for p in self._by_pid if p != pid]:
                self._by_pid.pop(other, None)
        return current

    def schedule(
        self, callback: RenewCallback, interval: float, first_in: float | None = None
    ) -> Renewal:
        """Call ``callback(renewal)`` every ``interval`` s until it returns False or the
        renewal is cancelled; the first call after ``first_in`` s (default: ``interval``)."""
        return self._schedule().schedule(callback, interval, first_in)

    @property
    def thread_count(self) -> int:
        return self._schedule().threads

    @property
    def scheduled(self) -> int:
        """Renewals waiting for their time in this process now."""
        return self._schedule().live

    def __repr__(self) -> str:
        return f"<Renewer scheduled={self.scheduled} threads={self.thread_count}>"


class _Schedule:
    """One process's heap of renewals and the threads that run them."""

    def __init__(self, pid: int, linger_s: float, name: str) -> None:
        self.pid = pid
        self._linger_s = linger_s
        self._name = name
        self._mutex = threading.Lock()
        self._wake = threading.Condition(self._mutex)  # the leader waits here
        self._spare = threading.Condition(self._mutex)  # idle threads wait here to lead
        self._done = threading.Condition(self._mutex)  # `wait` callers wait here
        self._heap: list[tuple[float, int, Renewal]] = []
        self._seq = 0
        self.live = 0  # queued, not cancelled
        self._dead = 0  # queued, cancelled (left in the heap, dropped lazily)
        self.threads = 0
        self._starting = 0  # threads started that have not yet taken the mutex
        self._spares = 0
        self._waiters = 0
        self._leader = False
        self._wake_at = 0.0  # when the waiting leader wakes on its own
        self._recent_interval: float | None = None  # of the renewal scheduled last
        self._busy: dict[int, float] = {}  # thread ident -> when it started its callback

    def schedule(self, callback: RenewCallback, interval: float, first_in: float | None) -> Renewal:
        due = time.monotonic() + (interval if first_in is None else first_in)
        renewal = Renewal(self, callback, interval, due)
        with self._mutex:
            self._recent_interval = interval
            self._push(renewal)
            if self._leader:
                if renewal.due < self._wake_at:
                    self._wake.notify()
            elif self._spares:
                self._spare.notify()
            elif self._starting:
                pass  # a thread on its way takes the heap as it comes (it will lead)
            elif self.threads < MAX_RENEWAL_THREADS:
                self._start_thread()
        return renewal

    def cancel(self, renewal: Renewal) -> None:
        if self.pid != os.getpid():
            return  # the parent's renewal, in a fork child: nothing here to cancel
        with self._mutex:
            if renewal.cancelled:
                return
            renewal.cancelled = True
            renewal.callback = None  # hold no reference to the lock from here on
            if not renewal.queued:
                return
            self.live -= 1
            self._dead += 1
            self._drop_cancelled()
            if self.live == 0 and self._leader and self._linger_s == 0:
                self._wake.notify()  # nothing left to renew: let the thread exit now

    def wait(self, renewal: Renewal, timeout: float) -> None:
        if self.pid != os.getpid():
            return
        me = threading.get_ident()
        deadline = time.monotonic() + timeout
        with self._mutex:
            self._waiters += 1
            try:
                while renewal.runner is not None and renewal.runner != me:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        return
                    self._done.wait(remaining)
            finally:
                self._waiters -= 1

    def _push(self, renewal: Renewal) -> None:
        self._seq += 1
        renewal.queued = True
        heapq.heappush(self._heap, (renewal.due, self._seq, renewal))
        self.live += 1

    def _drop_cancelled(self) -> None:
        heap = self._heap
        while heap and heap[0][2].cancelled:
            heapq.heappop(heap)[2].queued = False
            self._dead -= 1
        if self._dead > _COMPACT_AT and self._dead > self.live:
            for _, _, renewal in heap:
                if renewal.cancelled:
                    renewal.queued = False
            kept = [item for item in heap if not item[2].cancelled]
            heapq.heapify(kept)
            self._heap = kept
            self._dead = 0

    def _start_thread(self) -> None:
        thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
        self.threads += 1
        self._starting += 1
        try:
            thread.start()
        except BaseException:
            self.threads -= 1
            self._starting -= 1
            raise

    def _start_spare(self) -> None:
        """Start a thread to keep time for the others (at the pid limit: renew late)."""
        try:
            self._start_thread()
        except RuntimeError as exc:
            logger.warning(
                "dflock renewal: no spare thread (%s); renewing with the ones running", exc
            )

    def _loop(self) -> None:
        leave_signals_to_the_main_thread()
        renewal: Renewal | None = None
        keep = False
        starting = True
        try:
            while True:
                with self._mutex:
                    if starting:  # counted as on its way until it holds the mutex to take
                        self._starting -= 1
                        starting = False
                    if renewal is not None:
                        self._finish(renewal, keep)
                    renewal = self._take()
                    if renewal is None:
                        return
                    callback = renewal.callback
                keep = False
                if callback is not None:
                    try:
                        keep = callback(renewal)
                    except Exception:  # a bug in one callback must not stop every renewal
                        logger.exception("unexpected error in a dflock renewal")
        finally:
            with self._mutex:
                if starting:
                    self._starting -= 1
                self.threads -= 1
                if renewal is not None and renewal.runner is not None:
                    self._finish(renewal, False)  # only if this thread died mid-way

    def _take(self) -> Renewal | None:
        """Wait for a due renewal and take it (mutex held); None: this thread should exit."""
        idle_since: float | None = None
        while True:
            if self._leader:  # another thread keeps time: wait to be called on
                self._spares += 1
                try:
                    called = self._spare.wait(self._linger_s)
                finally:
                    self._spares -= 1
                if not called and (self._leader or self.live == 0):
                    return None  # idle for linger_s and not needed
                continue
            self._drop_cancelled()
            now = time.monotonic()
            if self._heap:
                idle_since = None
                due = self._heap[0][0]
                if due <= now + EARLY_S:
                    renewal = heapq.heappop(self._heap)[2]
                    renewal.queued = False
                    self.live -= 1
                    me = threading.get_ident()
                    renewal.runner = me
                    if self.live:  # someone must keep time for the others meanwhile
                        if self._spares:
                            self._spare.notify()
                        elif self.threads < MAX_RENEWAL_THREADS and all(
                            now - started > STALL_S for started in self._busy.values()
                        ):
                            self._start_spare()
                    self._busy[me] = now
                    return renewal
                timeout = due - now
            else:
                if idle_since is None:
                    idle_since = now
                timeout = idle_since + self._linger_s - now
                if timeout <= 0:
                    return None
                if self._recent_interval is not None:
                    # Wake by when a lock granted now would be due: no wake-up call needed.
                    timeout = min(timeout, self._recent_interval)
            self._leader = True
            self._wake_at = now + timeout
            try:
                self._wake.wait(timeout)
            finally:
                self._leader = False

    def _finish(self, renewal: Renewal, keep: bool) -> None:
        """After a callback ran (mutex held): schedule its next run, wake `wait` callers."""
        if renewal.runner is not None:
            self._busy.pop(renewal.runner, None)
        renewal.runner = None
        if keep and not renewal.cancelled:
            next_in, renewal.next_in = renewal.next_in, None
            renewal.due = time.monotonic() + (renewal.interval if next_in is None else next_in)
            self._push(renewal)
            if self._leader and renewal.due < self._wake_at:
                self._wake.notify()
        else:
            renewal.callback = None
        if self._waiters:
            self._done.notify_all()
