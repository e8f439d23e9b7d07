"""Raising an exception in a running task body from another thread or greenlet.

``on_lock_lost="interrupt"`` raises `LockLost` in the body while it runs. How depends on what
the body runs in, which the worker's pool decides:

* prefork, threads, solo: an OS thread. The exception is scheduled in it with
  ``PyThreadState_SetAsyncExc`` and raised at its next bytecode boundary.
* gevent, eventlet: a greenlet. Those pools monkey-patch ``threading``, so a thread id is a
  greenlet's and ``PyThreadState_SetAsyncExc`` finds no thread by it. The exception is thrown
  into the body's greenlet from the hub, as the libraries' own ``kill`` does, and is raised
  where the body yields (a sleep, a socket, a lock); a body that never yields never lets the
  renewal run either.

Either way the body may end before the exception lands: `BodyTarget.cancel` drops one not yet
delivered, and the caller raises `LockLost` itself when a lost lock's body returned anyway
(so a run whose lock was lost never ends as a success, whatever the pool).
"""

from __future__ import annotations

import ctypes
import sys
import threading
from collections.abc import Callable
from typing import Any, Protocol, cast

__all__ = ["BodyTarget", "current_body"]


class BodyTarget(Protocol):
    """Where a running body can be interrupted."""

    def interrupt(self, exc: type[BaseException]) -> bool:
        """Schedule ``exc`` in the body (from another thread or greenlet); False if it cannot
        be delivered there."""
        ...

    def cancel(self) -> None:
        """From the body, as it ends: drop an interrupt not delivered yet."""
        ...


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> int:
    """Schedule ``exc`` in thread ``thread_id`` (None clears a pending one); the number of
    threads changed."""
    set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
    set_async_exc.argtypes = (ctypes.c_ulong, ctypes.py_object)
    set_async_exc.restype = ctypes.c_int
    return cast("int", set_async_exc(thread_id, ctypes.py_object() if exc is None else exc))


class _ThreadBody:
    """A body running in an OS thread."""

    def __init__(self, thread_id: int) -> None:
        self._thread_id = thread_id
        self._sent = False

    def interrupt(self, exc: type[BaseException]) -> bool:
        self._sent = _set_async_exc(self._thread_id, exc) == 1
        return self._sent

    def cancel(self) -> None:
        if self._sent:
            _set_async_exc(self._thread_id, None)


class _GreenBody:
    """A body running in a greenlet of gevent's or eventlet's hub (in this OS thread)."""

    def __init__(self, greenlet: Any, schedule: Callable[[Callable[[], None]], object]) -> None:
        self._greenlet = greenlet
        self._schedule = schedule
        self._running = True
        self._exc: type[BaseException] | None = None

    def interrupt(self, exc: type[BaseException]) -> bool:
        self._exc = exc
        self._schedule(self._deliver)
        return True

    def _deliver(self) -> None:
        # Runs in the hub, so the body is switched out: it is running or it ended, no between.
        exc = self._exc
        if exc is not None and self._running and not self._greenlet.dead:
            self._greenlet.throw(exc)

    def cancel(self) -> None:
        self._running = False


def _patched_by_gevent() -> bool:
    monkey: Any = sys.modules.get("gevent.monkey")
    return monkey is not None and bool(monkey.is_module_patched("threading"))


def _patched_by_eventlet() -> bool:
    patcher: Any = sys.modules.get("eventlet.patcher")
    return patcher is not None and bool(patcher.is_monkey_patched("thread"))


def current_body() -> BodyTarget:
    """The thread or greenlet the caller runs in, as an interrupt target."""
    if _patched_by_gevent():
        gevent: Any = sys.modules["gevent"]
        loop: Any = gevent.get_hub().loop
        return _GreenBody(gevent.getcurrent(), loop.run_callback_threadsafe)
    if _patched_by_eventlet():
        greenthread: Any = sys.modules["eventlet.greenthread"]
        hub: Any = sys.modules["eventlet.hubs"].get_hub()

        def schedule(callback: Callable[[], None]) -> object:
            return hub.schedule_call_global(0, callback)

        return _GreenBody(greenthread.getcurrent(), schedule)
    return _ThreadBody(threading.get_ident())
