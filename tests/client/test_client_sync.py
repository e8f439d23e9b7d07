"""DistributedLock and DistributedSemaphore against the real server."""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any, Protocol

import pytest

from celery_dflock import (
    AuthError,
    ConnectionPool,
    DflockError,
    DistributedLock,
    DistributedSemaphore,
    InvalidValueError,
    LimitMismatchError,
    LockNotAcquired,
    LockNotOwned,
    MaxLocksError,
    MaxWaitersError,
    ServerUnavailable,
)
from celery_dflock._sync.lock import _SyncLockBase  # pyright: ignore[reportPrivateUsage]
from dflockd_server.constants import DEFAULT_MAX_LEASE_TTL_S
from dflockd_server.testing import ServerThread
from tests.support.proxy import FaultProxy
from tests.support.waiting import wait_until
from tests.support.wire import (
    connection_count,
    held_keys,
    holders_and_waiters,
    release_behind_its_back,
)

SyncLock = _SyncLockBase


class Maker(Protocol):
    semaphore: bool

    def __call__(self, key: str, *args: Any, **kwargs: Any) -> SyncLock: ...


class _Make:
    def __init__(self, server: ServerThread, semaphore: bool) -> None:
        self.server = server
        self.semaphore = semaphore

    def __call__(self, key: str, *args: Any, **kwargs: Any) -> SyncLock:
        kwargs.setdefault("servers", [self.server.address])
        if self.semaphore:
            return DistributedSemaphore(key, kwargs.pop("limit", 1), *args, **kwargs)
        return DistributedLock(key, *args, **kwargs)


@pytest.fixture(params=["lock", "semaphore"])
def make(request: pytest.FixtureRequest, dflock_server: ServerThread) -> Maker:
    """Builds a DistributedLock, or a DistributedSemaphore of limit 1 (same behaviour)."""
    return _Make(dflock_server, request.param == "semaphore")


def _holders(server: ServerThread, key: str, make: Maker) -> tuple[int, int]:
    return holders_and_waiters(server.address, key, make.semaphore)


def _assert_free(make: Maker, key: str) -> None:
    """The key can be taken at once (and is let go again: a lock left held goes on renewing,
    and reports itself lost in whatever test runs when its server stops)."""
    lock = make(key, 0)
    assert lock.acquire()
    assert lock.release()


# ------------------------------------------------------------------------ acquire / release


def test_acquire_release_and_attributes(make: Maker, dflock_server: ServerThread) -> None:
    lock = make("res:1")
    assert (lock.token, lock.fence, lock.lease, lock.lost) == (None, None, 0, False)
    assert not lock.locked() and not lock.owned()
    assert lock.key == "res:1" and lock.server == dflock_server.address

    assert lock.acquire() is True
    assert lock.token is not None and len(lock.token) == 32
    assert lock.fence == int(lock.token[:16], 16)
    assert lock.lease == 33  # the server's default
    assert lock.locked() and lock.owned() and not lock.lost
    assert lock.token not in repr(lock) and "res:1" in repr(lock)
    assert _holders(dflock_server, "res:1", make)[0] == 1

    assert lock.release() is True
    assert lock.release() is False  # idempotent
    assert lock.token is None and not lock.locked()
    assert _holders(dflock_server, "res:1", make) == (0, 0)


def test_fences_grow_with_every_grant(make: Maker) -> None:
    lock = make("fence")
    fences: list[int] = []
    for _ in range(3):
        assert lock.acquire()
        assert lock.fence is not None
        fences.append(lock.fence)
        lock.release()
    assert fences == sorted(set(fences))


def test_lease_ttl_is_sent(make: Maker) -> None:
    with make("leased", lease_ttl_s=7) as lock:
        assert lock.lease == 7
        assert lock.renew() is True


def test_a_lease_above_the_servers_max_lease_ttl_is_explained(make: Maker) -> None:
    lock = make("too-long", 0, lease_ttl_s=DEFAULT_MAX_LEASE_TTL_S + 1)
    # The server's hello told its limit: refused before asking, naming what to change.
    with pytest.raises(
        InvalidValueError, match=r"grants \(300 s, its --max-lease-ttl / DFLOCKD_MAX_LEASE"
    ):
        lock.acquire()
    assert not lock.locked()


