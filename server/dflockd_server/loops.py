"""The event loops the server runs on: uvloop's, the default, or asyncio's own
(``--event-loop asyncio``, or ``auto`` where uvloop is not installed).

The lease journal is written once per turn of the loop by a callback that the turn's first
held-back reply schedules with ``call_soon`` (``stream.GroupWrite``). uvloop runs it in the same
turn, after the turn's other callbacks; asyncio's own loop in the next turn. Either way the
journal is written before the replies it covers."""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib
from collections.abc import Callable
from typing import TypeVar

__all__ = ["default_loop_factory", "loop_name", "run_on", "uvloop_factory"]

T = TypeVar("T")


def uvloop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's ``new_event_loop`` where uvloop can be imported, else None."""
    try:
        module = importlib.import_module("uvloop")
    except ImportError:
        return None
    return module.new_event_loop


def default_loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """The loop ``--event-loop auto`` runs."""
    return uvloop_factory() or asyncio.new_event_loop


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """``uvloop`` or ``asyncio`` for theirs and loops derived from them; else the module."""
    for kind in type(loop).__mro__:
        name = kind.__module__.split(".")[0]
        if name in ("uvloop", "asyncio"):
            return name
    return type(loop).__module__.split(".")[0]


def run_on(loop: asyncio.AbstractEventLoop, fn: Callable[[], T], timeout: float | None = None) -> T:
    """``fn()`` run on ``loop`` (from another thread), waiting up to ``timeout`` for its result."""
    future: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn())
        except BaseException as exc:
            future.set_exception(exc)

    loop.call_soon_threadsafe(run)
    return future.result(timeout)
