"""Every way a run ends releases its lock (acceptance 3), on real prefork workers.

The ending tasks hold a 30 s lease; each test then acquires the same key from
this process with a 2 s timeout, so only a real release can explain success.
"""

from __future__ import annotations

import os
import select
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_dflock.client import DistributedLock
from celery_dflock.task import LOCK_OPTIONS_HEADER
from dflockd_server import Config
from dflockd_server.testing import ServerThread
from tests.support.proxy import FaultProxy
from tests.support.rigs import Rig, open_rig, unique
from tests.support.workers import (
    EventLog,
    WorkerFactory,
    filesystem_settings,
    with_server,
)

NEXT_ACQUIRE_TIMEOUT_S = 5
"""The next run on the key must get the lock this fast (the lease is 30 s, the client session
15 s: only a release explains it, by the run, or by the worker's main process for a dead child)."""
EVENT_TIMEOUT_S = 30.0
WAITER_SOFT_LIMIT_S = 2
"""The soft time limit of apps/tasks.py's waiters (its ``WAITER_SOFT_LIMIT_S``; that module is
the workers', not imported here)."""


def next_acquire_succeeds(rig: Rig, name: str) -> bool:
    """The next run on ``end:{name}`` gets the lock within ``NEXT_ACQUIRE_TIMEOUT_S``."""
    return rig.key_free(f"end:{name}", NEXT_ACQUIRE_TIMEOUT_S)


def _rig(tmp: Path, server_config: Config, worker_args: tuple[str, ...] = ()) -> Iterator[Rig]:
    queue = f"dflock-end-{uuid.uuid4().hex[:8]}"
    with open_rig(
        tmp,
        "apps.tasks",
        filesystem_settings(tmp, queue),
        server=server_config,
        main="endings-client",
    ) as made:
        made.start_worker(pool="prefork", concurrency=2, extra_args=worker_args)
        yield made


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    yield from _rig(
        tmp_path_factory.mktemp("endings"),
        Config(host="127.0.0.1", port=0, default_lease_ttl_s=30),
    )


