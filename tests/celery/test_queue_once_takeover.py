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
from celery_dflock._queue_once import PUBLISH_LEASE_S, REDELIVERED_WAIT_S, _key_left, take_over
from celery_dflock._request import Follow, HoldRef, decode_note, encode_note
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


def test_a_run_waits_for_an_older_publisher_to_detach_its_hold(
    dflock_server: ServerThread,
) -> None:
    """During a rolling upgrade, a message sent by an older publisher, whose hold's note is
    its task id alone, reaches a worker before that publisher detached its hold: the run
    waits for the detach and takes the hold over (its id is the note's), as it does for a
    hold of this version (``<id>///<name>``); it must not take the key at run time and queue
    behind its own message's hold."""
    app = make_app(servers=dflock_server)
    task_id = str(uuid.uuid4())
    key = f"once:older-publisher-{task_id[:8]}"
    address = dflock_server.address
    with Client([address]) as publisher, Client([address]) as worker:
        older_note = task_id  # what an older publisher's hold carries
        hold = publisher.hold(key, note=older_note, lease_ttl=30, detached=False)
        detach = threading.Timer(
            KILL_AFTER_S, publisher.detach, (key, hold.token), {"lease_ttl": 30}
        )
        lock = worker.lock(key, lease_ttl_s=30)
        started = time.monotonic()
        detach.start()
        try:
            took = take_over(
                get_runtime(app).client(get_config(app)),
                lock,
                HoldRef(key, hold.token),
                note=encode_note(task_id, "w-new@host"),
                label="the run",
                on_close_lease=None,
                task_id=task_id,
            )
        finally:
            detach.cancel()
            detach.join()
        took_s = time.monotonic() - started
        assert took, f"not taken over; the key's holder: {lock.holder}"
        assert KILL_AFTER_S <= took_s < PUBLISH_LEASE_S, took_s
        assert lock.fence == hold.fence  # the same grant: the same fence
        assert lock.release()
    app.close()


def test_a_follower_sees_an_older_publishers_queued_holder_still_holding(
    dflock_server: ServerThread,
) -> None:
    """A canvas member standing in for a holder an older publisher sent (its hold's note its
    task id alone), still queued: the member's look at the key finds the holder there, not
    gone (twice gone, the member fails saying the holder left no result)."""
    app = make_app(servers=dflock_server)
    holder_id = str(uuid.uuid4())
    key = f"once:older-holder-{holder_id[:8]}"
    with Client([dflock_server.address]) as publisher:
        hold = publisher.hold(key, note=holder_id, lease_ttl=30)  # an older publisher's
        follow = Follow(key, holder_id, None)
        assert not _key_left(app, follow, encode_note("follower-id", name="t.x"))
        assert publisher.release(key, hold.token)
        assert _key_left(app, follow, encode_note("follower-id", name="t.x"))
    app.close()
