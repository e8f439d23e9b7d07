"""One turn of the server's asyncio loop (``loops.TurnLoop``), compiled with the request path.

asyncio's selector loop runs each turn in Python (``BaseEventLoop._run_once``, the selector's
``select``, ``_process_events``): at one connection, where every request is a turn of its own,
that was half the compiled server's instructions per request on asyncio's loop (103k against
50k on uvloop's, benchmarks.instructions). ``Turn.run`` is the same turn, step for step as
CPython 3.11 to 3.13 run it (timers cancelled, the wait, the I/O callbacks, the timers due,
the ready callbacks), compiled, and then the loop's turn-end callbacks (``TurnLoop``'s
``at_turn_end``: the lease journal's group write). In debug mode, and on a CPython the turn
was not checked against, the loop runs asyncio's own turn, then the turn-end callbacks.

This module reads asyncio's loop and handles from the inside (their underscored attributes),
as a subclass of the loop does: ``_ready``, ``_selector``, ``_scheduled``, ``_stopping``,
``_timer_cancelled_count``, ``_clock_resolution``, an epoll selector's ``_selector`` and
``_fd_to_key``, a handle's ``_cancelled``, a timer's ``_when`` and ``_scheduled``, and a
handle's ``_context``, ``_callback``, ``_args`` and ``_source_traceback`` to run it as
``Handle._run`` does, inlined (its exceptions go to the loop's handler as from
``Handle._run``, the callback named by ``asyncio.format_helpers``).
tests/server/test_loops.py checks the turn against asyncio's own: callbacks, one that raises,
timers, cancelled timers, I/O, and the order of a turn's end.
"""

# pyright: reportPrivateUsage=false

from __future__ import annotations

import contextvars
import heapq
import math
import select
import selectors
import time
from asyncio import format_helpers
from collections import deque
from collections.abc import Callable
from typing import Any, Final, Protocol

__all__ = ["Turn"]

_MAXIMUM_SELECT_TIMEOUT: Final = 24 * 3600.0
"""asyncio's longest wait (``base_events.MAXIMUM_SELECT_TIMEOUT``)."""
_MIN_SCHEDULED_TIMER_HANDLES: Final = 100
_MIN_CANCELLED_TIMER_HANDLES_FRACTION: Final = 0.5
"""When asyncio rebuilds its timer heap instead of popping cancelled timers off its head."""
_EVENT_READ: Final = selectors.EVENT_READ
_EVENT_WRITE: Final = selectors.EVENT_WRITE
_NOT_EPOLLIN: Final = ~select.EPOLLIN if hasattr(select, "EPOLLIN") else 0
_NOT_EPOLLOUT: Final = ~select.EPOLLOUT if hasattr(select, "EPOLLOUT") else 0
"""An epoll event other than "in" makes the fd writable too, other than "out" readable (as
``EpollSelector.select`` reads them: an error or a hang-up wakes both)."""
_monotonic: Final = time.monotonic
"""The loop's clock (``BaseEventLoop.time``), without its method call."""


class _Handle(Protocol):
    """What a turn uses of an ``asyncio.Handle``."""

    _cancelled: bool
    _callback: Callable[..., object]
    _args: tuple[Any, ...]
    _context: contextvars.Context
    _source_traceback: object


class _Timer(_Handle, Protocol):
    """And of an ``asyncio.TimerHandle``."""

    _when: float
    _scheduled: bool

    def __lt__(self, other: _Timer, /) -> bool: ...


class _Loop(Protocol):
    """What a turn uses of asyncio's selector loop."""

    _scheduled: list[_Timer]
    _stopping: bool
    _timer_cancelled_count: int
    _clock_resolution: float

    def _remove_reader(self, fd: Any) -> bool: ...

    def _remove_writer(self, fd: Any) -> bool: ...

    def call_exception_handler(self, context: dict[str, Any]) -> None: ...


class _Epolling(Protocol):
    """What a turn uses of a ``selectors.EpollSelector``."""

    _selector: select.epoll
    _fd_to_key: dict[int, selectors.SelectorKey]