@pytest.fixture(scope="module")
def rig_no_autorelease(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    """The server keeps a dead connection's locks: only the main process's release frees them."""
    yield from _rig(
        tmp_path_factory.mktemp("endings-noauto"),
        Config(host="127.0.0.1", port=0, default_lease_ttl_s=30, auto_release_on_disconnect=False),
    )


@pytest.fixture
def fresh_rig(tmp_path: Path) -> Iterator[Rig]:
    """A rig of the test's own (no earlier test's kills behind it)."""
    yield from _rig(tmp_path, Config(host="127.0.0.1", port=0, default_lease_ttl_s=30))


def test_success_releases(rig: Rig) -> None:
    name = unique("success")
    assert rig.send("end_success", name).get(timeout=EVENT_TIMEOUT_S) == name
    assert next_acquire_succeeds(rig, name)


def test_exception_releases(rig: Rig) -> None:
    name = unique("exception")
    result = rig.send("end_exception", name)
    with pytest.raises(Exception, match="fails on purpose"):
        result.get(timeout=EVENT_TIMEOUT_S)
    assert next_acquire_succeeds(rig, name)


def test_self_retry_releases_and_the_retried_run_takes_the_lock(rig: Rig) -> None:
    name = unique("retry")
    assert rig.send("end_retry", name).get(timeout=EVENT_TIMEOUT_S) == 1
    bodies = rig.log.entries("body", name=name)
    assert [b["retries"] for b in bodies] == [0, 1]
    assert bodies[1]["fence"] > bodies[0]["fence"]  # the retried run held the lock anew
    assert next_acquire_succeeds(rig, name)


def test_per_call_options_reach_the_worker_and_survive_a_retry(rig: Rig) -> None:
    name = unique("percall")
    headers = {LOCK_OPTIONS_HEADER: {"lock_key": "percall:{name}", "lock_ttl": 30}}
    assert rig.send("end_retry", name, headers=headers).get(timeout=EVENT_TIMEOUT_S) == 1
    bodies = rig.log.entries("body", name=name)
    assert [b["key"] for b in bodies] == [f"percall:{name}", f"percall:{name}"]
    lock = rig.lock(f"percall:{name}", 0)
    assert lock.acquire()
    lock.release()


def test_ignore_releases(rig: Rig) -> None:
    name = unique("ignore")
    rig.send("end_ignore", name)
    rig.log.wait_event("body", EVENT_TIMEOUT_S, name=name)
    assert next_acquire_succeeds(rig, name)


def test_reject_releases(rig: Rig) -> None:
    name = unique("reject")
    rig.send("end_reject", name)
    rig.log.wait_event("body", EVENT_TIMEOUT_S, name=name)
    assert next_acquire_succeeds(rig, name)


def test_soft_time_limit_releases(rig: Rig) -> None:
    name = unique("soft")
    result = rig.send("end_soft_limit", name)
    rig.log.wait_event("soft_limit", EVENT_TIMEOUT_S, name=name)
    assert next_acquire_succeeds(rig, name)
    result.get(timeout=EVENT_TIMEOUT_S, propagate=False)
    assert result.state == "FAILURE"


def test_hard_time_limit_releases(rig: Rig) -> None:
    name = unique("hard")
    result = rig.send("end_hard_limit", name)
    rig.log.wait_event("body", EVENT_TIMEOUT_S, name=name)
    result.get(timeout=EVENT_TIMEOUT_S, propagate=False)
    assert result.state == "FAILURE"
    assert next_acquire_succeeds(rig, name)


WAITER_GRANTED_WITHIN_S = 1.0
"""A run waiting on a key whose pool child was SIGKILLed by its hard time limit gets the
key this soon after the child is gone (issue 69): the worker's main process ends the dead
child's grant at once; the session would keep it for ``dflock_session_ttl``."""


def _wait_gone(pid: int, timeout: float) -> float:
    """Wait for process ``pid`` (not ours) to exit; the wall time at which it was seen gone."""
    fd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
    finally:
        os.close(fd)
    assert ready, f"pool child {pid} still runs {timeout} s on"
    return time.time()


def test_a_run_waiting_on_a_child_killed_by_its_hard_limit_is_granted_within_a_second(
    rig: Rig,
) -> None:
    name = unique("hard-kill")
    killed = rig.send("end_hard_limit_killed", name)
    body = rig.log.wait_event("body", EVENT_TIMEOUT_S, name=name)
    waiter = rig.send("end_success", name)
    gone_at = _wait_gone(body["pid"], EVENT_TIMEOUT_S)
    granted = rig.log.wait_event("body", EVENT_TIMEOUT_S, count=2, name=name)
    assert granted["pid"] != body["pid"]
    waited = granted["t"] - gone_at
    assert waited <= WAITER_GRANTED_WITHIN_S, (
        f"the waiting run got the key {waited:.2f} s after the killed child was gone"
    )
    assert waiter.get(timeout=EVENT_TIMEOUT_S) == name
    killed.get(timeout=EVENT_TIMEOUT_S, propagate=False)
    assert killed.state == "FAILURE"


def test_revoke_terminate_releases(rig: Rig) -> None:
    name = unique("revoke")
    result = rig.send("end_block", name)
    rig.log.wait_event("body", EVENT_TIMEOUT_S, name=name)
    rig.app.control.revoke(result.id, terminate=True)
    assert next_acquire_succeeds(rig, name)
    assert not rig.log.entries("body_done", name=name)


def test_sigkill_of_the_pool_child_releases(rig: Rig) -> None:
    name = unique("sigkill")
    result = rig.send("end_block", name)
    body = rig.log.wait_event("body", EVENT_TIMEOUT_S, name=name)
    assert body["pid"] != rig.worker.pid
    os.kill(body["pid"], signal.SIGKILL)
    assert next_acquire_succeeds(rig, name)
    result.get(timeout=EVENT_TIMEOUT_S, propagate=False)
    assert result.state == "FAILURE"


TERMINATED_RUNS = 40
"""Runs ended in a row by revoke(terminate=True); before the fix about one in ten left the
pool unable to take another task."""
NEXT_BODY_TIMEOUT_S = 10.0


def test_the_pool_keeps_taking_tasks_after_many_terminated_runs(fresh_rig: Rig) -> None:
    # billiard (this broker runs the pool in its threaded mode) answers an ending child's
    # last message with a second SIGTERM. The child's main thread blocks SIGTERM while it
    # sends that message, holding a lock shared with the other children; delivered to one of
    # our renewal threads instead, the signal killed the child with the lock held, and no
    # child could hand the parent a task's start or result again.
    rig = fresh_rig
    for n in range(TERMINATED_RUNS):
        name = unique(f"terminated-{n}")
        result = rig.send("end_block", name)
        rig.log.wait_event("body", NEXT_BODY_TIMEOUT_S, name=name)
        rig.app.control.revoke(result.id, terminate=True)
    name = unique("after")
    assert rig.send("end_success", name).get(timeout=NEXT_BODY_TIMEOUT_S) == name
    assert next_acquire_succeeds(rig, name)


@pytest.mark.parametrize("how", ["sigkill", "revoke"])
def test_main_process_releases_what_a_killed_child_held(rig_no_autorelease: Rig, how: str) -> None:
    rig = rig_no_autorelease
    name = unique(how)
    result = rig.send("end_block", name)
    body = rig.log.wait_event("body", EVENT_TIMEOUT_S, name=name)
    if how == "sigkill":
        os.kill(body["pid"], signal.SIGKILL)
    else:
        rig.app.control.revoke(result.id, terminate=True, signal="SIGKILL")
    result.get(timeout=EVENT_TIMEOUT_S, propagate=False)
    assert next_acquire_succeeds(rig, name)
    # The lease is 30 s and the server kept the dead connection's lock: the worker's main
    # process released it, and says so.
    assert rig.worker.wait_output(f"released 'end:{name}' left by dead pool child {body['pid']}")


def test_main_process_releases_what_a_killed_child_held_when_its_message_is_requeued(
    rig_no_autorelease: Rig,
) -> None:
    """``acks_late`` with ``reject_on_worker_lost``: Celery requeues the message of a lost pool
    child instead of failing its task, and sends no ``task_failure``. The main process released
    nothing then: the dead child's key stayed held to the end of its lease (its session's, with
    auto-release), and the requeued run waited that long for its own predecessor."""
    rig = rig_no_autorelease
    name = unique("requeued")
    result = rig.send("end_block_requeued", name, 2.0)
    body = rig.log.wait_event("body", EVENT_TIMEOUT_S, name=name)
    os.kill(body["pid"], signal.SIGKILL)
    assert rig.worker.wait_output(f"released 'end:{name}' left by dead pool child {body['pid']}")
    assert result.get(timeout=EVENT_TIMEOUT_S) == name  # the requeued run, once it took the key
    first, again = rig.log.entries("body", name=name)
    assert again["fence"] > first["fence"]


def test_main_process_releases_what_a_killed_child_held_under_an_int_task_id(
    tmp_path: Path,
) -> None:
    """Celery sends any id (``task_id=<int>``, where no result backend refuses it): the child's
    record held it as text and the main process looked for the int, so it released nothing and
    the key stayed held for its lease (30 s)."""
    queue = f"dflock-end-{uuid.uuid4().hex[:8]}"
    settings = {**filesystem_settings(tmp_path, queue), "result_backend": None}
    config = Config(
        host="127.0.0.1", port=0, default_lease_ttl_s=30, auto_release_on_disconnect=False
    )
    with open_rig(tmp_path, "apps.tasks", settings, server=config, main="int-id") as rig:
        rig.start_worker(pool="prefork", concurrency=1)
        name = unique("int-id")
        rig.send("end_block", name, task_id=uuid.uuid4().int % 10**9)
        body = rig.log.wait_event("body", EVENT_TIMEOUT_S, name=name)
        os.kill(body["pid"], signal.SIGKILL)
        assert rig.worker.wait_output(f"left by dead pool child {body['pid']}")
        assert next_acquire_succeeds(rig, name)


def test_a_killed_childs_lock_is_released_once(tmp_path: Path) -> None:
    """A lost pool child whose message Celery does not requeue: both `LockedRequest` and the
    ``task_failure`` hook released what it held, so with the lock server not answering the
    worker warned twice that it could not release the key."""
    queue = f"dflock-end-{uuid.uuid4().hex[:8]}"
    config = Config(host="127.0.0.1", port=0, default_lease_ttl_s=30)
    with (
        ServerThread(config) as server,
        FaultProxy(server.address).start() as proxy,
        open_rig(
            tmp_path, "apps.tasks", filesystem_settings(tmp_path, queue), server=proxy.address
        ) as rig,
    ):
        worker = rig.start_worker(
            pool="prefork", concurrency=1, settings={"dflock_connect_timeout": 2}
        )
        name = unique("once")
        result = rig.send("end_block", name)
        body = rig.log.wait_event("body", EVENT_TIMEOUT_S, name=name)
        proxy.stall(120)  # the server stops answering: each release waits out its timeout
        os.kill(body["pid"], signal.SIGKILL)
        result.get(timeout=EVENT_TIMEOUT_S, propagate=False)
        assert result.state == "FAILURE"
        warning = f"could not release 'end:{name}' left by dead pool child {body['pid']}"
        assert worker.wait_output(warning, EVENT_TIMEOUT_S)
        worker.stop()  # its output complete
        assert worker.output().count(warning) == 1, worker.output()[-3000:]


def test_hard_time_limit_releases_without_auto_release(rig_no_autorelease: Rig) -> None:
    # billiard ends the child with SIGTERM, which it unwinds from (releasing); the main
    # process's release after the child exits is the backstop (idempotent either way).
    rig = rig_no_autorelease
    name = unique("hard")
    result = rig.send("end_hard_limit", name)
    rig.log.wait_event("body", EVENT_TIMEOUT_S, name=name)
    result.get(timeout=EVENT_TIMEOUT_S, propagate=False)
    assert result.state == "FAILURE"
    assert next_acquire_succeeds(rig, name)


def test_warm_shutdown_lets_the_run_finish_and_release(
    tmp_path: Path, lock_server: ServerThread, event_log: EventLog, client_app: Any
) -> None:
    settings = with_server(filesystem_settings(tmp_path, unique("q")), lock_server)
    factory = WorkerFactory(log=event_log, directory=tmp_path, settings=settings)
    try:
        worker = factory.start("apps.tasks", pool="prefork", concurrency=2)
        name = unique("warm")
        client_app(settings).send_task("apps.tasks.end_block", (name, 1.0))
        event_log.wait_event("body", EVENT_TIMEOUT_S, name=name)
        assert worker.stop(signal.SIGTERM) == 0
        assert event_log.entries("body_done", name=name)
        lock = DistributedLock(
            f"end:{name}", acquire_timeout_s=NEXT_ACQUIRE_TIMEOUT_S, servers=[lock_server.address]
        )
        assert lock.acquire()
        lock.release()
    finally:
        factory.close()


def test_a_busy_key_outlasting_the_soft_time_limit_is_retried_not_failed(rig: Rig) -> None:
    """The key's FIFO wait (30 s by default) ran into the run's soft time limit, which failed
    the run with SoftTimeLimitExceeded: a busy key dropped it instead of retrying it."""
    retried_past_its_soft_limit(rig, "end_soft_limited_waiter", unique("soft-wait"))


def retried_past_its_soft_limit(rig: Rig, task: str, name: str) -> None:
    """A run of ``task`` (a soft time limit of ``WAITER_SOFT_LIMIT_S``) whose key another
    holds for longer is retried, and its body runs once the key is free."""
    other = rig.holder(f"end:{name}")
    try:
        result = rig.send(task, name)
        time.sleep(WAITER_SOFT_LIMIT_S + 1.5)  # more than the run's soft time limit
    finally:
        other.release()
    assert result.get(timeout=EVENT_TIMEOUT_S) == name
    [body] = rig.log.entries("body", name=name)
    assert body["lock_retries"] >= 1


@pytest.fixture
def worker_limited_rig(tmp_path: Path) -> Iterator[Rig]:
    """A rig whose worker is started with ``--soft-time-limit 2``."""
    server = Config(host="127.0.0.1", port=0, default_lease_ttl_s=30)
    yield from _rig(tmp_path, server, worker_args=("--soft-time-limit", str(WAITER_SOFT_LIMIT_S)))


def test_a_busy_key_outlasting_the_worker_s_own_soft_time_limit_is_retried_not_failed(
    worker_limited_rig: Rig,
) -> None:
    """``celery worker --soft-time-limit 2``: the pool's default limit, in neither the message,
    the task nor the app's settings. The key's FIFO wait was capped by those alone, so it ran
    into this one, which failed the run with SoftTimeLimitExceeded."""
    retried_past_its_soft_limit(worker_limited_rig, "end_waiter", unique("worker-soft-wait"))


def test_a_run_replaced_by_a_run_of_its_key_releases_before_the_replacement_is_sent(
    rig: Rig,
) -> None:
    """``self.replace(...)`` sent the replacement while the run still held its key: under
    ``lock_from="publish"`` the replacement was taken for a duplicate of the running task and
    never sent, so the task's result never came."""
    name = unique("replace")
    assert rig.send("end_replaced", name).get(timeout=EVENT_TIMEOUT_S) == 1
    first, second = rig.log.entries("body", name=name)
    assert second["fence"] > first["fence"]
    assert next_acquire_succeeds(rig, name)


def test_a_run_that_goes_on_after_sending_its_retry_keeps_its_lock(rig: Rig) -> None:
    """``self.retry(throw=False)`` sends the retry and lets the body go on: the lock was
    released as the retry was sent, so the retry ran beside the rest of the body."""
    name = unique("retry-goes-on")
    rig.send("end_retry_goes_on", name)  # (the retry has its id: its result is the retry's)
    rig.log.wait_event("body", EVENT_TIMEOUT_S, count=2, name=name)
    went_on, retried = sorted(rig.log.entries("body", name=name), key=lambda e: e["retries"])
    assert retried["start"] >= went_on["end"]
