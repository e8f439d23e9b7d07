"""A lock lost while the body runs is never silent (acceptance 4), on real workers.

The tasks hold a 2 s lease (renewed every second). The test stops the lock
server under a running task; the task must be told (per its ``on_lock_lost``)
and ``lock_lost`` must fire, well within a couple of renewal intervals.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from dflockd_server import Config
from dflockd_server.testing import ServerThread
from tests.support.rigs import Rig, open_rig
from tests.support.services import require_rabbitmq, require_redis
from tests.support.workers import (
    filesystem_settings,
    rabbitmq_settings,
    redis_cleanup,
    redis_settings,
)

LEASE_S = 2
RENEW_INTERVAL_S = LEASE_S * 0.5
TOLD_WITHIN_S = RENEW_INTERVAL_S + 3.0
"""Renewal interval plus the client's reply grace and scheduling slack."""


@dataclass
class ServerSlot:
    """A lock server that can be stopped and started again on the same port."""

    port: int = 0
    server: ServerThread | None = None
    history: list[ServerThread] = field(default_factory=list[ServerThread])

    def start(self) -> ServerThread:
        if self.server is None:
            server = ServerThread(Config(host="127.0.0.1", port=self.port))
            server.__enter__()
            self.port = server.port
            self.server = server
            self.history.append(server)
        return self.server

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def close(self) -> None:
        for server in self.history:
            server.stop()


@dataclass
class LostRig(Rig):
    """A rig whose lock server is in a slot (a test stops and starts it), with one worker of
    ``pool``."""

    pool: str = "prefork"
    slot: ServerSlot = field(default_factory=ServerSlot)


POOLS = ("prefork", "threads", "solo", "gevent", "eventlet")
"""Every pool Celery ships (gevent and eventlet are in the dev group)."""
GREEN_POOLS = ("gevent", "eventlet")


@pytest.fixture(scope="module", params=POOLS)
def lost_rig(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LostRig]:
    pool: str = request.param
    tmp = tmp_path_factory.mktemp(f"lost-{pool}")
    base = filesystem_settings(tmp, f"dflock-lost-{uuid.uuid4().hex[:8]}")
    with running_rig(pool, tmp, base, concurrency=2) as rig:
        yield rig


@contextlib.contextmanager
def running_rig(
    pool: str, tmp: Path, base_settings: dict[str, Any], *, concurrency: int
) -> Iterator[LostRig]:
    """A lock server in a slot, one worker of ``pool`` on ``base_settings`` and a client app;
    all stopped and closed on the way out."""
    slot = ServerSlot()
    server = slot.start()
    try:
        with open_rig(
            tmp,
            "apps.tasks",
            base_settings,
            server=server.address,
            main="lost-client",
            rig_class=LostRig,
        ) as rig:
            rig.pool = pool
            rig.slot = slot
            rig.start_worker(pool=pool, concurrency=concurrency)
            yield rig
    finally:
        slot.close()


def lose_lock_under(rig: LostRig, task: str) -> tuple[Any, Any, str]:
    """Start ``task``, stop the server under it, wait for ``lock_lost``; restart the server."""
    rig.slot.start()
    name = uuid.uuid4().hex[:8]
    result = rig.send(task, name)
    started = rig.log.wait_event("started", 30, name=name)
    rig.slot.stop()
    lost = rig.log.wait_event("lock_lost", TOLD_WITHIN_S, task_id=started["task_id"])
    assert lost["key"] == f"lost:{name}"
    assert lost["fence"] == started["fence"]
    rig.slot.start()
    return result, lost, name


