"""What only the asyncio face of the client has: coroutine callbacks, cancellation, its own
pool type. Everything both faces do is tested once, on both, in test_client_faces.py."""

from __future__ import annotations

import asyncio
import gc
import logging
import time
import warnings
from collections.abc import AsyncIterator

import pytest

from celery_dflock import AsyncConnectionPool, AsyncDistributedLock
from dflockd_server.testing import ServerThread
from tests.client.faces import ASYNCIO, Face, Lock, Maker, assert_lost_reported, until
from tests.support.wire import held_keys, holders_and_waiters, release_behind_its_back


@pytest.fixture
def face() -> Face:
    """This module's tests are of the asyncio face only (``make`` builds its locks)."""
    return ASYNCIO


@pytest.fixture
async def apool() -> AsyncIterator[AsyncConnectionPool]:
    async with AsyncConnectionPool() as pool:
        yield pool


async def test_wrong_pool_type_is_refused(dflock_server: ServerThread) -> None:
    from celery_dflock import ConnectionPool

    with pytest.raises(ValueError, match="AsyncConnectionPool"):
        AsyncDistributedLock("k", pool=ConnectionPool())  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]


# ------------------------------------------------------------------------ coroutine callbacks


async def test_a_coroutine_on_lost_callback_is_awaited(
    make: Maker, dflock_server: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    """As test_client_faces.py's test_refused_renewal_marks_the_lock_lost, with an
    ``async def`` callback."""
    caplog.set_level(logging.WARNING, logger="celery_dflock")
    calls: list[Lock] = []

    async def on_lost(lock: Lock) -> None:
        calls.append(lock)

    lock = make("a:lost", lease_ttl_s=2, on_lost=on_lost)
    assert await lock.acquire() and lock.token is not None
    token = lock.token
    release_behind_its_back(dflock_server.address, "a:lost", token, make.semaphore)
    await assert_lost_reported(ASYNCIO, lock, calls, caplog, token)
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


# ------------------------------------------------------------------------ cancellation


async def test_cancelling_a_renew_in_flight_then_releasing(
    make: Maker, dflock_server: ServerThread, apool: AsyncConnectionPool
) -> None:
    lock = make("a:cancel-renew", pool=apool)
    assert await lock.acquire()
    conn = lock._holding.conn  # pyright: ignore[reportPrivateUsage]
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
    assert not conn.closed  # still in step: pooled (reused below)
    assert make.holders("a:cancel-renew") == (0, 0)
    again = make("a:cancel-renew", 0, pool=apool)
    assert await again.acquire()
    assert apool.reused == 1
    assert await again.release()


async def test_cancelling_the_background_renewal_in_flight_then_releasing(
    dflock_server: ServerThread, apool: AsyncConnectionPool
) -> None:
    lock = AsyncDistributedLock("a:bg", lease_ttl_s=1, servers=[dflock_server.address], pool=apool)
    assert await lock.acquire()
    conn = lock._holding.conn  # pyright: ignore[reportPrivateUsage]
    task = lock._holding.driver._task  # pyright: ignore[reportPrivateUsage]
    assert conn is not None and task is not None
    deadline = time.monotonic() + 5
    while not conn.in_flight and time.monotonic() < deadline:
        await asyncio.sleep(0)
    assert conn.in_flight, "the background renewal never got on the wire"
    task.cancel()
    await asyncio.wait([task])
    assert task.cancelled()
    assert await lock.release() is True
    assert not lock.lost
    assert held_keys(dflock_server.address) == set()
    assert await lock.acquire() and await lock.release()
    assert (apool.opened, apool.reused) == (1, 1)  # its connection went back in step


async def test_cancelled_acquire_closes_its_connection(
    dflock_server: ServerThread, apool: AsyncConnectionPool
) -> None:
    servers = [dflock_server.address]
    holder = AsyncDistributedLock("a:cut", servers=servers)
    assert await holder.acquire()
    waiter = AsyncDistributedLock("a:cut", acquire_timeout_s=30, servers=servers, pool=apool)
    waiting = asyncio.create_task(waiter.acquire())
    # Cancelled once it waits in the server's queue (a fixed 0.3 s cancelled it before it had
    # connected on a loaded machine, and then no connection was opened to be closed).
    await until(lambda: holders_and_waiters(dflock_server.address, "a:cut") == (1, 1))
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert not waiter.locked()
    await until(lambda: holders_and_waiters(dflock_server.address, "a:cut") == (1, 0))
    await holder.release()
    assert await waiter.acquire()  # on a fresh connection: never reused out of step
    assert (apool.opened, apool.reused) == (2, 0)
    assert await waiter.release()
    assert await waiter.acquire() and await waiter.release()
    assert (apool.opened, apool.reused) == (2, 1)


async def test_cancelled_release_lets_the_server_free_the_lock(dflock_server: ServerThread) -> None:
    lock = AsyncDistributedLock("a:cut-release", servers=[dflock_server.address])
    assert await lock.acquire()
    task = asyncio.create_task(lock.release())
    await asyncio.sleep(0)
    task.cancel()
    await asyncio.wait([task])
    assert not lock.locked()
    await until(lambda: "a:cut-release" not in held_keys(dflock_server.address))


def test_a_held_lock_used_from_another_event_loop_is_refused_not_hung(
    dflock_server: ServerThread,
) -> None:
    """A held asyncio lock renews from a task of the loop that acquired it. Its release or
    renewal from another loop (here a loop running in another thread) waited for that task
    forever; it now raises `DflockError` at once, and the lock stays usable on its own loop."""
    from concurrent.futures import ThreadPoolExecutor

    from celery_dflock import AsyncClient, DflockError

    address = dflock_server.address
    home = asyncio.new_event_loop()
    runner = ThreadPoolExecutor(1)
    runner.submit(home.run_forever)
    other = ThreadPoolExecutor(1)  # a hung call stays in its thread; the test fails in time
    client = AsyncClient([address])
    try:
        for lock in (
            client.lock("a:loop-1"),
            AsyncDistributedLock("a:loop-2", servers=[address]),
        ):
            assert asyncio.run_coroutine_threadsafe(lock.acquire(), home).result(10)
            for call in (lock.release, lock.renew):
                elsewhere = other.submit(asyncio.run, call())
                with pytest.raises(DflockError, match="another event loop"):
                    elsewhere.result(10)
            assert lock.owned() and lock.key in held_keys(address)
            assert asyncio.run_coroutine_threadsafe(lock.release(), home).result(10)
            assert lock.key not in held_keys(address)
        asyncio.run_coroutine_threadsafe(client.close(), home).result(10)
    finally:
        home.call_soon_threadsafe(home.stop)
        runner.shutdown()
        other.shutdown(wait=False)
        home.close()


def test_a_lock_taken_and_let_go_in_each_of_two_asyncio_runs_works(
    dflock_server: ServerThread,
) -> None:
    """A lock object made once (at import, say) and used whole in each ``asyncio.run``: not
    held between the runs, it belongs to no loop, and the second run takes the key again."""
    lock = AsyncDistributedLock("a:two-runs", servers=[dflock_server.address])

    async def once() -> int | None:
        async with lock:
            return lock.fence

    first, second = asyncio.run(once()), asyncio.run(once())
    assert first is not None and second is not None and second > first
    assert held_keys(dflock_server.address) == set()


def test_a_held_lock_whose_loop_has_closed_says_so(dflock_server: ServerThread) -> None:
    """Acquired in one ``asyncio.run``, released in the next: the first loop is closed, so no
    loop can release the lock, and the refusal says that rather than to use that loop."""
    from celery_dflock import DflockError

    lock = AsyncDistributedLock("a:closed-loop", servers=[dflock_server.address])
    assert asyncio.run(lock.acquire())
    with pytest.raises(DflockError, match="an event loop that has closed since"):
        asyncio.run(lock.release())
    with warnings.catch_warnings():  # its socket and task, left on the closed loop, go quietly
        warnings.simplefilter("ignore", ResourceWarning)
        del lock
        gc.collect()


def test_an_async_client_closed_by_a_second_asyncio_run_says_what_to_do(
    dflock_server: ServerThread,
) -> None:
    """``asyncio.run(main())`` with a module-level `AsyncClient`, then
    ``asyncio.run(client.close())``: the close is refused naming the client, as any other use
    on a second loop is; it ended in asyncio's ``RuntimeError: Event loop is closed`` from inside
    the pool, half done. A client closed before any use binds no loop: it is usable after."""
    from celery_dflock import AsyncClient, DflockError

    client = AsyncClient([dflock_server.address])
    fresh = AsyncClient([dflock_server.address])

    async def use(user: AsyncClient, key: str) -> bool:
        async with user.lock(key) as lock:
            return lock.owned()

    assert asyncio.run(use(client, "a:close-elsewhere"))
    with pytest.raises(DflockError, match=r"AsyncClient .* inside the coroutine"):
        asyncio.run(client.close())
    asyncio.run(fresh.close())
    assert asyncio.run(use(fresh, "a:closed-first"))
    with warnings.catch_warnings():  # the sockets both left on their closed loops go quietly
        warnings.simplefilter("ignore", ResourceWarning)
        del client, fresh
        gc.collect()


def test_an_async_client_used_by_a_second_asyncio_run_says_what_to_do(
    dflock_server: ServerThread,
) -> None:
    """A task body that calls ``asyncio.run`` each time with one module-level `AsyncClient`:
    the second run is refused naming the client (it was told of a pool it never made)."""
    from celery_dflock import AsyncClient, DflockError

    client = AsyncClient([dflock_server.address])

    async def run() -> bool:
        async with client.lock("a:second-run") as lock:
            return lock.owned()

    async def first() -> bool:
        held = await run()
        await client.close()
        return held

    assert asyncio.run(first())
    with pytest.raises(DflockError, match=r"AsyncClient .* inside the coroutine"):
        asyncio.run(run())
