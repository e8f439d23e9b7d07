"""AsyncDistributedLock and AsyncDistributedSemaphore against the real server."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

import pytest

from celery_dflock import (
    AsyncConnectionPool,
    AsyncDistributedLock,
    AsyncDistributedSemaphore,
    AuthError,
    DflockError,
    LimitMismatchError,
    LockNotAcquired,
    LockNotOwned,
    ServerUnavailable,
)
from celery_dflock._async.lock import _AsyncLockBase  # pyright: ignore[reportPrivateUsage]
from dflockd_server.testing import ServerThread
from tests.support.wire import held_keys, holders_and_waiters, release_behind_its_back

AsyncLock = _AsyncLockBase


class Maker(Protocol):
    semaphore: bool

    def __call__(self, key: str, *args: Any, **kwargs: Any) -> AsyncLock: ...


class _Make:
    def __init__(self, server: ServerThread, semaphore: bool) -> None:
        self.server = server
        self.semaphore = semaphore

    def __call__(self, key: str, *args: Any, **kwargs: Any) -> AsyncLock:
        kwargs.setdefault("servers", [self.server.address])
        if self.semaphore:
            return AsyncDistributedSemaphore(key, kwargs.pop("limit", 1), *args, **kwargs)
        return AsyncDistributedLock(key, *args, **kwargs)


@pytest.fixture(params=["lock", "semaphore"])
def make(request: pytest.FixtureRequest, dflock_server: ServerThread) -> Maker:
    """Builds an AsyncDistributedLock, or an AsyncDistributedSemaphore of limit 1."""
    return _Make(dflock_server, request.param == "semaphore")


@pytest.fixture
async def apool() -> AsyncIterator[AsyncConnectionPool]:
    async with AsyncConnectionPool() as pool:
        yield pool


async def until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Poll server state (which cannot be awaited) without blocking the event loop."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        await asyncio.sleep(0.01)


def _holders(server: ServerThread, key: str, make: Maker) -> tuple[int, int]:
    return holders_and_waiters(server.address, key, make.semaphore)


async def test_acquire_release_and_attributes(make: Maker, dflock_server: ServerThread) -> None:
    lock = make("a:1", lease_ttl_s=9)
    assert (lock.token, lock.fence, lock.lease, lock.lost) == (None, None, 0, False)
    assert not lock.locked() and not lock.owned() and lock.key == "a:1"
    assert lock.server == dflock_server.address
    assert await lock.acquire() is True
    assert lock.token is not None and lock.fence == int(lock.token[:16], 16)
    assert lock.lease == 9 and lock.locked() and lock.owned()
    assert lock.token not in repr(lock)
    assert _holders(dflock_server, "a:1", make)[0] == 1
    assert await lock.renew() is True
    assert await lock.release() is True
    assert await lock.release() is False
    assert not lock.locked() and lock.token is None
    assert _holders(dflock_server, "a:1", make) == (0, 0)
    with pytest.raises(LockNotOwned):
        await lock.renew()


async def test_timeouts_and_context_manager(make: Maker, dflock_server: ServerThread) -> None:
    async with make("a:busy") as holder:
        assert holder.locked()
        with pytest.raises(DflockError, match="already held"):
            await holder.acquire()
        assert await make("a:busy", acquire_timeout_s=0).acquire() is False
        assert await make("a:busy", acquire_timeout_s=1).acquire() is False
        with pytest.raises(LockNotAcquired, match="a:busy"):
            async with make("a:busy", 0):
                pytest.fail("entered a held lock")
    lock = make("a:boom")
    with pytest.raises(RuntimeError):
        async with lock:
            raise RuntimeError("inside")
    assert not lock.locked() and _holders(dflock_server, "a:boom", make) == (0, 0)


async def test_fifo_between_clients(make: Maker, dflock_server: ServerThread) -> None:
    holder = make("a:fifo")
    assert await holder.acquire()
    order: list[str] = []

    async def run(name: str) -> None:
        lock = make("a:fifo", acquire_timeout_s=20)
        if await lock.acquire():
            order.append(name)
            await lock.release()

    tasks: list[asyncio.Task[None]] = []
    for waiting, name in enumerate(("first", "second", "third"), start=1):
        tasks.append(asyncio.create_task(run(name)))
        await until(lambda n=waiting: _holders(dflock_server, "a:fifo", make)[1] == n)
    await holder.release()
    await asyncio.wait_for(asyncio.gather(*tasks), 10)
    assert order == ["first", "second", "third"]


async def test_two_phase(make: Maker, dflock_server: ServerThread) -> None:
    first = make("a:2p")
    assert await first.enqueue() == "acquired"
    assert await first.wait() is True
    second = make("a:2p")
    assert await second.enqueue() == "queued"
    assert await second.wait(0) is False  # timed out: left the queue
    await until(lambda: _holders(dflock_server, "a:2p", make)[1] == 0)
    assert await second.enqueue() == "queued"
    await first.release()
    assert await second.wait(5) is True and second.locked()
    assert await second.release() is True
    with pytest.raises(LockNotOwned, match="call enqueue"):
        await second.wait()


async def test_a_grant_collected_late_by_wait_is_renewed_in_time(
    make: Maker, dflock_server: ServerThread
) -> None:
    # As in the blocking client's test: the lease of a queued lock runs from when the server
    # granted it, not from the `w` that collects it later.
    lease, late = 3, 2.2
    first = make("a:2p-late", lease_ttl_s=lease)
    assert await first.acquire()
    lost: list[AsyncLock] = []
    second = make("a:2p-late", lease_ttl_s=lease, on_lost=lost.append)
    assert await second.enqueue() == "queued"
    await first.release()  # the server grants `second` here
    await asyncio.sleep(late)
    assert await second.wait(5) is True
    assert second.owned()
    await asyncio.sleep(lease - late + 1.5)  # past the lease counted from the grant
    assert lost == [] and second.owned()
    assert _holders(dflock_server, "a:2p-late", make) == (1, 0)
    assert await second.release() is True


async def test_semaphore_limit_n(dflock_server: ServerThread) -> None:
    servers = [dflock_server.address]
    holders = [AsyncDistributedSemaphore("a:sem", 2, servers=servers) for _ in range(2)]
    for sem in holders:
        assert await sem.acquire() and sem.limit == 2
    assert await AsyncDistributedSemaphore("a:sem", 2, 0, servers=servers).acquire() is False
    third = AsyncDistributedSemaphore("a:sem", 2, 10, servers=servers)
    waiting = asyncio.create_task(third.acquire())
    await until(lambda: holders_and_waiters(dflock_server.address, "a:sem", True) == (2, 1))
    assert not waiting.done()
    await holders[0].release()
    assert await asyncio.wait_for(waiting, 10) is True
    with pytest.raises(LimitMismatchError):
        await AsyncDistributedSemaphore("a:sem", 3, 0, servers=servers).acquire()
    for sem in (holders[1], third):
        assert await sem.release()


async def test_pool_reuse_and_verification(
    make: Maker, dflock_server_factory: Callable[..., ServerThread], apool: AsyncConnectionPool
) -> None:
    server = dflock_server_factory()
    servers = [server.address]
    async with make("a:p1", servers=servers, pool=apool):
        pass
    async with make("a:p2", servers=servers, pool=apool):
        pass
    assert (apool.opened, apool.reused, apool.idle_count()) == (1, 1, 1)
    port = server.port
    server.stop()
    dflock_server_factory(port=port)
    async with make("a:p3", servers=servers, pool=apool) as lock:
        assert lock.locked()
    assert (apool.opened, apool.reused, apool.discarded) == (2, 1, 1)


async def test_auth(dflock_server_factory: Callable[..., ServerThread]) -> None:
    server = dflock_server_factory(auth_token="s3cret")
    servers = [server.address]
    async with AsyncDistributedLock("a:auth", servers=servers, auth_token="s3cret") as lock:
        assert lock.locked()
    with pytest.raises(AuthError, match="requires authentication"):
        await AsyncDistributedLock("a:auth", servers=servers).acquire()
    with pytest.raises(AuthError, match="rejected the auth token"):
        await AsyncDistributedSemaphore("a:auth", 2, servers=servers, auth_token="no").acquire()


async def test_server_unavailable(make: Maker, closed_port: int) -> None:
    with pytest.raises(ServerUnavailable, match=rf"127\.0\.0\.1:{closed_port}.*dflockd.*servers"):
        await make("a:gone", servers=[("127.0.0.1", closed_port)]).acquire()


async def test_wrong_pool_type_is_refused(dflock_server: ServerThread) -> None:
    from celery_dflock import ConnectionPool

    with pytest.raises(ValueError, match="AsyncConnectionPool"):
        AsyncDistributedLock("k", pool=ConnectionPool())  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]


# ------------------------------------------------------------------------ renewal and loss


async def test_renewal_keeps_a_semaphore_past_its_lease(dflock_server: ServerThread) -> None:
    """(The lock's twin of this test is in test_client_sync.py.)"""
    servers = [dflock_server.address]
    async with AsyncDistributedSemaphore("a:long", 1, lease_ttl_s=2, servers=servers) as sem:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(sem.lost_event.wait(), 5.0)  # held 2.5 leases
        assert sem.owned() and not sem.lost
        assert await AsyncDistributedSemaphore("a:long", 1, 0, servers=servers).acquire() is False


@pytest.mark.parametrize("coroutine_callback", [False, True])
async def test_refused_renewal_marks_the_lock_lost(
    make: Maker,
    dflock_server: ServerThread,
    caplog: pytest.LogCaptureFixture,
    coroutine_callback: bool,
) -> None:
    caplog.set_level(logging.WARNING, logger="celery_dflock")
    calls: list[AsyncLock] = []

    async def on_lost_async(lock: AsyncLock) -> None:
        calls.append(lock)

    on_lost: Callable[[AsyncLock], object] = on_lost_async if coroutine_callback else calls.append
    lock = make("a:lost", lease_ttl_s=2, on_lost=on_lost)
    assert await lock.acquire() and lock.token is not None
    token = lock.token
    release_behind_its_back(dflock_server.address, "a:lost", token, make.semaphore)
    await asyncio.wait_for(lock.lost_event.wait(), lock.lease * 0.5 + 5)
    assert lock.lost and not lock.owned()
    assert await lock.release() is False
    assert calls == [lock]
    lost_logs = [r for r in caplog.records if r.levelno == logging.WARNING and "lost" in r.message]
    assert len(lost_logs) == 1 and "'a:lost'" in lost_logs[0].getMessage()
    assert token not in caplog.text
    assert await lock.acquire() and not lock.lost and not lock.lost_event.is_set()
    assert await lock.release()


async def test_on_lost_reads_the_lost_fence_while_a_release_races_it(
    dflock_server: ServerThread,
) -> None:
    # A coroutine on_lost that awaits while a release comes in: the release waits for the
    # renewal that is telling it, so the callback still reads the lost grant's fence.
    in_callback = asyncio.Event()
    seen: list[int | None] = []

    async def on_lost(lk: AsyncDistributedLock) -> None:
        in_callback.set()
        await asyncio.sleep(0.3)  # the release below runs meanwhile
        seen.append(lk.fence)

    lock = AsyncDistributedLock(
        "a:lost-fence", lease_ttl_s=1, servers=[dflock_server.address], on_lost=on_lost
    )
    assert await lock.acquire() and lock.token is not None
    fence = lock.fence
    release_behind_its_back(dflock_server.address, "a:lost-fence", lock.token)
    await asyncio.wait_for(in_callback.wait(), 5)
    assert await lock.release() is False
    assert seen == [fence]
    assert lock.fence is None and not lock.locked()


async def test_server_restart_marks_the_lock_lost(
    dflock_server_factory: Callable[..., ServerThread], caplog: pytest.LogCaptureFixture
) -> None:
    server = dflock_server_factory()
    calls: list[AsyncLock] = []

    def explode(lock: AsyncLock) -> None:
        calls.append(lock)
        raise RuntimeError("callback failed")

    lock = AsyncDistributedLock(
        "a:restart", lease_ttl_s=2, servers=[server.address], on_lost=explode
    )
    assert await lock.acquire()
    port = server.port
    server.stop()
    replacement = dflock_server_factory(port=port)
    await asyncio.wait_for(lock.lost_event.wait(), 1 + 5)
    assert await lock.release() is False
    assert calls == [lock]
    assert "callback failed" in caplog.text  # logged, not raised from the task
    async with AsyncDistributedLock("a:restart", 0, servers=[replacement.address]) as again:
        assert again.locked()


# ------------------------------------------------------------------------ cancellation


async def test_cancelling_a_renew_in_flight_then_releasing(
    make: Maker, dflock_server: ServerThread, apool: AsyncConnectionPool
) -> None:
    lock = make("a:cancel-renew", pool=apool)
    assert await lock.acquire()
    conn = lock._conn  # pyright: ignore[reportPrivateUsage]
    assert conn is not None
    renew = asyncio.create_task(lock.renew())
    for _ in range(1000):
        if conn.in_flight:
            break
        await asyncio.sleep(0)
    assert conn.in_flight, "the renew never got on the wire"
    renew.cancel()
    with pytest.raises(asyncio.CancelledError):
        await renew
    assert await lock.release() is True  # waited for the shielded renew, then released
    assert not conn.closed and apool.idle_count() == 1  # still in step: pooled
    assert _holders(dflock_server, "a:cancel-renew", make) == (0, 0)
    again = make("a:cancel-renew", 0, pool=apool)
    assert await again.acquire()
    assert apool.reused == 1
    assert await again.release()


async def test_cancelling_the_background_renewal_in_flight_then_releasing(
    dflock_server: ServerThread, apool: AsyncConnectionPool
) -> None:
    lock = AsyncDistributedLock("a:bg", lease_ttl_s=1, servers=[dflock_server.address], pool=apool)
    assert await lock.acquire()
    conn = lock._conn  # pyright: ignore[reportPrivateUsage]
    task = lock._driver._task  # pyright: ignore[reportPrivateUsage]
    assert conn is not None and task is not None
    deadline = time.monotonic() + 5
    while not conn.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0)
    assert conn.in_flight, "the background renewal never got on the wire"
    task.cancel()
    await asyncio.wait([task])
    assert task.cancelled()
    assert await lock.release() is True
    assert not lock.lost and apool.idle_count() == 1
    assert held_keys(dflock_server.address) == set()
    assert await lock.acquire() and await lock.release()


async def test_cancelled_acquire_closes_its_connection(
    dflock_server: ServerThread, apool: AsyncConnectionPool
) -> None:
    servers = [dflock_server.address]
    holder = AsyncDistributedLock("a:cut", servers=servers)
    assert await holder.acquire()
    waiter = AsyncDistributedLock("a:cut", acquire_timeout_s=30, servers=servers, pool=apool)
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(waiter.acquire(), 0.3)
    assert not waiter.locked() and apool.idle_count() == 0  # never reused out of step
    await until(lambda: holders_and_waiters(dflock_server.address, "a:cut") == (1, 0))
    await holder.release()
    assert await waiter.acquire()  # on a fresh connection
    assert await waiter.release()
    assert apool.idle_count() == 1


async def test_cancelled_release_lets_the_server_free_the_lock(dflock_server: ServerThread) -> None:
    lock = AsyncDistributedLock("a:cut-release", servers=[dflock_server.address])
    assert await lock.acquire()
    task = asyncio.create_task(lock.release())
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.wait([task])
    assert not lock.locked()
    await until(lambda: "a:cut-release" not in held_keys(dflock_server.address))
