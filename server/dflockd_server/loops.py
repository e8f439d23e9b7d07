"""The event loops the server runs on: uvloop's, the default (the dflockd-server distribution
depends on uvloop wherever it exists), or asyncio's own (``--event-loop asyncio``, or ``auto``
where uvloop is not installed).

The lease journal is written once per turn of the loop, for every connection whose replies wait
for it (``stream.GroupWrite``; a connection alone in its turns writes it itself), by a callback
that the turn's first held-back reply schedules with ``call_soon``. uvloop runs a callback that
a callback of the turn scheduled in the same turn, after the turn's other callbacks: one write
per turn, before the replies leave. asyncio's own loop runs it in the next turn, after one more
``epoll_wait`` that finds nothing; the journal is still written before the replies it covers.
A loop of the server's own that ended each turn with the write gained nothing on uvloop, which
the default install runs (benchmarks/results/ab/issue-52-turnloop.md).
"""

from __future__ import annotations

import asyncio
import importlib
from collections.abc import Callable

__all__ = ["default_loop_factory", "loop_name", "uvloop_factory"]


def uvloop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's ``new_event_loop`` where uvloop can be imported, else None."""
    try:
        module = importlib.import_module("uvloop")
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = module.new_event_loop
    return factory


def default_loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """The loop ``--event-loop auto`` (the default) runs: uvloop's where it can be imported,
    else asyncio's own."""
    return uvloop_factory() or asyncio.new_event_loop


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """What the start-up log, ``hello`` and ``stats`` call ``loop``: ``uvloop`` or ``asyncio``,
    for theirs and a loop derived from one of theirs; else the module it comes from."""
    for kind in type(loop).__mro__:
        name = kind.__module__.split(".")[0]
        if name in _KNOWN:
            return name
    return type(loop).__module__.split(".")[0]


_KNOWN = ("uvloop", "asyncio")
