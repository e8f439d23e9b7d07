"""Our background threads leave the process's signals to its main thread.

A signal sent to a process (``kill``) goes to any one of its threads that does not block it.
Python runs its handlers in the main thread whichever thread took the signal, but a signal
whose action is the default one kills the process from any thread, and a signal the main
thread blocks for a moment is then not held back at all.

That broke billiard's pool children. A child that is ending (SIGTERM: a revoke, a hard time
limit) sends its last message to the parent with SIGTERM blocked in its main thread, while it
holds a lock it shares with the other children; the parent answers that message with a second
SIGTERM, whose action is by then the default one. Delivered to one of our renewal threads, it
killed the child with the lock held, and no child could report to the parent again: the pool
stopped taking tasks. So each of our threads blocks the signals a process is asked to stop or
act with, as soon as it starts.
"""

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
    """True on the process's first OS thread, or when that cannot be told (then the mask is
    left alone). Read from ``/proc``: under gevent or eventlet a "thread" may be a greenlet on
    the main OS thread, and blocking signals there would block them for the whole process."""
    try:
        tid = int(os.readlink("/proc/thread-self").rsplit("/", 1)[1])
    except (OSError, ValueError):
        return True
    return tid == os.getpid()


def leave_signals_to_the_main_thread() -> None:
    """Block, in the calling OS thread, the signals a process gets to stop or act (SIGTERM,
    SIGINT, SIGHUP, SIGQUIT, SIGUSR1/2, SIGALRM); call it first thing in a thread we start.
    Does nothing on the main OS thread, or where the platform cannot block per thread."""
    if _on_the_main_os_thread() or not hasattr(signal, "pthread_sigmask"):
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, _PROCESS_SIGNALS)
