"""Work started and not waited for, in each face's way: a task of the running loop
(`background_task`) or a daemon thread that leaves the process's signals to the main thread
(`background_thread`). The backends name theirs `background`; a connection, which the backends
import, takes it from here."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine

from celery_dflock.client._threads import leave_signals_to_the_main_thread

__all__ = ["background_task", "background_thread"]


def background_task(
    work: Callable[[], Coroutine[object, object, None]], name: str
) -> asyncio.Task[None]:
    """Run ``work()`` in a task of the running loop; the caller does not wait for it."""
    return asyncio.get_running_loop().create_task(work(), name=name)


def background_thread(work: Callable[[], None], name: str) -> threading.Thread:
    """Run ``work()`` in a daemon thread nobody waits for (its work is bounded)."""

    def run() -> None:
        leave_signals_to_the_main_thread()
        work()

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    return thread
