"""The worker's own threads at a pid limit: the worker's hooks start threads from Celery's
signals (watching unreachable lock servers, releasing what dead or revoked runs held). In a
worker at its pid limit (a container's ``--pids-limit``: threads count) a start raised into the
signal receiver, and the watch of unreachable servers kept a flag saying it ran: it never
watched again, so ``celery inspect dflock_outages`` went on listing servers long reachable and
no "reachable again" was logged. The receivers now carry on, and the next outage watches."""

from __future__ import annotations

from tests.support.pids import no_more_threads
from tests.support.processes import python_script

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
