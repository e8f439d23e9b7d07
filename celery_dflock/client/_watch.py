"""Notice at once when a held lock's connection is closed by the server, so the lock
reattaches then rather than at its next renewal.

A `ConnectionWatcher` polls the sockets of held locks' connections from one daemon thread per
process; one readable with no request in flight (the server sends nothing unasked) runs its
callback, which acts only if it can take the lock's operation lock at once."""

from __future__ import annotations

import contextlib
import os
import select
import sys
import threading
import time
from collections.abc import Callable
from typing import Final

from celery_dflock.client._threads import leave_signals_to_the_main_thread

__all__ = ["ConnectionWatcher", "can_watch"]

_EVENTS: Final = (
    select.POLLIN | select.POLLHUP | select.POLLERR | select.POLLNVAL
    if hasattr(select, "poll")
    else 0
)
_EPOLL_EVENTS: Final = (
    # (gevent's patched ``select`` keeps these, without ``epoll``: see `_unpatched_epoll`)
    select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR if hasattr(select, "EPOLLIN") else 0
)


POLL_INTERVAL_MS: Final = 100  # one `poll`'s wait: a socket watched meanwhile is seen by the next
EPOLL_INTERVAL_MS: Final = 1000  # one epoll wait; a socket watched meanwhile is seen by it


def _unpatched_epoll() -> Callable[[], select.epoll] | None:
    """The kernel's epoll, also where gevent or eventlet took it out of ``select`` (their green
    ``poll`` starts a watcher per socket per call); None where there is none."""
    if hasattr(select, "epoll"):
        return select.epoll
    gevent_monkey = sys.modules.get("gevent.monkey")
    if gevent_monkey is not None:
        with contextlib.suppress(Exception):
            return gevent_monkey.get_original("select", "epoll")
    eventlet_patcher = sys.modules.get("eventlet.patcher")
    if eventlet_patcher is not None:
        with contextlib.suppress(Exception):
            return eventlet_patcher.original("select").epoll
    return None


def can_watch() -> bool:
    """Whether a `ConnectionWatcher` can poll sockets here (epoll, or ``poll``)."""
    return hasattr(select, "poll") or _unpatched_epoll() is not None


class _Poller:
    """The watched sockets' poll set: epoll where there is one (its wait costs the same however
    many are watched), else ``poll``. Under gevent or eventlet the watcher is a greenlet: it
    waits for the epoll descriptor with the green ``select``, then polls without waiting."""

    __slots__ = ("_epoll", "_green", "_set", "wait_ms")

    def __init__(self) -> None:
        epoll = _unpatched_epoll()
        self._green = epoll is not None and not hasattr(select, "epoll")
        self._epoll = epoll() if epoll is not None else None
        self._set = select.poll() if self._epoll is None else self._epoll  # the one in use
        self.wait_ms = POLL_INTERVAL_MS if self._epoll is None else EPOLL_INTERVAL_MS

    def register(self, fd: int) -> None:
        epoll = self._epoll
        if epoll is None:
            self._set.register(fd, _EVENTS)
            return
        try:
            epoll.register(fd, _EPOLL_EVENTS)
        except FileExistsError:
            epoll.modify(fd, _EPOLL_EVENTS)

    def unregister(self, fd: int) -> None:
        with contextlib.suppress(KeyError, ValueError, OSError):
            self._set.unregister(fd)

    def wait(self, timeout_ms: int) -> list[tuple[int, int]]:
        epoll = self._epoll
        if epoll is None:
            return self._set.poll(timeout_ms)
        if not self._green:
            return epoll.poll(timeout_ms / 1000)
        readable, _, _ = select.select([epoll.fileno()], [], [], timeout_ms / 1000)
        return epoll.poll(0) if readable else []


LINGER_S: Final = 5.0  # how long the thread waits, with nothing watched, before it exits

WatchCallback = Callable[[], bool]  # runs when the socket is readable; True: keep watching it


class ConnectionWatcher:
    """Polls watched sockets from one daemon thread; a fork child gets a state of its own."""

    def __init__(self) -> None:
        self._by_pid: dict[int, _ProcessWatcher] = {}

    def watch(self, fd: int, callback: WatchCallback) -> None:
        """Call ``callback`` once ``fd`` is readable (it replaces an earlier one for ``fd``)."""
        pid = os.getpid()
        current = self._by_pid.get(pid)
        if current is None:
            # setdefault: two threads of a new child agree on one state without a lock.
            current = self._by_pid.setdefault(pid, _ProcessWatcher())
            for other in [p for p in self._by_pid if p != pid]:
                self._by_pid.pop(other, None)
        current.watch(fd, callback)

    def unwatch(self, fd: int) -> None:
        current = self._by_pid.get(os.getpid())
        if current is not None:
            current.unwatch(fd)


class _ProcessWatcher:
    """One process's watched sockets and the thread that polls them (it lingers ``LINGER_S``
    after the last socket is let go, so locks taken one after the other share one thread)."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self.entries: dict[int, WatchCallback] = {}
        self._running_now: set[int] = set()  # sockets whose callback runs (out of `entries`)
        self._poller = _Poller()
        self._running = False
        self._idle_since = 0.0

    def watch(self, fd: int, callback: WatchCallback) -> None:
        with self._mutex:
            self.entries[fd] = callback
            self._poller.register(fd)
            if self._running:
                return
            self._running = True
        thread = threading.Thread(target=self._loop, name="dflock-watch", daemon=True)
        try:
            thread.start()
        except BaseException:
            with self._mutex:
                self._running = False
            raise

    def unwatch(self, fd: int) -> None:
        with self._mutex:
            self._running_now.discard(fd)  # a callback running now is not watched again
            if self.entries.pop(fd, None) is None:
                return
            self._poller.unregister(fd)
            if not self.entries:
                self._idle_since = time.monotonic()

    def _loop(self) -> None:
        leave_signals_to_the_main_thread()
        poller = self._poller
        while True:
            with self._mutex:
                if not self.entries and time.monotonic() - self._idle_since >= LINGER_S:
                    self._running = False  # the next watch starts a thread anew
                    return
            events = poller.wait(poller.wait_ms)  # (PEP 475: retried after a signal)
            if not events:
                continue
            due: list[tuple[int, WatchCallback]] = []
            with self._mutex:
                for fd, _ in events:
                    callback = self.entries.pop(fd, None)
                    poller.unregister(fd)
                    if callback is not None:
                        due.append((fd, callback))
                        self._running_now.add(fd)
                if due and not self.entries:
                    self._idle_since = time.monotonic()
            for fd, callback in due:
                try:
                    keep = callback()
                except Exception:  # pragma: no cover - a callback bug must not stop the rest
                    keep = False
                with self._mutex, contextlib.suppress(OSError):  # (closed meanwhile)
                    still = fd in self._running_now  # (not let go meanwhile)
                    self._running_now.discard(fd)
                    if keep and still and fd not in self.entries:
                        poller.register(fd)
                        self.entries[fd] = callback