def test_acquire_twice_is_refused(make: Maker) -> None:
    with make("twice") as lock, pytest.raises(DflockError, match="already held"):
        lock.acquire()


def test_timeout_zero_and_small(make: Maker) -> None:
    with make("busy"):
        assert make("busy", acquire_timeout_s=0).acquire() is False
        assert make("busy", acquire_timeout_s=0.2).acquire() is False  # rounds up to 1 s
        with pytest.raises(LockNotAcquired, match=r"'busy'.*within 0s"), make("busy", 0):
            pytest.fail("entered a lock that is held elsewhere")


def test_fifo_between_clients(make: Maker, dflock_server: ServerThread) -> None:
    holder = make("fifo")
    assert holder.acquire()
    order: list[str] = []
    waiters = {name: make("fifo", acquire_timeout_s=20) for name in ("first", "second")}

    def run(name: str) -> None:
        lock = waiters[name]
        try:
            if lock.acquire():
                order.append(name)
        finally:
            lock.release()

    threads: list[threading.Thread] = []
    for expected_waiting, name in enumerate(("first", "second"), start=1):
        thread = threading.Thread(target=run, args=(name,))
        thread.start()
        threads.append(thread)
        wait_until(
            lambda n=expected_waiting: _holders(dflock_server, "fifo", make)[1] == n,
            what=f"{expected_waiting} waiter(s) queued",
        )
    holder.release()
    for thread in threads:
        thread.join(10)
    assert order == ["first", "second"]


def test_context_exit_releases_after_an_exception(make: Maker, dflock_server: ServerThread) -> None:
    lock = make("boom")
    with pytest.raises(RuntimeError, match="inside"), lock:
        assert lock.locked()
        raise RuntimeError("inside")
    assert not lock.locked()
    assert _holders(dflock_server, "boom", make) == (0, 0)
    _assert_free(make, "boom")


# ------------------------------------------------------------------------ two-phase


def test_two_phase_enqueue_and_wait(make: Maker) -> None:
    first = make("2p")
    assert first.enqueue() == "acquired"  # free: granted at once
    assert first.wait() is True and first.locked()

    second = make("2p")
    assert second.enqueue() == "queued"  # queued behind `first`
    assert not second.locked()
    with pytest.raises(DflockError, match="enqueued"):
        second.acquire()
    first.release()
    assert second.wait(5) is True
    assert second.locked() and second.token is not None
    second.release()


LATE_LEASE_S = 3
LATE_WAIT_S = 2.2
"""``wait()`` called this long after the queued lock was granted: inside its lease, but past
the point where the first renewal would have come had the lease been counted from the grant."""


def test_a_grant_collected_late_by_wait_is_renewed_in_time(
    make: Maker, dflock_server: ServerThread
) -> None:
    # The server grants a queued lock as soon as it is freed, and its lease runs from then;
    # `w` collects the grant later, with the whole lease in its reply. Counted from the `w`,
    # the first renewal would come after the lease had run out on the server.
    first = make("2p-late", lease_ttl_s=LATE_LEASE_S)
    assert first.acquire()
    lost: list[SyncLock] = []
    second = make("2p-late", lease_ttl_s=LATE_LEASE_S, on_lost=lost.append)
    assert second.enqueue() == "queued"
    first.release()  # the server grants `second` here
    time.sleep(LATE_WAIT_S)
    assert second.wait(5) is True
    assert second.owned()
    time.sleep(LATE_LEASE_S - LATE_WAIT_S + 1.5)  # past the lease counted from the grant
    assert lost == [] and second.owned()
    assert _holders(dflock_server, "2p-late", make) == (1, 0)
    assert second.release() is True


def test_a_wait_longer_than_the_lease_keeps_the_lock_over_a_slow_link(
    make: Maker, dflock_server: ServerThread
) -> None:
    # A `w` that blocked for longer than the lease: the client cannot tell when the grant
    # began, so it renews at once, and that renewal gets the usual time to be answered (not
    # the 0.1 s left for a lease known to have run out), here over a 150 ms link.
    lost: list[SyncLock] = []
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
        time.sleep(1.0)
        assert lost == [] and second.owned()
        assert second.release() is True


