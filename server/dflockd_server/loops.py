"""The event loops the server runs on: uvloop's, or asyncio's selector loop with a turn's end.

The lease journal is written once per turn of the loop, for every connection whose replies wait
for it (``stream.GroupWrite``), after the callbacks of that turn. uvloop runs a callback that a
callback of the turn scheduled with ``call_soon`` in the same turn, so that is where the group
write goes there. asyncio's own loop runs it in the *next* turn, after one more ``epoll_wait``
that finds nothing: at one connection, where every request is a turn of its own, that second
turn was a fifth of the compiled server's own instructions per request (benchmarks.instructions;
the kernel's share of a round trip, larger here, is not counted there). ``TurnLoop`` is
asyncio's selector loop with
``at_turn_end``: the callback runs once the turn's callbacks have run, just before the loop waits
for I/O again, in the same turn. The server's own asyncio loop (``dflockd --event-loop asyncio``,
or ``auto`` without uvloop, and ``testing.ServerThread``) is a ``TurnLoop``; a server started on
any other loop (a program's own) schedules its group write with ``call_soon``, as before.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable
from contextvars import Context
from typing import TypeVarTuple, Unpack

__all__ = ["TurnLoop", "at_turn_end", "loop_name"]

_Ts = TypeVarTuple("_Ts")


class _TurnEndSelector(selectors.DefaultSelector):
    """The platform's selector, running the loop's turn-end callbacks before each wait."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: TurnLoop | None = None

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        loop = self.loop
        if loop is not None and loop.turn_end and loop.run_turn_end():
            timeout = 0  # the callbacks scheduled more: run it before waiting
        return super().select(timeout)


class TurnLoop(asyncio.SelectorEventLoop):
    """asyncio's selector event loop with ``at_turn_end`` (see the module's doc)."""

    def __init__(self) -> None:
        selector = _TurnEndSelector()
        super().__init__(selector)
        selector.loop = self
        self.turn_end: list[Callable[[], object]] = []
        """Callbacks to run at the end of this turn, in order."""
        self._scheduled_more = False
        """Set when a turn-end callback scheduled a callback or a timer."""

    def at_turn_end(self, callback: Callable[[], object]) -> None:
        """Run ``callback`` once the callbacks of this turn of the loop have run, before it
        waits for I/O again (in a callback: this turn; outside the loop: its next turn)."""
        self.turn_end.append(callback)

    def run_turn_end(self) -> bool:
        """Run the turn-end callbacks, and those they add (an exception goes to the loop's
        exception handler, as a callback's does); True if they scheduled a callback or a
        timer. The list is emptied in place: ``at_turn_end`` hands out its ``append``."""
        callbacks = self.turn_end
        self._scheduled_more = False
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
                    self.call_exception_handler(
                        {
                            "message": f"Exception in turn-end callback {callback!r}",
                            "exception": exc,
                        }
                    )
        finally:
            del callbacks[:i]
        return self._scheduled_more

    def call_soon(
        self,
        callback: Callable[[Unpack[_Ts]], object],
        *args: *_Ts,
        context: Context | None = None,
    ) -> asyncio.Handle:
        self._scheduled_more = True
        return super().call_soon(callback, *args, context=context)

    def call_at(
        self,
        when: float,
        callback: Callable[[Unpack[_Ts]], object],
        *args: *_Ts,
        context: Context | None = None,
    ) -> asyncio.TimerHandle:
        self._scheduled_more = True
        return super().call_at(when, callback, *args, context=context)


def at_turn_end(loop: asyncio.AbstractEventLoop) -> Callable[[Callable[[], None]], object]:
    """How to run a callback after the callbacks of this turn of ``loop``: on a ``TurnLoop``,
    its turn-end list's ``append`` (what ``at_turn_end`` does, without a Python frame);
    ``call_soon`` elsewhere (uvloop runs it in the same turn; asyncio's plain loop in the
    next)."""
    if isinstance(loop, TurnLoop):
        return loop.turn_end.append  # a C call on every request: no Python frame
    return loop.call_soon


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """What the start-up log calls ``loop``: ``asyncio`` (a ``TurnLoop`` too), ``uvloop``."""
    if isinstance(loop, TurnLoop):
        return "asyncio"
    return type(loop).__module__.split(".")[0]