class Turn:
    """The turn of one ``TurnLoop`` (see the module's doc)."""

    def __init__(self, loop: Any, turn_end: list[Callable[[], object]]) -> None:
        self._loop: _Loop = loop
        self._ready: deque[_Handle] = loop._ready
        """The loop's ``_ready`` (one deque for the loop's life: asyncio only mutates it)."""
        self._selector: selectors.BaseSelector = loop._selector
        self._epolling: _Epolling | None = (
            loop._selector
            if type(self._selector) is getattr(selectors, "EpollSelector", None)
            else None
        )
        """The selector, when the turn waits on its epoll object itself (Linux: asyncio's
        default)."""
        self.turn_end = turn_end
        """The loop's turn-end callbacks (``TurnLoop.turn_end``)."""

    def run(self) -> None:
        """One turn, as ``BaseEventLoop._run_once`` runs it, then the turn's end."""
        loop = self._loop
        ready = self._ready
        scheduled = loop._scheduled
        count = len(scheduled)
        if (
            count > _MIN_SCHEDULED_TIMER_HANDLES
            and loop._timer_cancelled_count / count > _MIN_CANCELLED_TIMER_HANDLES_FRACTION
        ):
            kept: list[_Timer] = []
            for timer in scheduled:
                if timer._cancelled:
                    timer._scheduled = False
                else:
                    kept.append(timer)
            heapq.heapify(kept)
            loop._scheduled = scheduled = kept
            loop._timer_cancelled_count = 0
        else:
            while scheduled and scheduled[0]._cancelled:
                loop._timer_cancelled_count -= 1
                timer = heapq.heappop(scheduled)
                timer._scheduled = False

        timeout: float | None = None
        if ready or loop._stopping:
            timeout = 0.0
        elif scheduled:
            timeout = scheduled[0]._when - _monotonic()
            if timeout > _MAXIMUM_SELECT_TIMEOUT:
                timeout = _MAXIMUM_SELECT_TIMEOUT
            elif timeout < 0.0:
                timeout = 0.0

        epolling = self._epolling
        if epolling is not None:
            # EpollSelector.select, inlined: the wait, then each ready fd's key and mask
            epoll = epolling._selector
            fd_to_key = epolling._fd_to_key
            if timeout is None:
                wait = -1.0
            elif timeout <= 0.0:
                wait = 0.0
            else:  # epoll_wait waits whole ms: round up, to wait at least ``timeout``
                wait = math.ceil(timeout * 1e3) * 1e-3
            try:
                fd_events = epoll.poll(wait, len(fd_to_key) or 1)
            except InterruptedError:
                fd_events = []
            for fd, event in fd_events:
                key = fd_to_key.get(fd)
                if key is not None:
                    self._ready_io(
                        key,
                        (
                            (_EVENT_WRITE if event & _NOT_EPOLLIN else 0)
                            | (_EVENT_READ if event & _NOT_EPOLLOUT else 0)
                        )
                        & key.events,
                    )
        else:
            for key, mask in self._selector.select(timeout):
                self._ready_io(key, mask)

        end_time = _monotonic() + loop._clock_resolution
        while scheduled:
            timer = scheduled[0]
            if timer._when >= end_time:
                break
            timer = heapq.heappop(scheduled)
            timer._scheduled = False
            ready.append(timer)

        for _ in range(len(ready)):
            handle = ready.popleft()
            if not handle._cancelled:
                # (handle._run(), inlined: it is a Python frame per callback, and on asyncio's
                # loop every readable connection is one)
                try:
                    handle._context.run(handle._callback, *handle._args)
                except (SystemExit, KeyboardInterrupt):
                    raise
                except BaseException as exc:
                    self._callback_failed(handle, exc)
        if self.turn_end:
            self.end()

    def _callback_failed(self, handle: _Handle, exc: BaseException) -> None:
        """What ``Handle._run`` hands the loop's exception handler when a callback raises
        (outside debug mode, the only mode this turn runs in: CPython 3.13 names the callback
        by the loop's debug flag)."""
        source = format_helpers._format_callback_source(handle._callback, handle._args)
        context: dict[str, Any] = {
            "message": f"Exception in callback {source}",
            "exception": exc,
            "handle": handle,
        }
        if handle._source_traceback:
            context["source_traceback"] = handle._source_traceback
        self._loop.call_exception_handler(context)

    def _ready_io(self, key: selectors.SelectorKey, mask: int) -> None:
        """Queue ``key``'s reader and writer as ``mask`` says (``_process_events``)."""
        reader: _Handle | None
        writer: _Handle | None
        reader, writer = key.data
        if mask & _EVENT_READ and reader is not None:
            if reader._cancelled:
                self._loop._remove_reader(key.fileobj)
            else:
                self._ready.append(reader)
        if mask & _EVENT_WRITE and writer is not None:
            if writer._cancelled:
                self._loop._remove_writer(key.fileobj)
            else:
                self._ready.append(writer)

    def end(self) -> None:
        """Run the turn-end callbacks, and those they add (an exception goes to the loop's
        exception handler, as a callback's does). What they schedule runs in the next turn,
        which does not wait for I/O while callbacks are ready. The list is emptied in place:
        ``loops.at_turn_end`` hands out its ``append``."""
        callbacks = self.turn_end
        i = 0
        try:
            while i < len(callbacks):
                callback = callbacks[i]
                i += 1
                try:
                    callback()
                except (SystemExit, KeyboardInterrupt):
                    raise
                except BaseException as exc:  # as asyncio's Handle does for a callback
                    self._loop.call_exception_handler(
                        {
                            "message": f"Exception in turn-end callback {callback!r}",
                            "exception": exc,
                        }
                    )
        finally:
            del callbacks[:i]