def test_wait_times_out_and_leaves_the_queue(make: Maker, dflock_server: ServerThread) -> None:
    with make("2p-timeout"):
        late = make("2p-timeout")
        assert late.enqueue() == "queued"
        assert late.wait(0) is False
        assert not late.locked()
        wait_until(lambda: _holders(dflock_server, "2p-timeout", make)[1] == 0, what="no waiters")
    _assert_free(make, "2p-timeout")


def test_wait_without_enqueue_is_refused(make: Maker) -> None:
    with pytest.raises(LockNotOwned, match="call enqueue"):
        make("nowait").wait()


def test_release_of_an_enqueued_lock_leaves_the_queue(make: Maker) -> None:
    with make("2p-leave"):
        late = make("2p-leave")
        assert late.enqueue() == "queued"
        assert late.release() is False
    _assert_free(make, "2p-leave")


# ------------------------------------------------------------------------ semaphores


def test_semaphore_limit_n(dflock_server: ServerThread) -> None:
    servers = [dflock_server.address]
    holders = [DistributedSemaphore("pool", 3, servers=servers) for _ in range(3)]
    for sem in holders:
        assert sem.acquire()
        assert sem.limit == 3
    assert len({sem.token for sem in holders}) == 3
    assert holders_and_waiters(dflock_server.address, "pool", semaphore=True) == (3, 0)

    assert DistributedSemaphore("pool", 3, 0, servers=servers).acquire() is False
    fourth = DistributedSemaphore("pool", 3, 10, servers=servers)
    got = threading.Event()
    thread = threading.Thread(target=lambda: fourth.acquire() and got.set())
    thread.start()
    wait_until(
        lambda: holders_and_waiters(dflock_server.address, "pool", semaphore=True) == (3, 1),
        what="the 4th waits",
    )
    assert not got.is_set()
    holders[0].release()
    assert got.wait(10)
    thread.join(10)
    assert fourth.locked()
    for sem in [*holders[1:], fourth]:
        assert sem.release()


def test_semaphore_limit_mismatch(dflock_server: ServerThread) -> None:
    servers = [dflock_server.address]
    with (
        DistributedSemaphore("sem-mm", 2, servers=servers),
        pytest.raises(LimitMismatchError, match="same limit"),
    ):
        DistributedSemaphore("sem-mm", 5, servers=servers).acquire()


def test_a_lock_and_a_semaphore_on_one_key_exclude_each_other(
    dflock_server: ServerThread,
) -> None:
    servers = [dflock_server.address]
    with DistributedLock("shared-name", servers=servers):
        with pytest.raises(LimitMismatchError, match="same limit"):
            DistributedSemaphore("shared-name", 2, 0, servers=servers).acquire()
        # Limit 1 is the lock's own limit: the same resource, held.
        assert DistributedSemaphore("shared-name", 1, 0, servers=servers).acquire() is False
    with DistributedSemaphore("shared-name", 2, servers=servers):
        lock = DistributedLock("shared-name", acquire_timeout_s=5, servers=servers)
        with pytest.raises(LimitMismatchError, match="in use as a semaphore"):
            lock.acquire()  # refused at once, not after waiting
        with pytest.raises(LimitMismatchError, match="in use as a semaphore"):
            lock.enqueue()
        assert not lock.locked()
    with DistributedLock("shared-name", servers=servers) as lock:  # idle: a lock again
        assert lock.locked()


# ------------------------------------------------------------------------ server limits


def test_max_locks_and_max_waiters(dflock_server_factory: Callable[..., ServerThread]) -> None:
    server = dflock_server_factory(max_locks=1, max_waiters=1)
    servers = [server.address]
    with DistributedLock("only", servers=servers):
        with pytest.raises(MaxLocksError, match="max-locks"):
            DistributedLock("another", servers=servers).acquire()
        queued = DistributedLock("only", servers=servers)
        assert queued.enqueue() == "queued"
        with pytest.raises(MaxWaitersError, match="max-waiters"):
            DistributedLock("only", servers=servers).enqueue()
        queued.release()


# ------------------------------------------------------------------------ connections


