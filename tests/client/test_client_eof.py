"""A held lock whose connection the server closes is lost at once, not at its next renewal
(issue 14, point 1: the client's side of the restart window)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest

from celery_dflock import ConnectionPool, DistributedLock, DistributedSemaphore
from celery_dflock.client import _SyncLockBase  # pyright: ignore[reportPrivateUsage]
from dflockd_server.testing import ServerThread

LONG_LEASE_S = 60
"""Renewed every 30 s: a loss seen within the test's wait was not seen by a renewal."""
TOLD_WITHIN_S = 10.0

ServerFactory = Callable[..., ServerThread]


@contextmanager
def maybe_pool(pooled: bool) -> Iterator[ConnectionPool | None]:
    if not pooled:
        yield None
        return
    with ConnectionPool() as pool:
        yield pool


@pytest.mark.parametrize("pooled", [False, True], ids=["own-connection", "pool"])
@pytest.mark.parametrize("kind", ["lock", "semaphore"])
def test_a_server_stop_marks_a_held_lock_lost_at_once(
    dflock_server_factory: ServerFactory, pooled: bool, kind: str
) -> None:
    server = dflock_server_factory()
    lost: list[float] = []
    with maybe_pool(pooled) as pool:
        lock: _SyncLockBase
        if kind == "lock":
            lock = DistributedLock(
                "held",
                servers=[server.address],
                lease_ttl_s=LONG_LEASE_S,
                pool=pool,
                on_lost=lambda _lock: lost.append(time.monotonic()),
            )
        else:
            lock = DistributedSemaphore(
                "held",
                2,
                servers=[server.address],
                lease_ttl_s=LONG_LEASE_S,
                pool=pool,
                on_lost=lambda _lock: lost.append(time.monotonic()),
            )
        assert lock.acquire()
        assert lock.renew()  # a renewal's reply is not mistaken for a close, and re-arms
        assert lock.renew()
        assert not lock.lost_event.wait(0.2)
        server.stop()  # graceful: closes every connection, releasing what they held
        assert lock.lost_event.wait(TOLD_WITHIN_S), "not told before the next renewal"
        assert lock.lost and not lock.owned()
        assert len(lost) == 1
        assert lock.release() is False


def test_a_release_stops_the_watch(dflock_server_factory: ServerFactory) -> None:
    server = dflock_server_factory()
    with ConnectionPool() as pool:
        lock = DistributedLock("k", servers=[server.address], lease_ttl_s=LONG_LEASE_S, pool=pool)
        assert lock.acquire()
        assert pool.renewer.watcher.watched == 1
        assert lock.release()
        assert pool.renewer.watcher.watched == 0
        server.stop()  # the pooled, released connection closes: no lock is told anything
        assert not lock.lost_event.wait(0.5)