def test_interrupt_raises_lock_lost_in_the_body(lost_rig: LostRig) -> None:
    result, lost, name = lose_lock_under(lost_rig, "lost_interrupt")
    assert lost["policy"] == "interrupt"
    interrupted = lost_rig.log.wait_event("interrupted", TOLD_WITHIN_S, name=name)
    assert "LockLost" in interrupted["error"] or interrupted["error"] == "_Interrupted"
    result.get(timeout=30, propagate=False)
    assert result.state == "FAILURE"
    assert type(result.result).__name__ == "LockLost"
    assert not lost_rig.log.entries("flagged", name=name)
    # Logged from the renewal thread, named by the message, not by Celery's task prefix.
    assert "???[???]" not in lost_rig.worker.output()
    assert f"lost its lock 'lost:{name}'" in lost_rig.worker.output()


def test_flag_lets_the_body_see_it(lost_rig: LostRig) -> None:
    result, lost, name = lose_lock_under(lost_rig, "lost_flag")
    assert lost["policy"] == "flag"
    flagged = lost_rig.log.wait_event("flagged", TOLD_WITHIN_S, name=name)
    assert flagged["lost"] is True
    assert flagged["event_set"] is True
    assert result.get(timeout=30) == {"lost": True}


def test_terminate_kills_a_prefork_child_and_interrupts_elsewhere(lost_rig: LostRig) -> None:
    result, lost, name = lose_lock_under(lost_rig, "lost_terminate")
    result.get(timeout=30, propagate=False)
    assert result.state == "FAILURE"
    if lost_rig.pool == "prefork":
        assert lost["policy"] == "terminate"
        assert type(result.result).__name__ == "WorkerLostError"
        assert not lost_rig.log.entries("interrupted", name=name)
    else:
        # Killing a threads-pool process would kill the whole worker: interrupt instead.
        assert lost["policy"] == "interrupt"
        assert lost_rig.log.entries("interrupted", name=name)
    assert lost_rig.worker.alive()


# --------------------------------------------------------- a body that never looks at its lock


@pytest.fixture(
    scope="module",
    # Redis for every pool; RabbitMQ too where the broker's I/O runs on the pool's hub.
    params=[
        (pool, broker)
        for pool in POOLS
        for broker in (("redis", "rabbitmq") if pool in GREEN_POOLS else ("redis",))
    ],
    ids="-".join,
)
def broker_rig(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LostRig]:
    pool, broker = request.param
    require_redis()  # results are kept in Redis for both brokers
    if broker == "rabbitmq":
        require_rabbitmq()
    tmp = tmp_path_factory.mktemp(f"blind-{pool}-{broker}")
    queue = f"dflock-blind-{uuid.uuid4().hex[:8]}"
    base = redis_settings(queue) if broker == "redis" else rabbitmq_settings(queue)
    try:
        with running_rig(pool, tmp, base, concurrency=4) as rig:
            yield rig
    finally:
        redis_cleanup(queue)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["interrupt", "terminate"])
def test_a_body_that_ignores_its_lock_is_stopped_on_every_pool(
    broker_rig: LostRig, policy: str
) -> None:
    """The issue's case: a 20 s body that only sleeps, a 2 s lease, the server gone: the run
    must end soon after ``lock_lost``, never with SUCCESS, and the worker must live on."""
    rig = broker_rig
    rig.slot.start()
    name = uuid.uuid4().hex[:8]
    result = rig.send(f"blind_{policy}", name)
    started = rig.log.wait_event("started", 30, name=name)
    rig.slot.stop()
    lost = rig.log.wait_event("lock_lost", TOLD_WITHIN_S, task_id=started["task_id"])
    rig.slot.start()
    result.get(timeout=TOLD_WITHIN_S + 10, propagate=False)
    assert result.state == "FAILURE", (result.state, result.result)
    if policy == "terminate" and rig.pool == "prefork":
        assert lost["policy"] == "terminate"
        assert type(result.result).__name__ == "WorkerLostError"
    else:
        assert lost["policy"] == "interrupt"
        assert type(result.result).__name__ == "LockLost", result.result
    assert not rig.log.entries("finished", name=name)
    assert rig.worker.alive(), rig.worker.output()[-3000:]