def test_pool_reuses_verified_connections(
    make: Maker, dflock_server_factory: Callable[..., ServerThread]
) -> None:
    server = dflock_server_factory()
    with ConnectionPool() as pool:
        first = make("pooled", servers=[server.address], pool=pool)
        assert first.acquire() and first.release()
        assert (pool.opened, pool.reused, pool.idle_count()) == (1, 0, 1)
        second = make("pooled-2", servers=[server.address], pool=pool)
        assert second.acquire()
        assert (pool.opened, pool.reused, pool.idle_count()) == (1, 1, 0)
        assert second.release()
        assert pool.idle_count(*server.address) == 1

        # the server restarts: the idle connection is dead and must not be reused
        port = server.port
        server.stop()
        dflock_server_factory(port=port)
        wait_until(lambda: pool.idle_count() == 1)
        third = make("pooled", servers=[server.address], pool=pool)
        assert third.acquire()
        assert (pool.opened, pool.reused, pool.discarded) == (2, 1, 1)
        third.release()
    assert pool.idle_count() == 0


def test_pool_keeps_at_most_max_idle(dflock_server: ServerThread) -> None:
    pool = ConnectionPool(max_idle_per_server=1)
    locks = [
        DistributedLock(f"cap-{i}", servers=[dflock_server.address], pool=pool) for i in range(3)
    ]
    for lock in locks:
        assert lock.acquire()
    for lock in locks:
        lock.release()
    assert pool.idle_count() == 1 and pool.discarded == 2
    pool.close()
    assert pool.idle_count() == 0


def test_without_a_pool_each_lock_closes_its_connection(dflock_server: ServerThread) -> None:
    before = connection_count(dflock_server.address)
    with DistributedLock("own-conn", servers=[dflock_server.address]):
        assert connection_count(dflock_server.address) == before + 1
    wait_until(lambda: connection_count(dflock_server.address) == before, what="closed")


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
    assert not waiter.locked() and pool.idle_count() == 0
    wait_until(lambda: holders_and_waiters(dflock_server.address, "cut") == (1, 0))
    holder.release()
    assert waiter.acquire()  # in step on a fresh connection
    assert waiter.release()


def test_auth(dflock_server_factory: Callable[..., ServerThread], pool: ConnectionPool) -> None:
    server = dflock_server_factory(auth_token="s3cret")
    servers = [server.address]
    with DistributedLock("authed", servers=servers, auth_token="s3cret", pool=pool) as lock:
        assert lock.locked()
    with DistributedLock("authed", servers=servers, auth_token="s3cret", pool=pool):
        assert pool.reused == 1
    with pytest.raises(AuthError, match="requires authentication: give the secret") as failure:
        DistributedLock("authed", servers=servers).acquire()
    assert "dflock_auth_token" in str(failure.value)  # the Celery setting, named too
    with pytest.raises(AuthError, match="rejected the auth token"):
        DistributedLock("authed", servers=servers, auth_token="wrong").acquire()
    with pytest.raises(AuthError, match="requires authentication"):
        DistributedSemaphore("authed", 2, servers=servers).acquire()


def test_auth_against_a_server_without_secret(dflock_server: ServerThread) -> None:
    with pytest.raises(AuthError, match="no auth token configured"):
        DistributedLock("x", servers=[dflock_server.address], auth_token="s3cret").acquire()


def test_server_unavailable_names_the_address(make: Maker, closed_port: int) -> None:
    lock = make("nobody-home", servers=[("127.0.0.1", closed_port)], connect_timeout_s=2)
    with pytest.raises(ServerUnavailable) as info:
        lock.acquire()
    message = str(info.value)
    assert f"127.0.0.1:{closed_port}" in message
    assert "dflockd" in message and "servers" in message
    assert not lock.locked()
    with pytest.raises(ServerUnavailable), ConnectionPool() as pool:
        make("nobody-home", servers=[("127.0.0.1", closed_port)], pool=pool).acquire()


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"renew_ratio": 1}, "renew_ratio"),
        ({"renew_ratio": 0}, "renew_ratio"),
        ({"acquire_timeout_s": -1}, "acquire_timeout_s"),
        ({"acquire_timeout_s": float("nan")}, "acquire_timeout_s"),
        ({"lease_ttl_s": 0}, "lease_ttl_s"),
        ({"connect_timeout_s": 0}, "connect_timeout_s"),
        ({"servers": []}, "servers is empty"),
        ({"auth_token": "a\nb"}, "line breaks"),
        ({"ssl_context": "yes"}, "ssl.SSLContext"),
        ({"pool": object()}, "ConnectionPool"),
        ({"key": "has space"}, "whitespace"),
    ],
)
def test_bad_options_are_refused_clearly(kwargs: dict[str, Any], match: str) -> None:
    key = kwargs.pop("key", "k")
    with pytest.raises(ValueError, match=match):
        DistributedLock(key, **kwargs)


