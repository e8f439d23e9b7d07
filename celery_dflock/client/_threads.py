"""Our background threads leave the process's signals to its main thread.

A signal sent to a process goes to any of its threads that does not block it. Python runs
handlers in the main thread, but a signal whose action is the default kills the process from
any thread, and one the main thread blocks for a moment is then not held back at all.

In billiard's pool, an ending child (SIGTERM: a revoke, a hard time limit) sends its last
message with SIGTERM blocked in its main thread, holding a lock shared with the other children;
the parent answers with a second SIGTERM, by then of the default action. Taken by a renewal
thread, it killed the child with that lock held, and the pool stopped taking tasks. So each of
our threads blocks the stopping signals as soon as it starts.
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
    """Block `_PROCESS_SIGNALS` in the calling OS thread (first thing in a thread we start);
    nothing on the main OS thread, or where the platform cannot block per thread."""
    if _on_the_main_os_thread() or not hasattr(signal, "pthread_sigmask"):
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, _PROCESS_SIGNALS)
