"""Notice at once when a held lock's connection is closed by the server.

The server releases a connection's locks when the connection closes (a restart, a drain, an
idle timeout), and a client that only renews every ``lease * renew_ratio`` would go on believing
it holds the lock until then. A `ConnectionWatcher` polls the sockets of held locks' connections
from one daemon thread per process; when one becomes readable while no request is in flight
(the server never sends bytes nobody asked for, so that is EOF, a reset or garbage), its
callback runs. The callback never interrupts a request: it only acts when it can take the
lock's operation lock at once (see `celery_dflock.client`).

Plain TCP connections only: a TLS socket can become readable for protocol records (session
tickets) that carry no reply, so TLS holds are left to their renewals.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import threading
from collections.abc import Callable
from typing import Final

from celery_dflock._threads import leave_signals_to_the_main_thread

__all__ = ["ConnectionWatcher"]

_EVENTS: Final = (
    select.POLLIN | select.POLLHUP | select.POLLERR | select.POLLNVAL
    if hasattr(select, "poll")
    else 0
)

WatchCallback = Callable[[], bool]
"""Runs when the socket is readable; True to keep watching it, False to stop."""


class ConnectionWatcher:
    """Polls watched sockets from one daemon thread, running while anything is watched.

    Fork safe as the `Renewer` is: a fork child gets a watcher state of its own and never
    touches the parent's (whose mutex may have been held at fork time)."""

    def __init__(self) -> None:
        self._by_pid: dict[int, _ProcessWatcher] = {}

    def _current(self, create: bool) -> _ProcessWatcher | None:
        pid = os.getpid()
        current = self._by_pid.get(pid)
        if current is None and create:
            # setdefault: two threads of a new child agree on one state without a lock.
            current = self._by_pid.setdefault(pid, _ProcessWatcher())
            for other in [p for p in self._by_pid if p != pid]:
                self._by_pid.pop(other, None)
        return current

    def watch(self, fd: int, callback: WatchCallback) -> None:
        """Call ``callback`` once ``fd`` is readable (it replaces an earlier one for ``fd``)."""
        current = self._current(create=True)
        assert current is not None
        current.watch(fd, callback)

    def unwatch(self, fd: int) -> None:
        current = self._current(create=False)
        if current is not None:
            current.unwatch(fd)

    @property
    def watched(self) -> int:
        """Sockets watched in this process now."""
        current = self._current(create=False)
        return 0 if current is None else len(current.entries)


class _ProcessWatcher:
    """One process's watched sockets and the thread that polls them."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._entries: dict[int, WatchCallback] = {}
        self._poller: select.poll | None = None
        self._wake_w: socket.socket | None = None
        self._wake_r: socket.socket | None = None

    @property
    def entries(self) -> dict[int, WatchCallback]:
        return self._entries

    def _ensure(self) -> select.poll:
        """The poller, its thread started if none runs (mutex held)."""
        if self._poller is not None:
            return self._poller
        wake_r, wake_w = socket.socketpair()
        wake_r.setblocking(False)
        wake_w.setblocking(False)
        self._wake_r, self._wake_w = wake_r, wake_w
        poller = select.poll()
        poller.register(wake_r.fileno(), select.POLLIN)
        self._poller = poller
        thread = threading.Thread(
            target=self._loop, args=(poller, wake_r, wake_w), name="dflock-watch", daemon=True
        )
        try:
            thread.start()
        except BaseException:
            self._poller = None
            wake_r.close()
            wake_w.close()
            raise
        return poller

    def watch(self, fd: int, callback: WatchCallback) -> None:
        with self._mutex:
            poller = self._ensure()
            self._entries[fd] = callback
            poller.register(fd, _EVENTS)
            wake = self._wake_w
        if wake is not None:  # a poll under way does not see new descriptors: start another
            with contextlib.suppress(OSError):
                wake.send(b"w")

    def unwatch(self, fd: int) -> None:
        with self._mutex:
            if self._poller is None:
                return
            if self._entries.pop(fd, None) is None:
                return
            with contextlib.suppress(KeyError, ValueError):
                self._poller.unregister(fd)
            wake = self._wake_w if not self._entries else None
        if wake is not None:  # nothing left to watch: let the thread exit
            with contextlib.suppress(OSError):
                wake.send(b"u")

    def _loop(self, poller: select.poll, wake_r: socket.socket, wake_w: socket.socket) -> None:
        leave_signals_to_the_main_thread()
        wake_fd = wake_r.fileno()
        while True:
            with self._mutex:
                if self._poller is not poller:
                    return
                if not self._entries:  # nothing to watch: exit (the next watch starts anew)
                    self._poller = None
                    self._wake_w = self._wake_r = None
                    wake_r.close()
                    wake_w.close()
                    return
            try:
                events = poller.poll()
            except InterruptedError:  # pragma: no cover - PEP 475 retries
                continue
            due: list[tuple[int, WatchCallback]] = []
            with self._mutex:
                if self._poller is not poller:
                    return  # a fork child's copy of this thread never runs; belt and braces
                for fd, _ in events:
                    if fd == wake_fd:
                        with contextlib.suppress(OSError):
                            wake_r.recv(4096)
                        continue
                    callback = self._entries.pop(fd, None)
                    with contextlib.suppress(KeyError, ValueError):
                        poller.unregister(fd)
                    if callback is not None:
                        due.append((fd, callback))
            for fd, callback in due:
                try:
                    keep = callback()
                except Exception:  # pragma: no cover - a callback bug must not stop the rest
                    keep = False
                if keep:
                    with self._mutex:
                        if self._poller is poller and fd not in self._entries:
                            self._entries[fd] = callback
                            poller.register(fd, _EVENTS)
