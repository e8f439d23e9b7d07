"""Leader election for beat: a background thread that holds (or waits for) one dflockd lock.

The thread owns the waiting: it queues on the lock in FIFO order (``enqueue``, then a bounded
``wait``), flips :attr:`Leadership.term` when the lock is granted, and waits for the lock to be
lost (the client's renewal thread reports that through ``on_lost``) or for :meth:`stop`.
The scheduler's thread only reads the state and asks :meth:`Leadership.confirm` right before
each send, so a long tick or a long sleep between ticks never delays renewal.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Final, Protocol

from celery_dflock.client.clients import leave_signals_to_the_main_thread
from celery_dflock.client.errors import DflockError

__all__ = ["LeaderLock", "Leadership"]

logger = logging.getLogger("celery_dflock.beat")

#: Seconds one blocking acquire waits in the queue before it is issued again (the thread
#: re-checks whether it was asked to stop between two acquires).
STANDBY_ACQUIRE_TIMEOUT_S: Final = 10
#: Seconds between two attempts to reach an unreachable lock server.
RETRY_UNREACHABLE_S: Final = 1.0


class LeaderLock(Protocol):
    """What the election needs from a lock (``celery_dflock.DistributedLock`` fits)."""

    @property
    def lost(self) -> bool: ...

    @property
    def server(self) -> tuple[str, int]: ...

    def enqueue(self) -> object: ...  # "acquired" (true) or "queued" (false)

    def wait(self, timeout_s: float | None = None) -> bool: ...

    def renew(self) -> bool: ...

    def release(self) -> bool: ...


class Leadership:
    """Campaign for one lock in a daemon thread; expose whether this process is the leader.

    ``make_lock(on_lost)`` builds a fresh lock object for each campaign (a lost lock is never
    reused); ``confirm(lock)`` asks the server whether ``lock`` is still held, and returns
    False when it is not (or the server cannot say); ``on_granted(lock)``, when given, runs in
    the campaign thread each time the lock is granted, before this process turns active (it
    must not raise).
    """

    def __init__(
        self,
        *,
        make_lock: Callable[[Callable[[object], None]], LeaderLock],
        confirm: Callable[[LeaderLock], bool],
        describe: str,
        acquire_timeout_s: float = STANDBY_ACQUIRE_TIMEOUT_S,
        retry_s: float = RETRY_UNREACHABLE_S,
        on_granted: Callable[[LeaderLock], None] | None = None,
    ) -> None:
        self._make_lock = make_lock
        self._confirm = confirm
        self._on_granted = on_granted
        self.describe = describe
        self._acquire_timeout_s = acquire_timeout_s
        self._retry_s = retry_s
        # Re-entrant: beat's signal handler runs close() (and with it stop() and confirm()) in
        # the main thread, possibly while the interrupted main thread holds the guard.
        self._guard = threading.RLock()
        self._lock: LeaderLock | None = None
        self._term = 0
        self._active = threading.Event()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def acquire_timeout_s(self) -> float:
        """How long one queued acquire blocks before it is re-issued."""
        return self._acquire_timeout_s

    @property
    def term(self) -> int:
        """Increases by one every time this process is granted the lock."""
        with self._guard:
            return self._term

    def start(self) -> None:
        """Start campaigning (idempotent)."""
        with self._guard:
            if self._thread is not None or self._stop.is_set():
                return
            self._thread = threading.Thread(
                target=self._run, name="dflock-beat-leader", daemon=True
            )
            self._thread.start()
        logger.info("beat: standby, waiting for %s", self.describe)

    def is_active(self) -> bool:
        """True while this process holds the lock and has not seen it lost."""
        with self._guard:
            lock = self._lock
        return self._active.is_set() and lock is not None and not lock.lost

    def wait_active(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` for this process to become the leader."""
        return self._active.wait(timeout_s) and self.is_active()

    def confirm(self) -> bool:
        """Ask the lock server, now, whether this process still holds the lock.

        A refusal (or a server not reached again before the lease runs out: a broken
        connection is reattached meanwhile) demotes this process at once: the caller must
        not send.
        """
        with self._guard:
            lock = self._lock
        if lock is None or not self._active.is_set() or lock.lost:
            return False
        if self._confirm(lock):
            return True
        self._demote(lock, "the lock server no longer confirms it")
        return False

    def stop(self, *, release: bool = True) -> None:
        """Stop campaigning and release the lock if held (idempotent).

        A campaign thread blocked in a queued acquire is not waited for: it is a daemon, and
        should the lock be granted to it after this, it releases it at once.

        ``release=False`` (the caller's thread is in the middle of a request on the lock's
        connection): stop being active and campaigning, but keep the lock for a later
        ``stop()`` to release, and send nothing on that connection now.
        """
        self._stop.set()
        self._wake.set()
        if not release:
            self._active.clear()
            return
        with self._guard:
            lock, self._lock = self._lock, None
        self._active.clear()
        if lock is not None:
            _release_quietly(lock)
            logger.info("beat: released %s", self.describe)

    # -- the campaign thread -------------------------------------------------------------

    def _on_lost(self, _lock: object) -> None:
        self._active.clear()
        self._wake.set()

    def _demote(self, lock: LeaderLock, why: str) -> None:
        with self._guard:
            if self._lock is not lock:
                return
            self._lock = None
        self._active.clear()
        self._wake.set()
        _release_quietly(lock)
        logger.warning("beat: lost %s (%s); stopped sending, back to standby", self.describe, why)

    def _run(self) -> None:
        leave_signals_to_the_main_thread()
        unreachable = False
        while not self._stop.is_set():
            lock: LeaderLock | None = None
            try:
                lock = self._make_lock(self._on_lost)
                granted = lock.enqueue()  # join the FIFO queue (or take a free lock)
                if unreachable:
                    logger.info(
                        "beat: standby, lock server reachable again, waiting for %s",
                        self.describe,
                    )
                    unreachable = False
                if not granted:
                    granted = lock.wait(self._acquire_timeout_s)
            except Exception as exc:  # a DflockError, or a bug: never let the thread die
                if not isinstance(exc, DflockError):
                    logger.exception("beat: unexpected error while waiting for %s", self.describe)
                if not unreachable:
                    logger.warning(
                        "beat: standby, cannot take %s (%s); retrying every %.1fs",
                        self.describe,
                        exc,
                        self._retry_s,
                    )
                unreachable = True
                if lock is not None:
                    _release_quietly(lock)
                self._stop.wait(self._retry_s)
                continue
            if not granted:
                continue
            if self._on_granted is not None:
                try:
                    self._on_granted(lock)
                except Exception:  # a bug: the lock is held all the same
                    logger.exception("beat: error after taking %s", self.describe)
            with self._guard:
                if self._stop.is_set():
                    _release_quietly(lock)
                    return
                self._wake.clear()
                self._lock = lock
                self._term += 1
                self._active.set()
            logger.info("beat: active, holding %s", self.describe)
            self._hold(lock)

    def _hold(self, lock: LeaderLock) -> None:
        while not self._stop.is_set() and not lock.lost:
            with self._guard:
                if self._lock is not lock:
                    return  # demoted by confirm(); already logged and released
            self._wake.wait(self._acquire_timeout_s)
            self._wake.clear()
        if lock.lost:
            self._demote(lock, "renewal refused or the lock server is gone")


def _release_quietly(lock: LeaderLock) -> None:
    try:
        lock.release()
    except DflockError as exc:
        logger.debug("beat: release after loss failed: %s", exc)
