"""What only the blocking face of the client has: threads, signals, a timer on a slow link.
Everything both faces do is tested once, on both, in test_client_faces.py."""

from __future__ import annotations

import logging
import signal
import threading
import time
from pathlib import Path
from types import FrameType

import pytest

from celery_dflock import ConnectionPool, DistributedLock, LockNotOwned
from dflockd_server.testing import ServerThread
from tests.client.faces import BLOCKING, Face, Lock, Maker
from tests.support.proxy import FaultProxy
from tests.support.waiting import wait_until
from tests.support.wire import held_keys, holders_and_waiters, release_behind_its_back

LATE_LEASE_S = 3


@pytest.fixture
def face() -> Face:
    """This module's tests are of the blocking face only (``make`` builds its locks)."""
    return BLOCKING


def test_a_wait_longer_than_the_lease_keeps_the_lock_over_a_slow_link(
    make: Maker, dflock_server: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    # A `w` that blocked for longer than the lease: the client cannot tell when the grant
    # began, so it renews at once, and that renewal gets the usual time to be answered (not
    # the 0.1 s left for a lease known to have run out), here over a 150 ms link. Owned once
    # that renewal is answered, however long a loaded machine takes; a loss says why.
    caplog.set_level(logging.INFO, logger="celery_dflock.client")
    lost: list[Lock] = []
    with FaultProxy(dflock_server.address).start() as proxy:
        first = make("2p-slow", lease_ttl_s=LATE_LEASE_S)
        assert first.acquire()
        second = make(
            "2p-slow", lease_ttl_s=LATE_LEASE_S, servers=[proxy.address], on_lost=lost.append
        )
        assert second.enqueue() == "queued"
        proxy.set_latency(0.15)
        releasing = threading.Timer(LATE_LEASE_S + 1.0, first.release)
        releasing.start()
        try:
            assert second.wait(10) is True
        finally:
            releasing.join()
        wait_until(lambda: second.owned() or lost, what="the first renewal answered, or lost")
        assert lost == [] and second.owned(), caplog.text
        assert second.release() is True


def test_interrupted_request_closes_its_connection(
    dflock_server: ServerThread, pool: ConnectionPool
) -> None:
    """A request cut off midway (here by a signal, like Celery's soft time limit) closes the
    connection: the server drops the abandoned wait, and the pool never reuses it."""

    class Interrupted(Exception):
        pass

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise Interrupted

    servers = [dflock_server.address]
    holder = DistributedLock("cut", servers=servers)
    assert holder.acquire()
    waiter = DistributedLock("cut", acquire_timeout_s=30, servers=servers, pool=pool)
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        with pytest.raises(Interrupted):
            waiter.acquire()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert not waiter.locked()
    wait_until(lambda: holders_and_waiters(dflock_server.address, "cut") == (1, 0))
    holder.release()
    opened, reused = pool.opened, pool.reused
    assert waiter.acquire()  # in step on a fresh connection, not the one cut off
    assert (pool.opened, pool.reused) == (opened + 1, reused)
    assert waiter.release()


# ------------------------------------------------------------------------ renewal threads


def test_on_lost_may_release_from_the_renewal_thread(dflock_server: ServerThread) -> None:
    released: list[bool] = []
    lock = DistributedLock(
        "cb-release",
        lease_ttl_s=1,
        servers=[dflock_server.address],
        on_lost=lambda lk: released.append(lk.release()),
    )
    assert lock.acquire() and lock.token is not None
    release_behind_its_back(dflock_server.address, "cb-release", lock.token)
    assert lock.lost_event.wait(5.0)
    wait_until(lambda: released == [False], what="on_lost ran release()")
    assert not lock.locked()


def test_on_lost_reads_the_lost_fence_while_a_release_races_it(
    dflock_server: ServerThread,
) -> None:
    # The body ends and releases while the renewal thread is telling on_lost: the release
    # waits for the callback, which still sees the fence of the grant that was lost (it used
    # to read None: the release had forgotten the grant under it). The asyncio face's twin,
    # with a coroutine callback, is in test_client_async.py.
    in_callback = threading.Event()
    seen: list[int | None] = []

    def on_lost(lk: DistributedLock) -> None:
        in_callback.set()
        time.sleep(0.3)  # the release below runs meanwhile
        seen.append(lk.fence)

    lock = DistributedLock(
        "lost-fence", lease_ttl_s=1, servers=[dflock_server.address], on_lost=on_lost
    )
    assert lock.acquire() and lock.token is not None
    fence = lock.fence
    release_behind_its_back(dflock_server.address, "lost-fence", lock.token)
    assert in_callback.wait(5.0)
    assert lock.release() is False
    assert seen == [fence]
    assert lock.fence is None and not lock.locked()


def test_renew_and_release_do_not_interleave(
    dflock_server: ServerThread, pool: ConnectionPool
) -> None:
    """Many renewals racing a release on one pinned connection stay in step."""
    lock = DistributedLock("race", servers=[dflock_server.address], pool=pool)
    for _ in range(5):
        assert lock.acquire()
        results: list[str] = []

        def renew(results: list[str] = results) -> None:
            try:
                results.append("renewed" if lock.renew() else "lost")
            except LockNotOwned:
                results.append("after release")

        threads = [threading.Thread(target=renew) for _ in range(8)]
        for thread in threads:
            thread.start()
        time.sleep(0)
        assert lock.release() is True
        for thread in threads:
            thread.join(10)
        assert len(results) == 8 and "lost" not in results
    assert held_keys(dflock_server.address) == set()
    reused = pool.reused
    assert lock.acquire() and pool.reused == reused + 1  # its connection went back in step
    assert lock.release()


def _blocks(thread: threading.Thread, signum: int) -> bool:
    """Whether ``thread`` blocks ``signum`` (its signal mask, from /proc). A thread that has
    exited meanwhile (another test's renewal thread ending its linger) takes no signal: True."""
    try:
        status = Path(f"/proc/self/task/{thread.native_id}/status").read_text()
    except FileNotFoundError:
        return True
    mask = next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:"))
    return bool(int(mask, 16) & (1 << (signum - 1)))


@pytest.mark.skipif(not Path("/proc/thread-self").exists(), reason="per-thread masks from /proc")
def test_renewal_threads_leave_the_process_signals_to_the_main_thread(
    dflock_server: ServerThread,
) -> None:
    # A SIGTERM sent to the process must reach the main thread, even while it blocks it for a
    # moment (billiard's pool children do, and a SIGTERM taken by a renewal thread then
    # killed them mid-message: test_locked_task_endings.py shows the pool that stopped).
    with DistributedLock("sigmask", servers=[dflock_server.address]):
        wait_until(
            lambda: any(t.name.startswith("dflock-renew") for t in threading.enumerate()),
            what="a renewal thread",
        )
        renewers = [t for t in threading.enumerate() if t.name.startswith("dflock-renew")]
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            wait_until(
                lambda signum=signum: all(_blocks(t, signum) for t in renewers),
                what=f"renewal threads blocking signal {signum}",
            )
        assert not _blocks(threading.main_thread(), signal.SIGTERM)


def test_a_wait_longer_than_poll_can_count_takes_the_lock(make: Maker) -> None:
    """``acquire_timeout_s`` may be any time the settings accept (up to 9e9 s), but the plain
    socket's ``poll`` counts its wait in milliseconds in a C int (about 24.8 days): a longer
    wait raised ``OverflowError`` before it began, on a free key as on a busy one."""
    days_40 = 40 * 86_400.0
    first = make("poll-overflow", acquire_timeout_s=days_40)
    assert first.acquire()
    second = make("poll-overflow", acquire_timeout_s=days_40)
    releasing = threading.Timer(0.5, first.release)
    releasing.start()
    try:
        assert second.acquire()
    finally:
        releasing.join()
    assert second.owned()
    assert second.release() is True
