"""Our background threads leave the process's signals to its main thread.

A signal goes to any thread that does not block it, and one of default action kills the
process from any thread. In billiard's pool an ending child blocks SIGTERM in its main thread
while holding a lock shared with the other children; a second SIGTERM taken by one of our
threads would kill it with that lock held, and the pool would stop taking tasks."""

from __future__ import annotations

import os
import signal
from typing import Final

__all__ = ["leave_signals_to_the_main_thread"]

_PROCESS_SIGNALS: Final = frozenset(
    getattr(signal, name)
    for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGALRM")
    if hasattr(signal, name)
)


def _on_the_main_os_thread() -> bool:
    """True on the process's first OS thread, or when that cannot be told. Read from
    ``/proc``: under gevent or eventlet a "thread" may be a greenlet on the main OS thread."""
    try:
        tid = int(os.readlink("/proc/thread-self").rsplit("/", 1)[1])
    except (OSError, ValueError):
        return True
    return tid == os.getpid()


def leave_signals_to_the_main_thread() -> None:
    """Block `_PROCESS_SIGNALS` in the calling OS thread (not on the main OS thread)."""
    if _on_the_main_os_thread() or not hasattr(signal, "pthread_sigmask"):
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, _PROCESS_SIGNALS)
