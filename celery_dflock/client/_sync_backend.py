"""What the blocking client does its own way (`celery_dflock.client._aio_backend` says how).

Here held locks are renewed from the long-lived threads of a `Renewer`
(`celery_dflock.client._renewal`): the pool's, or a lock's own without a pool. The renewer's
`ConnectionWatcher` notices at once when the server closes a held connection; its thread
drops that connection (never mid-request) and moves the renewal to now, which reattaches."""

from __future__ import annotations

import inspect
import threading
import time
from collections.abc import Callable
from typing import Final, Protocol

from celery_dflock.client._background import background_thread as background
from celery_dflock.client._core import LockCore
from celery_dflock.client._grant import LockState, closed_while_idle
from celery_dflock.client._renewal import Renewal, Renewer
from celery_dflock.client._settings import JOIN_TIMEOUT_S
from celery_dflock.client._sync.connection import Connection
from celery_dflock.client.errors import InvalidValueError

__all__ = [
    "Background", "Event", "OpLock", "PoolFace", "PoolRenewer", "RenewalDriver", "background",
    "call_back", "check_callback", "gather", "pause",
]  # fmt: skip

OpLock = threading.RLock  # reentrant: `on_lost` may run in a thread that holds it

RENEWAL_LINGER_S: Final = 30.0
"""A pool's renewal thread exits after this long with nothing to renew (it restarts on demand)."""

Event = threading.Event
pause = time.sleep
Background = threading.Thread


gather = list  # requests made one after the other


def call_back(callback: Callable[[], object]) -> None:
    callback()


def check_callback(callback: object) -> None:
    """``on_lost`` is called from a thread, which cannot await: an ``async def`` is refused."""
    if inspect.iscoroutinefunction(callback):
        raise InvalidValueError(
            f"on_lost of a blocking lock must be a plain function, got the coroutine function "
            f"{callback!r}: nothing would await it (use it with the asyncio face, "
            "AsyncClient or AsyncDistributedLock, or give a plain function)"
        )


class Renewable(Protocol):
    """What a driver needs of the lock's holding."""

    core: LockCore
    conn: Connection | None
    op_lock: threading.RLock

    def renew_guarded(self, scheduled: bool) -> bool | None: ...
    def renew_once(self, scheduled: bool) -> bool | None: ...


PoolRenewer = Renewer


class PoolFace:
    """What a blocking pool adds: the `Renewer` of the locks using it."""

    def __init__(self) -> None:
        self.renewer: PoolRenewer = Renewer(linger_s=RENEWAL_LINGER_S)

    def forked(self) -> None:
        """In a fork child: nothing (the renewer is fork safe itself)."""

    def check(self, *, bind: bool = True) -> None:
        """Before each use: nothing more than the fork check."""
        del bind


class _Pooled(Protocol):
    @property
    def renewer(self) -> Renewer: ...


class RenewalDriver:
    """Schedules one lock object's renewals on a `Renewer` and watches its held connection."""

    def __init__(self, lock: Renewable, pool: _Pooled | None) -> None:
        self._lock = lock
        self._pool = pool
        self._own: Renewer | None = None  # without a pool: this lock's own renewer
        self._renewal: Renewal | None = None  # the current grant's place in the schedule
        self._watched_fd: int | None = None  # the held connection's socket, watched for EOF
        self._stopping = False  # `stop` began: the renewal is never moved to now again
        self._guard = threading.Lock()  # `stop` and `poke` exchange `_renewal` under it

    def _renewer(self, name: str = "dflock-renew") -> Renewer:
        if self._pool is not None:
            return self._pool.renewer
        renewer = self._own
        if renewer is None:  # its thread exits as soon as nothing is held
            renewer = self._own = Renewer(linger_s=0, name=name)
        return renewer

    @property
    def cancelled(self) -> bool:
        """True once the current grant's renewal was cancelled (by `stop`)."""
        renewal = self._renewal
        return renewal is None or renewal.cancelled

    def start(self, conn: Connection, interval: float, first_in: float, name: str) -> None:
        """Renew every ``interval`` s, the first time in ``first_in`` s (operation lock held)."""
        with self._guard:
            self._stopping = False
            self._renewal = self._renewer(name).schedule(self._due, interval, first_in)
        self.attach(conn)

    def poke(self) -> None:
        """Move the next renewal to now, unless `stop` began (from any thread)."""
        with self._guard:
            renewal = self._renewal
            if self._stopping or renewal is None or renewal.cancelled:
                return
            self._renewal = self._renewer().schedule(self._due, renewal.interval, 0)
        renewal.cancel()

    def _due(self, renewal: Renewal) -> bool:
        """Called by the renewer every interval; True to be called again."""
        if renewal is not self._renewal:
            return False
        lock = self._lock
        if lock.renew_guarded(True) is not True:
            return False
        renewal.next_in = lock.core.next_look_in()
        return True

    def renewed(self, conn: Connection) -> None:
        """After a renewal: watch again (the watcher may have let go meanwhile)."""
        self.attach(conn)

    def renew_now(self) -> bool | None:
        return self._lock.renew_once(False)

    def forget(self) -> None:
        """In a fork child: the parent's schedule and watcher are not this process's."""
        self._renewal = None
        self._watched_fd = None

    def stop(self) -> None:
        """Stop renewing; wait for a renewal under way (and its on_lost), unless called from it."""
        with self._guard:
            self._stopping = True
            renewal = self._renewal
        if renewal is not None:
            renewal.cancel()  # no renewal starts after this
            renewal.wait(JOIN_TIMEOUT_S)

    def attach(self, conn: Connection) -> None:
        """Watch ``conn``, the lock's connection from now on (operation lock held)."""
        fd = conn.transport.watchable_fd()
        if fd is None:
            return
        self._watched_fd = fd
        self._renewer().watcher.watch(fd, lambda: self._connection_event(conn))

    def unwatch(self, conn: Connection | None) -> None:
        del conn
        fd, self._watched_fd = self._watched_fd, None
        if fd is not None:
            self._renewer().watcher.unwatch(fd)

    def _connection_event(self, conn: Connection) -> bool:
        """The held connection became readable with no request in flight: drop it and move
        the renewal to now (this thread never waits on the network). True to keep watching."""
        lock = self._lock
        if not lock.op_lock.acquire(blocking=False):
            return False
        try:
            core = lock.core
            if lock.conn is not conn or core.state is not LockState.HELD or core.lost:
                return False
            seen = conn.idle_breakage()
            if seen is None:
                return True  # a reply was read meanwhile: nothing wrong
            lock.conn = None
            self._watched_fd = None
            conn.close()
            core.connection_broke(closed_while_idle(seen))
            self.poke()
        finally:
            lock.op_lock.release()
        return False
