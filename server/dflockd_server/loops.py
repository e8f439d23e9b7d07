"""The event loops the server runs on: uvloop's, or asyncio's selector loop with a turn's end.

The lease journal is written once per turn of the loop, for every connection whose replies wait
for it (``stream.GroupWrite``; a connection alone in its turns writes it itself), after the
callbacks of that turn. uvloop runs a callback that a callback of the turn scheduled with
``call_soon`` in the same turn, so that is where the group write goes there. asyncio's own loop
runs it in the *next* turn, after one more ``epoll_wait`` that finds nothing: at one connection,
where every request is a turn of its own, that second turn was a fifth of the compiled server's
own instructions per request (benchmarks.instructions; the kernel's share of a round trip,
larger here, is not counted there).

``TurnLoop`` is asyncio's selector loop with ``at_turn_end``: the callback runs once the turn's
callbacks have run, before the loop waits for I/O again, in the same turn. Its turns are
``turn.Turn``'s: asyncio's turn, step for step, compiled with the request path (asyncio runs
its turn in Python: at one connection that was a quarter of the compiled server's instructions
per request), then the turn's end. What a turn-end callback schedules is ready for the next
turn, which therefore does not wait for I/O. The server's own asyncio loop (``dflockd
--event-loop asyncio``, or ``auto`` without uvloop, and ``testing.ServerThread``) is a
``TurnLoop``; a server started on any other loop (a program's own) schedules its group write
with ``call_soon``, as before.
"""

from __future__ import annotations

import asyncio
import socket
import sys
from collections.abc import Callable
from typing import Any

from dflockd_server.stream import Stream
from dflockd_server.transport import SocketTransport
from dflockd_server.turn import Turn

__all__ = ["TURN_CHECKED_ON", "TurnLoop", "at_turn_end", "loop_name"]

TURN_CHECKED_ON = ((3, 11), (3, 12), (3, 13))
"""The CPython versions whose loop turn ``turn.Turn`` runs step for step (the versions CI runs
the server's tests on); on any other, a ``TurnLoop`` runs asyncio's own turn, then its end."""


class TurnLoop(asyncio.SelectorEventLoop):
    """asyncio's selector event loop with ``at_turn_end``, its turns run by ``turn.Turn``
    (see the module's doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.turn_end: list[Callable[[], object]] = []
        """Callbacks to run at the end of this turn, in order."""
        self._turn = Turn(self, self.turn_end)
        self._own_turn = sys.version_info[:2] in TURN_CHECKED_ON

    def at_turn_end(self, callback: Callable[[], object]) -> None:
        """Run ``callback`` once the callbacks of this turn of the loop have run, before it
        waits for I/O again (in a callback: this turn; outside the loop: its next turn)."""
        self.turn_end.append(callback)

    def _run_once(self) -> None:
        """One turn, then the turn's end: ``Turn.run``; asyncio's own turn in debug mode (its
        slow-callback warnings) or on a CPython whose turn ``Turn`` was not checked against."""
        if self._own_turn and not self.get_debug():
            self._turn.run()
        else:
            super()._run_once()  # pyright: ignore[reportAttributeAccessIssue, reportUnknownMemberType]
            self._turn.end()

    def _make_socket_transport(  # pyright: ignore[reportIncompatibleMethodOverride]
        self,
        sock: socket.socket,
        protocol: asyncio.BaseProtocol,
        waiter: asyncio.Future[None] | None = None,
        *,
        extra: dict[str, Any] | None = None,
        server: Any = None,
    ) -> asyncio.Transport:
        """A connection the server accepted: ``transport.SocketTransport`` (compiled with the
        request path), where the turn is ``Turn``'s and not in debug mode; asyncio's own
        socket transport for anything else."""
        if self._own_turn and isinstance(protocol, Stream) and not self.get_debug():
            return SocketTransport(self, sock, protocol, waiter=waiter, extra=extra, server=server)
        make = super()._make_socket_transport  # pyright: ignore[reportAttributeAccessIssue, reportUnknownMemberType, reportUnknownVariableType]
        return make(sock, protocol, waiter, extra=extra, server=server)  # pyright: ignore[reportUnknownVariableType]


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
