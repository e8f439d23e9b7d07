"""Queue-once: a run taking over the hold of its own message from an earlier delivery whose
worker died, before the lock server has seen that run's connection close.

RabbitMQ delivers an unacknowledged (acks_late) message again as soon as the dead worker's
broker connection closes. The dead run's connection to the lock server closes at about the
same moment, but the lock server may see it a little later: the new run must then wait for the
hold to be detached, not take the key at run time and queue behind its own hold for the whole
``lock_timeout`` (the RabbitMQ case of ``test_queue_once_brokers.py``'s
``test_a_run_killed_with_acks_late_is_redelivered_under_the_same_hold`` failed so on CI, 30 s
after the redelivery). Real server, real client, the dead run a real process killed with
SIGKILL.
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

from celery_dflock import Client
from celery_dflock._queue_once import REDELIVERED_WAIT_S, take_over
from celery_dflock._request import HoldRef, decode_note, encode_note
from celery_dflock._runtime import get_runtime
from celery_dflock.config import get_config
from dflockd_server.testing import ServerThread
from tests.support.apps import make_app
from tests.support.holds import adopted_in_a_child

ON_CLOSE_LEASE_S = 20
KILL_AFTER_S = 1.0
"""How long after the new run's first try the earlier run's process is killed."""


def test_a_redelivered_run_takes_its_hold_over_once_the_dead_runs_connection_closes(
    dflock_server: ServerThread,
) -> None:
    app = make_app(servers=dflock_server)
    task_id = str(uuid.uuid4())
    key = f"once:redelivered-{task_id[:8]}"
    address = dflock_server.address
    with Client([address]) as client:
        queued_note, dead_note = encode_note(task_id), encode_note(task_id, "w-dead@host")
        assert queued_note is not None and dead_note is not None
        hold = client.hold(key, note=queued_note, lease_ttl=30)  # the message sent, queued
        ref = HoldRef(key, hold.token)
        # The earlier delivery's run took the hold over as an acks_late run does (with an
        # on-close lease), and holds it until it is killed.
        with adopted_in_a_child(address, key, hold.token, ON_CLOSE_LEASE_S, dead_note) as child:
            lock = client.lock(key, lease_ttl_s=30)
            killer = threading.Timer(KILL_AFTER_S, os.kill, (child.pid, signal.SIGKILL))
            started = time.monotonic()
            killer.start()
            try:
                took = take_over(
                    get_runtime(app).client(get_config(app)),
                    lock,
                    ref,
                    note=encode_note(task_id, "w-new@host"),
                    label="the redelivered run",
                    on_close_lease=ON_CLOSE_LEASE_S,
                    task_id=task_id,
                )
            finally:
                killer.cancel()
            took_s = time.monotonic() - started
        assert took, f"not taken over; the key's holder: {decode_note(lock.holder)}"
        assert KILL_AFTER_S <= took_s < REDELIVERED_WAIT_S, took_s
        assert lock.fence == hold.fence  # the same grant: the same fence
        assert lock.release()
    app.close()
