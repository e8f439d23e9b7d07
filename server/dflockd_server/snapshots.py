"""``stats`` snapshots, rationed: a flood of ``stats`` cannot take the server's time.

After a snapshot that took ``t`` seconds of the loop, the next is taken no sooner than
``STATS_DUTY_FACTOR * t`` later; each ``stats`` asked meanwhile waits for it and gets the same
reply, at most ``STATS_ANSWERS_PER_TURN`` askers per turn of the loop."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from typing import Protocol

from dflockd_server import constants as c


class Asker(Protocol):
    def stats_ready(self, reply: bytes) -> None:
        """The ``stats`` it asked is answered with ``reply`` (ignored once it has closed)."""
        ...


class RationedSnapshots:
    """Answers ``stats`` requests from rationed snapshots made by ``make_reply``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, make_reply: Callable[[], bytes]) -> None:
        self._loop = loop
        self._make_reply = make_reply
        self._waiting: list[Asker] = []
        self._next_at = 0.0  # math.inf while a reply is being delivered
        self._handle: asyncio.Handle | None = None  # the next snapshot, or the next batch
        self.taken = 0  # snapshots taken (each answers one or more `stats`)

    def request(self, asker: Asker) -> bytes | None:
        """The reply to ``asker``'s ``stats`` now, or ``None``: ``asker.stats_ready`` later."""
        if not self._waiting and self._loop.time() >= self._next_at:
            started = time.perf_counter()
            reply = self._take()
            spent = time.perf_counter() - started
            self._next_at = self._loop.time() + c.STATS_DUTY_FACTOR * spent
            return reply
        self._waiting.append(asker)
        if self._handle is None:
            self._handle = self._loop.call_at(self._next_at, self._answer)
        return None

    def flush(self) -> None:
        """Answer everyone still waiting now (the server stops)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._waiting:
            reply = self._take()
            waiting, self._waiting = self._waiting, []
            for asker in waiting:
                asker.stats_ready(reply)

    def _take(self) -> bytes:
        self.taken += 1
        return self._make_reply()

    def _answer(self) -> None:
        started = time.perf_counter()
        waiting, self._waiting = self._waiting, []
        reply = self._take()
        self._next_at = math.inf  # while delivering: later askers wait for the next one
        self._deliver(reply, waiting, 0, time.perf_counter() - started)

    def _deliver(self, reply: bytes, waiting: list[Asker], start: int, spent: float) -> None:
        self._handle = None
        started = time.perf_counter()
        end = start + c.STATS_ANSWERS_PER_TURN
        for asker in waiting[start:end]:
            asker.stats_ready(reply)
        spent += time.perf_counter() - started
        if end < len(waiting):
            self._handle = self._loop.call_soon(self._deliver, reply, waiting, end, spent)
            return
        self._next_at = self._loop.time() + c.STATS_DUTY_FACTOR * spent
        if self._waiting:
            self._handle = self._loop.call_at(self._next_at, self._answer)