@pytest.mark.parametrize("limit", [0, -1, 1_048_577, True, "3"])
def test_bad_semaphore_limits(limit: object) -> None:
    with pytest.raises(ValueError, match="limit"):
        DistributedSemaphore("s", limit)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]


# ------------------------------------------------------------------------ renewal


def test_renewal_keeps_the_lock_past_its_lease(dflock_server: ServerThread) -> None:
    """(The semaphore's twin of this test is in test_client_async.py.)"""
    servers = [dflock_server.address]
    with DistributedLock("long-job", lease_ttl_s=2, servers=servers) as lock:
        # held 5 s, 2.5 leases: without renewal it would have expired twice over
        assert not lock.lost_event.wait(5.0)
        assert lock.owned() and not lock.lost
        assert DistributedLock("long-job", 0, servers=servers).acquire() is False
        assert holders_and_waiters(dflock_server.address, "long-job") == (1, 0)


@pytest.fixture
def lost_calls() -> Iterator[list[SyncLock]]:
    calls: list[SyncLock] = []
    yield calls


def _assert_lost_reported(
    lock: SyncLock, calls: list[SyncLock], caplog: pytest.LogCaptureFixture, token: str
) -> None:
    interval = lock.lease * 0.5
    assert lock.lost_event.wait(interval + 5.0), "lost not reported within a renewal interval"
    assert lock.lost and not lock.owned()
    with pytest.raises(DflockError, match="was lost; call release"):
        lock.acquire()
    assert lock.release() is False  # joins the renewal thread: nothing more can happen
    assert calls == [lock]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "lost" in r.message]
    assert len(warnings) == 1
    assert repr(lock.key) in warnings[0].getMessage()
    assert token not in caplog.text


def test_refused_renewal_marks_the_lock_lost(
    make: Maker,
    dflock_server: ServerThread,
    lost_calls: list[SyncLock],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="celery_dflock")
    lock = make("taken-over", lease_ttl_s=2, on_lost=lost_calls.append)
    assert lock.acquire() and lock.token is not None
    token = lock.token
    release_behind_its_back(dflock_server.address, "taken-over", token, make.semaphore)
    _assert_lost_reported(lock, lost_calls, caplog, token)


def test_server_restart_marks_the_lock_lost(
    dflock_server_factory: Callable[..., ServerThread],
    lost_calls: list[SyncLock],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="celery_dflock")
    server = dflock_server_factory()
    lock = DistributedLock(
        "restarted", lease_ttl_s=2, servers=[server.address], on_lost=lost_calls.append
    )
    assert lock.acquire() and lock.token is not None
    token = lock.token
    port = server.port
    server.stop()
    replacement = dflock_server_factory(port=port)
    _assert_lost_reported(lock, lost_calls, caplog, token)
    with DistributedLock("restarted", 0, servers=[replacement.address]) as again:
        assert again.locked()


def test_a_failing_on_lost_callback_is_logged_not_raised(
    dflock_server: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    def explode(lock: DistributedLock) -> None:
        raise RuntimeError("callback failed")

    lock = DistributedLock("cb", lease_ttl_s=1, servers=[dflock_server.address], on_lost=explode)
    assert lock.acquire() and lock.token is not None
    release_behind_its_back(dflock_server.address, "cb", lock.token)
    assert lock.lost_event.wait(5.0)
    lock.release()
    assert "on_lost callback" in caplog.text and "callback failed" in caplog.text


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
    # to read None: the release had forgotten the grant under it).
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


def test_explicit_renew(make: Maker) -> None:
    lock = make("manual-renew", lease_ttl_s=30)
    with pytest.raises(LockNotOwned, match="acquire"):
        lock.renew()
    with lock:
        assert lock.renew() is True
    with pytest.raises(LockNotOwned):
        lock.renew()


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
    assert pool.idle_count() == 1


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
