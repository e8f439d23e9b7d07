"""The worker's own threads at a pid limit: the worker's hooks start threads from Celery's
signals (watching unreachable lock servers, releasing what dead or revoked runs held). In a
worker at its pid limit (a container's ``--pids-limit``: threads count) a start raised into the
signal receiver, and the watch of unreachable servers kept a flag saying it ran: it never
watched again, so ``celery inspect dflock_outages`` went on listing servers long reachable and
no "reachable again" was logged. The receivers now carry on, and the next outage watches. A
server found unreachable just as a watch ends is watched too."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from celery import Celery

from celery_dflock import LockedTask
from celery_dflock._worker_hooks import _Hooks
from tests.conftest import ServerFactory
from tests.support.pids import no_more_threads
from tests.support.processes import python_script
from tests.support.waiting import wait_until

_WATCH_AT_THE_LIMIT = """
import logging, sys, threading, time
from celery import Celery
from celery_dflock import LockedTask
from celery_dflock._worker_hooks import _Hooks
logging.basicConfig()
app = Celery("pid-limited", broker="memory://")
app.conf.dflock_servers = ["127.0.0.1:1"]
hooks = _Hooks(app, LockedTask)
print("ready", flush=True)
sys.stdin.readline()  # at the pid limit meanwhile
try:
    hooks._watch({"127.0.0.1:1": time.time()})
    print("carried-on", flush=True)
except RuntimeError:
    print("raised", flush=True)
sys.stdin.readline()  # the limit lifted meanwhile
hooks._watch({})
watching = any(t.name == "dflock-servers-watch" for t in threading.enumerate())
print("watching" if watching else "not-watching", flush=True)
"""


def test_the_servers_watch_starts_again_after_a_start_failed_at_the_pid_limit() -> None:
    with python_script(_WATCH_AT_THE_LIMIT) as script:
        assert script.line() == "ready"
        with no_more_threads(script.pid):
            first = script.step()
        second = script.step()
        script.child.kill()
        err = script.child.communicate()[1]
    assert (first, second) == ("carried-on", "watching"), err
    assert "no thread for dflock-servers-watch" in err, err


class _GapLock:
    """The hooks' guard, which runs ``in_the_gap`` once, in the watcher, right after the hold in
    which it saw every server answer: where another thread's `_watch` may come."""

    def __init__(self, in_the_gap: Callable[[], None]) -> None:
        self._lock = threading.Lock()
        self._in_the_gap = in_the_gap
        self._watcher_holds = 0
        self.came = False

    def __enter__(self) -> None:
        self._lock.acquire()

    def __exit__(self, *_: object) -> None:
        self._lock.release()
        if threading.current_thread().name == "dflock-servers-watch":
            self._watcher_holds += 1
            if self._watcher_holds == 2:  # 1: the names it logs; 2: the pings' answers
                self._in_the_gap()
                self.came = True


def test_a_server_found_unreachable_as_the_watch_ends_is_watched(
    dflock_server_factory: ServerFactory,
) -> None:
    # The watch said it ran until after its last hold: a server found unreachable in between
    # was recorded with no watcher, listed by `dflock_outages` and never said reachable again.
    first, second = (
        f"{s.host}:{s.port}" for s in (dflock_server_factory(), dflock_server_factory())
    )
    app = Celery("gap", broker="memory://", set_as_current=False)
    app.conf.dflock_servers = [first, second]
    hooks = _Hooks(app, LockedTask)
    gap = _GapLock(lambda: hooks._watch({second: time.time()}))
    hooks._watch_guard = gap  # type: ignore[assignment]
    hooks._watch({})  # every server answers: the watch ends after its first pings
    wait_until(
        lambda: gap.came and not hooks.unreachable and not hooks._watching,
        timeout=15,
        what=f"{second}, recorded as the watch ended, watched until it answered",
    )
