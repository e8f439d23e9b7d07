"""Both faces of the client against the real server, one test body each: every test here runs
on `DistributedLock` / `DistributedSemaphore` and on their asyncio twins (see faces.py; the
``face`` and ``make`` fixtures are in conftest.py).

What only one face has lives beside: threads, signals and the slow link in
test_client_sync.py, cancellation and coroutine callbacks in test_client_async.py.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import pytest

from celery_dflock import (
    AsyncClient,
    AuthError,
    DflockError,
    InvalidValueError,
    LimitMismatchError,
    LockNotAcquired,
    LockNotOwned,
    MaxLocksError,
    MaxWaitersError,
    ServerUnavailable,
)
from dflockd_server.constants import DEFAULT_MAX_LEASE_TTL_S
from dflockd_server.testing import ServerThread
from tests.client.faces import Face, Lock, Maker, assert_lost_reported, until
from tests.support.proxy import FaultProxy
from tests.support.wire import (
    Wire,
    connection_count,
    holders_and_waiters,
    release_behind_its_back,
)


async def assert_free(make: Maker, key: str) -> None:
    """The key can be taken at once (and is let go again: a lock left held goes on renewing,
    and reports itself lost in whatever test runs when its server stops)."""
    lock = make(key, 0)
    assert await make.face.run(lock.acquire())
    assert await make.face.run(lock.release())


# ------------------------------------------------------------------------ acquire / release


async def test_acquire_release_and_attributes(make: Maker, dflock_server: ServerThread) -> None:
    run = make.face.run
    lock = make("res:1")
    assert (lock.token, lock.fence, lock.lease, lock.lost) == (None, None, 0, False)
    assert not lock.locked() and not lock.owned()
    assert lock.key == "res:1" and lock.server == dflock_server.address

    assert await run(lock.acquire()) is True
    assert lock.token is not None and len(lock.token) == 32
    assert lock.fence == int(lock.token[:16], 16)
    assert lock.lease == 33  # the server's default
    assert lock.locked() and lock.owned() and not lock.lost
    assert lock.token not in repr(lock) and "res:1" in repr(lock)
    assert make.holders("res:1")[0] == 1
    assert await run(lock.renew()) is True

    assert await run(lock.release()) is True
    assert await run(lock.release()) is False  # idempotent
    assert lock.token is None and not lock.locked()
    assert make.holders("res:1") == (0, 0)
    with pytest.raises(LockNotOwned):
        await run(lock.renew())


async def test_fences_grow_with_every_grant(make: Maker) -> None:
    lock = make("fence")
    fences: list[int] = []
    for _ in range(3):
        assert await make.face.run(lock.acquire())
        assert lock.fence is not None
        fences.append(lock.fence)
        await make.face.run(lock.release())
    assert fences == sorted(set(fences))


async def test_lease_ttl_is_sent(make: Maker) -> None:
    async with make.face.held(make("leased", lease_ttl_s=7)) as lock:
        assert lock.lease == 7
        assert await make.face.run(lock.renew()) is True


async def test_a_lease_above_the_servers_max_lease_ttl_is_explained(make: Maker) -> None:
    lock = make("too-long", 0, lease_ttl_s=DEFAULT_MAX_LEASE_TTL_S + 1)
    # The server's hello told its limit: refused before asking, naming what to change.
    with pytest.raises(
        InvalidValueError, match=r"grants \(300 s, its --max-lease-ttl / DFLOCKD_MAX_LEASE"
    ):
        await make.face.run(lock.acquire())
    assert not lock.locked()


async def test_acquire_twice_is_refused(make: Maker) -> None:
    async with make.face.held(make("twice")) as lock:
        assert lock.locked()
        with pytest.raises(DflockError, match="already held"):
            await make.face.run(lock.acquire())


async def test_timeout_zero_and_small(make: Maker) -> None:
    run = make.face.run
    async with make.face.held(make("busy")):
        assert await run(make("busy", acquire_timeout_s=0).acquire()) is False
        assert await run(make("busy", acquire_timeout_s=0.2).acquire()) is False  # rounds up: 1 s
        assert await run(make("busy", acquire_timeout_s=1).acquire()) is False
        with pytest.raises(LockNotAcquired, match=r"'busy'.*within 0s"):
            async with make.face.held(make("busy", 0)):
                pytest.fail("entered a lock that is held elsewhere")


async def test_an_acquire_that_times_out_in_a_restart_grace_says_so(
    make: Maker, dflock_server_factory: Callable[..., ServerThread]
) -> None:
    """A server in its restart grace grants no key: an acquire that times out in it says why
    (``lock.grace``, a `with` block's `LockNotAcquired`); a key held by another says nothing
    of a grace."""
    graced = [dflock_server_factory(restart_grace_s=600.0).address]
    lock = make("graced", 0, servers=graced)
    assert await make.face.run(lock.acquire()) is False
    assert lock.grace is not None and "is in its restart grace" in lock.grace, lock.grace
    with pytest.raises(LockNotAcquired, match="in its restart grace, granting no key for"):
        async with make.face.held(make("graced", 1, servers=graced)):
            pytest.fail("entered a lock in the server's restart grace")
    async with make.face.held(make("busy")):
        busy = make("busy", 0)
        assert await make.face.run(busy.acquire()) is False
        assert busy.grace is None


@pytest.mark.parametrize("how", ["acquire", "enqueue-wait"])
@pytest.mark.parametrize("session_ttl_s", [None, 0], ids=["sessions", "no-sessions"])
async def test_a_pool_learns_a_restarted_server_s_grace(
    face: Face,
    dflock_server_factory: Callable[..., ServerThread],
    session_ttl_s: int | None,
    how: str,
) -> None:
    """A pool that knew its server before a restart asks no `hello` again: its new connection
    joins its client session, and that answer tells the new run's grace. A server without
    sessions (``--session-ttl 0``) has no join to answer: an acquire, or a two-phase wait,
    that times out asks."""
    ttl = {} if session_ttl_s is None else {"session_ttl_s": session_ttl_s}
    server = dflock_server_factory(**ttl)
    servers = [server.address]
    async with face.held(face.pool_class()) as pool:
        async with face.held(face.lock_class("before", servers=servers, pool=pool)):
            pass
        port = server.port
        server.stop()
        dflock_server_factory(port=port, restart_grace_s=600.0, **ttl)
        lock = face.lock_class("after", 0, servers=servers, pool=pool)
        if how == "acquire":
            assert await face.run(lock.acquire()) is False
        else:
            assert await face.run(lock.enqueue()) == "queued"
            assert await face.run(lock.wait(0)) is False
        assert lock.grace is not None and "is in its restart grace" in lock.grace, lock.grace


async def test_fifo_between_clients(make: Maker) -> None:
    run = make.face.run
    holder = make("fifo")
    assert await run(holder.acquire())
    order: list[str] = []
    names = ("first", "second", "third")
    waiters = {name: make("fifo", acquire_timeout_s=20) for name in names}

    async def take(name: str) -> None:
        lock = waiters[name]
        try:
            if await run(lock.acquire()):
                order.append(name)
        finally:
            await run(lock.release())

    def start(name: str) -> Any:
        if make.face.is_async:
            return lambda: take(name)
        return lambda: asyncio.run(take(name))  # the blocking face, in a thread of its own

    joins = []
    for waiting, name in enumerate(names, start=1):
        joins.append(make.face.spawn(start(name)))
        await until(lambda n=waiting: make.holders("fifo")[1] == n, what=f"{waiting} queued")
    await run(holder.release())
    for join in joins:
        await join(10)
    assert order == list(names)


async def test_context_exit_releases_after_an_exception(make: Maker) -> None:
    lock = make("boom")
    with pytest.raises(RuntimeError, match="inside"):
        async with make.face.held(lock):
            assert lock.locked()
            raise RuntimeError("inside")
    assert not lock.locked()
    assert make.holders("boom") == (0, 0)
    await assert_free(make, "boom")


# ------------------------------------------------------------------------ two-phase


async def test_two_phase_enqueue_and_wait(make: Maker) -> None:
    run = make.face.run
    first = make("2p")
    assert await run(first.enqueue()) == "acquired"  # free: granted at once
    assert await run(first.wait()) is True and first.locked()

    second = make("2p")
    assert await run(second.enqueue()) == "queued"  # queued behind `first`
    assert not second.locked()
    with pytest.raises(DflockError, match="enqueued"):
        await run(second.acquire())
    assert await run(second.wait(0)) is False  # timed out: left the queue
    await until(lambda: make.holders("2p")[1] == 0, what="no waiters")
    assert await run(second.enqueue()) == "queued"
    await run(first.release())
    assert await run(second.wait(5)) is True
    assert second.locked() and second.token is not None
    assert await run(second.release()) is True
    with pytest.raises(LockNotOwned, match="call enqueue"):
        await run(second.wait())


async def test_a_second_enqueue_while_queued_is_refused_and_keeps_the_place(make: Maker) -> None:
    """``enqueue()`` on a lock queued already is refused ("call wait() or release() first"),
    and the lock keeps its place: the refusal's own cleanup (meant for an enqueue interrupted
    once queued) left the queue, so the ``wait()`` it told the caller to make raised
    `LockNotOwned` ("not enqueued") and the key went to the next waiter."""
    run = make.face.run
    holder, queued = make("2p-again"), make("2p-again")
    assert await run(holder.acquire())
    assert await run(queued.enqueue()) == "queued"
    with pytest.raises(DflockError, match=r"enqueued on this object; call wait\(\)"):
        await run(queued.enqueue())
    assert make.holders("2p-again") == (1, 1)  # still waiting
    assert await run(holder.release())
    assert await run(queued.wait(5)) is True and queued.owned()
    assert await run(queued.release()) is True


LATE_LEASE_S = 4
LATE_SESSION_S = 6
"""The server's session time in that test: renewals every ``LATE_LEASE_S / 2`` s (2 s), not
every third of the default 3 s session (1 s)."""
LATE_WAIT_S = 2.5
"""``wait()`` called this long after the queued lock was granted: inside its lease, but past
the point where the first renewal would have come had the lease been counted from the grant."""


async def test_a_grant_collected_late_by_wait_is_renewed_in_time(
    make: Maker, dflock_server_factory: Callable[..., ServerThread]
) -> None:
    # The server grants a queued lock as soon as it is freed, and its lease runs from then;
    # `w` collects the grant later, with the whole lease in its reply. Counted from the `w`,
    # the first renewal would come one renewal interval after it (2.5 + 2 = 4.5 s after the
    # grant), after the lease had run out on the server (4 s). The `w` and the renewal sent at
    # once after it have the 1.5 s left of the lease to reach the server: with a 3 s lease, a
    # 3 s session (renewals every 1 s) and the `w` at 2.2 s they had 0.8 s, too little on a
    # loaded CI machine. A longer lease alone would not do: on a 3 s session the renewal
    # interval stays 1 s, and a `w` more than 1 s before the lease's end would not catch the
    # late first renewal; hence the longer session.
    make = Maker(make.face, dflock_server_factory(session_ttl_s=LATE_SESSION_S), make.semaphore)
    run = make.face.run
    first = make("2p-late", lease_ttl_s=LATE_LEASE_S)
    assert await run(first.acquire())
    lost: list[Lock] = []
    second = make("2p-late", lease_ttl_s=LATE_LEASE_S, on_lost=lost.append)
    assert await run(second.enqueue()) == "queued"
    await run(first.release())  # the server grants `second` here
    await asyncio.sleep(LATE_WAIT_S)
    assert await run(second.wait(5)) is True
    assert second.owned()
    await asyncio.sleep(LATE_LEASE_S - LATE_WAIT_S + 1.5)  # past the lease counted from the grant
    assert lost == [] and second.owned()
    assert make.holders("2p-late") == (1, 0)
    assert await run(second.release()) is True


CUT_LEASE_S = 3


async def test_a_grant_collected_by_wait_on_a_connection_closed_at_once_is_reattached(
    make: Maker, caplog: pytest.LogCaptureFixture
) -> None:
    # A `w` that blocked past the lease counted from the `e`: the lease the client can count on
    # is over when the grant comes, while the server's runs its whole length from the grant. Its
    # first renewal is answered until the latest end that lease can have (the reply's time plus
    # the lease). The connection closed right after the reply (here by the proxy: the first
    # renewal finds an EOF, or is cut by the reset its bytes cause), the lock reattaches by
    # token until then too, rather than count itself lost with no attempt.
    caplog.set_level(logging.INFO, logger="celery_dflock.client")
    run = make.face.run
    with FaultProxy(make.server.address) as proxy:
        first = make("2p-cut", lease_ttl_s=CUT_LEASE_S)
        assert await run(first.acquire())
        lost: list[Lock] = []
        second = make(
            "2p-cut", lease_ttl_s=CUT_LEASE_S, servers=[proxy.address], on_lost=lost.append
        )
        assert await run(second.enqueue()) == "queued"
        dropped = proxy.drop_after_reply(b"w\n2p-cut\n")
        join = make.face.spawn(lambda: second.wait(10))
        await asyncio.sleep(CUT_LEASE_S + 1.0)
        assert await run(first.release())  # the server grants `second` now
        await join(15.0)
        assert second.locked()
        # (the proxy closes it once the reply is written: the client may have read it first)
        assert await asyncio.to_thread(dropped.wait, 10.0)
        await until(lambda: bool(second.owned() or lost), what="renewed by token, or lost")
        assert lost == [] and second.owned(), caplog.text
        assert make.holders("2p-cut") == (1, 0)
        assert await run(second.release()) is True


async def test_wait_times_out_and_leaves_the_queue(make: Maker) -> None:
    async with make.face.held(make("2p-timeout")):
        late = make("2p-timeout")
        assert await make.face.run(late.enqueue()) == "queued"
        assert await make.face.run(late.wait(0)) is False
        assert not late.locked()
        await until(lambda: make.holders("2p-timeout")[1] == 0, what="no waiters")
    await assert_free(make, "2p-timeout")


async def test_wait_without_enqueue_is_refused(make: Maker) -> None:
    with pytest.raises(LockNotOwned, match="call enqueue"):
        await make.face.run(make("nowait").wait())


@pytest.mark.parametrize("timeout_s", [-1, float("nan"), "5"])
async def test_a_wrong_wait_timeout_is_named_also_once_held(make: Maker, timeout_s: Any) -> None:
    """``wait(timeout_s)`` on a lock its enqueue got at once (held) checks ``timeout_s`` as a
    queued one's does: it returned True whatever it was given."""
    lock = make("2p-held-wait")
    assert await make.face.run(lock.enqueue()) == "acquired"
    try:
        with pytest.raises(InvalidValueError, match="timeout_s must be"):
            await make.face.run(lock.wait(timeout_s))
        assert await make.face.run(lock.wait(1)) is True
    finally:
        await make.face.run(lock.release())


async def test_release_of_an_enqueued_lock_leaves_the_queue(make: Maker) -> None:
    async with make.face.held(make("2p-leave")):
        late = make("2p-leave")
        assert await make.face.run(late.enqueue()) == "queued"
        assert await make.face.run(late.release()) is False
        # It leaves the queue by closing its connection, which the server hears on its own
        # time (were the holder's release handled first, see the next test).
        await until(lambda: make.holders("2p-leave")[1] == 0, what="no waiters")
    await assert_free(make, "2p-leave")


async def test_release_of_an_enqueued_lock_granted_meanwhile_frees_the_key_at_once(
    make: Maker,
) -> None:
    """The holder let go while the other waited its turn unasked: the server granted it on
    the queued connection. Its release collects that grant and releases it, so the key is
    free at once (closing the connection alone left it held for the session's time, 15 s, or
    longer while the session kept other locks)."""
    first, late = make("2p-granted"), make("2p-granted")
    assert await make.face.run(first.acquire())
    assert await make.face.run(late.enqueue()) == "queued"
    assert await make.face.run(first.release())
    await until(lambda: make.holders("2p-granted") == (1, 0), what="the grant on the queue")
    assert await make.face.run(late.release()) is True
    assert not late.locked() and late.token is None
    await assert_free(make, "2p-granted")


# ------------------------------------------------------------------------ semaphores


async def test_semaphore_limit_n(face: Face, dflock_server: ServerThread) -> None:
    run, semaphore = face.run, face.semaphore_class
    servers = [dflock_server.address]
    holders = [semaphore("pool", 3, servers=servers) for _ in range(3)]
    for sem in holders:
        assert await run(sem.acquire())
        assert sem.limit == 3
    assert len({sem.token for sem in holders}) == 3
    assert holders_and_waiters(dflock_server.address, "pool", semaphore=True) == (3, 0)

    assert await run(semaphore("pool", 3, 0, servers=servers).acquire()) is False
    fourth = semaphore("pool", 3, 10, servers=servers)
    got: list[bool] = []

    async def take() -> None:
        got.append(await run(fourth.acquire()))

    join = face.spawn(take if face.is_async else lambda: asyncio.run(take()))
    await until(
        lambda: holders_and_waiters(dflock_server.address, "pool", semaphore=True) == (3, 1),
        what="the 4th waits",
    )
    assert got == []
    await run(holders[0].release())
    await join(10)
    assert got == [True] and fourth.locked()
    with pytest.raises(LimitMismatchError):
        await run(semaphore("pool", 4, 0, servers=servers).acquire())
    for sem in [*holders[1:], fourth]:
        assert await run(sem.release())


async def test_semaphore_limit_mismatch(face: Face, dflock_server: ServerThread) -> None:
    servers = [dflock_server.address]
    async with face.held(face.semaphore_class("sem-mm", 2, servers=servers)):
        with pytest.raises(LimitMismatchError, match="same limit"):
            await face.run(face.semaphore_class("sem-mm", 5, servers=servers).acquire())


async def test_a_lock_and_a_semaphore_on_one_key_exclude_each_other(
    face: Face, dflock_server: ServerThread
) -> None:
    run, lock_class, semaphore = face.run, face.lock_class, face.semaphore_class
    servers = [dflock_server.address]
    async with face.held(lock_class("shared-name", servers=servers)):
        with pytest.raises(LimitMismatchError, match="same limit"):
            await run(semaphore("shared-name", 2, 0, servers=servers).acquire())
        # Limit 1 is the lock's own limit: the same resource, held.
        assert await run(semaphore("shared-name", 1, 0, servers=servers).acquire()) is False
    async with face.held(semaphore("shared-name", 2, servers=servers)):
        lock = lock_class("shared-name", acquire_timeout_s=5, servers=servers)
        with pytest.raises(LimitMismatchError, match="in use as a semaphore"):
            await run(lock.acquire())  # refused at once, not after waiting
        with pytest.raises(LimitMismatchError, match="in use as a semaphore"):
            await run(lock.enqueue())
        assert not lock.locked()
    async with face.held(lock_class("shared-name", servers=servers)) as lock:  # a lock again
        assert lock.locked()


# ------------------------------------------------------------------------ server limits


async def test_max_locks_and_max_waiters(
    face: Face, dflock_server_factory: Callable[..., ServerThread]
) -> None:
    run, lock_class = face.run, face.lock_class
    server = dflock_server_factory(max_locks=1, max_waiters=1)
    servers = [server.address]
    async with face.held(lock_class("only", servers=servers)):
        with pytest.raises(MaxLocksError, match="max-locks"):
            await run(lock_class("another", servers=servers).acquire())
        queued = lock_class("only", servers=servers)
        assert await run(queued.enqueue()) == "queued"
        with pytest.raises(MaxWaitersError, match="max-waiters"):
            await run(lock_class("only", servers=servers).enqueue())
        await run(queued.release())


# ------------------------------------------------------------------------ connections


async def test_pool_reuses_verified_connections(
    make: Maker, dflock_server_factory: Callable[..., ServerThread]
) -> None:
    run = make.face.run
    server = dflock_server_factory()
    async with make.face.held(make.face.pool_class()) as pool:
        first = make("pooled", servers=[server.address], pool=pool)
        assert await run(first.acquire()) and await run(first.release())
        assert (pool.opened, pool.reused) == (1, 0)
        second = make("pooled-2", servers=[server.address], pool=pool)
        assert await run(second.acquire())
        assert (pool.opened, pool.reused) == (1, 1)  # the first's connection, idle
        assert await run(second.release())

        # the server restarts: the idle connection is dead and must not be reused
        port = server.port
        server.stop()
        dflock_server_factory(port=port)
        async with make.face.held(make("pooled", servers=[server.address], pool=pool)) as third:
            assert third.locked()
            assert (pool.opened, pool.reused, pool.discarded) == (2, 1, 1)
    # closed with the block: the next lock opens a connection
    async with make.face.held(make("pooled", servers=[server.address], pool=pool)):
        assert (pool.opened, pool.reused) == (3, 1)
    await run(pool.aclose() if make.face.is_async else pool.close())


async def test_pool_keeps_at_most_max_idle(face: Face, dflock_server: ServerThread) -> None:
    pool = face.pool_class(max_idle_per_server=1)
    locks = [
        face.lock_class(f"cap-{i}", servers=[dflock_server.address], pool=pool) for i in range(3)
    ]
    for lock in locks:
        assert await face.run(lock.acquire())
    for lock in locks:
        await face.run(lock.release())
    assert (pool.opened, pool.discarded) == (3, 2)
    for lock in locks[:2]:  # one connection was kept: one of the two reuses it
        assert await face.run(lock.acquire())
    assert (pool.opened, pool.reused) == (4, 1)
    for lock in locks[:2]:
        await face.run(lock.release())
    await face.run(pool.aclose() if face.is_async else pool.close())
    assert await face.run(locks[0].acquire())  # none kept after the close
    assert (pool.opened, pool.reused) == (5, 1)
    await face.run(locks[0].release())
    await face.run(pool.aclose() if face.is_async else pool.close())


async def test_without_a_pool_each_lock_closes_its_connection(
    face: Face, dflock_server: ServerThread
) -> None:
    before = connection_count(dflock_server.address)
    async with face.held(face.lock_class("own-conn", servers=[dflock_server.address])):
        assert connection_count(dflock_server.address) == before + 1
    await until(lambda: connection_count(dflock_server.address) == before, what="closed")


async def test_auth(face: Face, dflock_server_factory: Callable[..., ServerThread]) -> None:
    run, lock_class = face.run, face.lock_class
    server = dflock_server_factory(auth_token="s3cret")
    servers = [server.address]
    async with face.held(face.pool_class()) as pool:
        async with face.held(
            lock_class("authed", servers=servers, auth_token="s3cret", pool=pool)
        ) as lock:
            assert lock.locked()
        async with face.held(lock_class("authed", servers=servers, auth_token="s3cret", pool=pool)):
            assert pool.reused == 1
    with pytest.raises(AuthError, match="requires authentication: give the secret") as failure:
        await run(lock_class("authed", servers=servers).acquire())
    assert "dflock_auth_token" in str(failure.value)  # the Celery setting, named too
    with pytest.raises(AuthError, match="rejected the auth token"):
        await run(lock_class("authed", servers=servers, auth_token="wrong").acquire())
    with pytest.raises(AuthError, match="rejected the auth token"):
        await run(face.semaphore_class("authed", 2, servers=servers, auth_token="no").acquire())
    with pytest.raises(AuthError, match="requires authentication"):
        await run(face.semaphore_class("authed", 2, servers=servers).acquire())


async def test_auth_against_a_server_without_secret(
    face: Face, dflock_server: ServerThread
) -> None:
    lock = face.lock_class("x", servers=[dflock_server.address], auth_token="s3cret")
    with pytest.raises(AuthError, match="no auth token configured"):
        await face.run(lock.acquire())


async def test_server_unavailable_names_the_address(make: Maker, closed_port: int) -> None:
    run = make.face.run
    lock = make("nobody-home", servers=[("127.0.0.1", closed_port)], connect_timeout_s=2)
    with pytest.raises(
        ServerUnavailable, match=rf"127\.0\.0\.1:{closed_port}.*dflockd.*servers"
    ) as info:
        await run(lock.acquire())
    message = str(info.value)
    assert f"127.0.0.1:{closed_port}" in message
    assert "dflockd" in message and "servers" in message
    assert not lock.locked()
    with pytest.raises(ServerUnavailable):
        async with make.face.held(make.face.pool_class()) as pool:
            await run(
                make("nobody-home", servers=[("127.0.0.1", closed_port)], pool=pool).acquire()
            )


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
def test_bad_options_are_refused_clearly(face: Face, kwargs: dict[str, Any], match: str) -> None:
    kwargs = dict(kwargs)  # the parameter is shared by both faces
    key = kwargs.pop("key", "k")
    with pytest.raises(ValueError, match=match):
        face.lock_class(key, **kwargs)


@pytest.mark.parametrize("limit", [0, -1, 1_048_577, True, "3"])
def test_bad_semaphore_limits(face: Face, limit: object) -> None:
    with pytest.raises(ValueError, match="limit"):
        face.semaphore_class("s", limit)


# ------------------------------------------------------------------------ renewal and loss


async def test_renewal_keeps_the_lock_past_its_lease(make: Maker) -> None:
    async with make.face.held(make("long-job", lease_ttl_s=2)) as lock:
        # held 5 s, 2.5 leases: without renewal it would have expired twice over
        assert not await make.face.wait_lost(lock, 5.0)
        assert lock.owned() and not lock.lost
        assert await make.face.run(make("long-job", 0).acquire()) is False
        assert make.holders("long-job") == (1, 0)


async def test_refused_renewal_marks_the_lock_lost(
    make: Maker, dflock_server: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="celery_dflock")
    calls: list[Lock] = []
    lock = make("taken-over", lease_ttl_s=2, on_lost=calls.append)
    assert await make.face.run(lock.acquire()) and lock.token is not None
    token = lock.token
    release_behind_its_back(dflock_server.address, "taken-over", token, make.semaphore)
    await assert_lost_reported(make.face, lock, calls, caplog, token)
    # Released, the lock may be taken again, with its loss forgotten.
    assert await make.face.run(lock.acquire()) and not lock.lost
    assert not lock.lost_event.is_set()
    assert await make.face.run(lock.release())


async def test_server_restart_marks_the_lock_lost(
    face: Face,
    dflock_server_factory: Callable[..., ServerThread],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="celery_dflock")
    server = dflock_server_factory()
    calls: list[Lock] = []
    lock = face.lock_class(
        "restarted", lease_ttl_s=2, servers=[server.address], on_lost=calls.append
    )
    assert await face.run(lock.acquire()) and lock.token is not None
    token = lock.token
    port = server.port
    server.stop()
    replacement = dflock_server_factory(port=port)
    await assert_lost_reported(face, lock, calls, caplog, token)
    async with face.held(face.lock_class("restarted", 0, servers=[replacement.address])) as again:
        assert again.locked()


@pytest.mark.parametrize("auth_token", [None, "s3cret"], ids=["plain", "auth"])
async def test_a_stall_as_the_first_keep_alive_connects_is_reported_before_the_key_is_free(
    face: Face, dflock_server_factory: Callable[..., ServerThread], auth_token: str | None
) -> None:
    """The first keep-alive of a client session opens a connection of its own a third of the
    session's time after the acquire. A stall of the server (or the network) then held that
    connect (its ``auth``, its ``hello``) for up to ``connect_timeout_s`` (5 s; ``auth`` 10 s),
    and nothing told the lock its session was over: the loss came as the stall ended, after
    the server had ended the session and a rival had taken the key. That connect now waits no
    longer than the session has left."""
    server = dflock_server_factory(auth_token=auth_token)
    calls: list[Lock] = []
    with FaultProxy(server.address) as proxy, Wire(server.address) as rival:
        if auth_token is not None:
            assert rival.req("auth", "_", auth_token) == "ok"
        lock = face.lock_class(
            "k",
            servers=[proxy.address],
            auth_token=auth_token,
            session_ttl_s=3,
            on_lost=calls.append,
        )
        assert await face.run(lock.acquire())
        proxy.stall(30.0)  # from before the first keep-alive, 1 s after the acquire
        await until(lambda: rival.req("l", "k", "0").startswith("ok "), what="the key free")
        assert lock.lost, "the loss was reported before the server let a rival take the key"
        assert calls == [lock]
        proxy.resume()
        assert await face.run(lock.release()) is False


async def test_a_stall_as_the_keep_alive_checks_a_pooled_connection_is_reported_in_time(
    dflock_server: ServerThread,
) -> None:
    """The same when the keep-alive takes an idle connection of the pool: its liveness check
    (a ``ping``; the asyncio face's on every connection, the blocking face's over TLS) waited
    10 s in a stall, the loss reported long after a rival had the key. It waits no longer
    than the session has left (nor than ``connect_timeout_s``)."""
    calls: list[Lock] = []
    with FaultProxy(dflock_server.address) as proxy, Wire(dflock_server.address) as rival:
        async with AsyncClient([proxy.address], session_ttl_s=3) as client:
            first, second = client.lock("first"), client.lock("second")
            assert await first.acquire() and await second.acquire()  # two connections
            assert await first.release() and await second.release()  # both idle
            lock = client.lock("k", on_lost=calls.append)
            assert await lock.acquire()  # on one; the keep-alive takes the other in 1 s
            proxy.stall(30.0)
            await until(lambda: rival.req("l", "k", "0").startswith("ok "), what="the key free")
            assert lock.lost, "the loss was reported before the server let a rival take the key"
            assert calls == [lock]
            proxy.resume()
            assert await lock.release() is False


async def test_a_failing_on_lost_callback_is_logged_not_raised(
    face: Face, dflock_server: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    calls: list[Lock] = []

    def explode(lock: Lock) -> None:
        calls.append(lock)
        raise RuntimeError("callback failed")

    lock = face.lock_class("cb", lease_ttl_s=1, servers=[dflock_server.address], on_lost=explode)
    assert await face.run(lock.acquire()) and lock.token is not None
    release_behind_its_back(dflock_server.address, "cb", lock.token)
    assert await face.wait_lost(lock, 5.0)
    assert await face.run(lock.release()) is False
    assert calls == [lock]
    assert "on_lost callback" in caplog.text and "callback failed" in caplog.text


async def test_explicit_renew(make: Maker) -> None:
    lock = make("manual-renew", lease_ttl_s=30)
    with pytest.raises(LockNotOwned, match="acquire"):
        await make.face.run(lock.renew())
    async with make.face.held(lock):
        assert await make.face.run(lock.renew()) is True
    with pytest.raises(LockNotOwned):
        await make.face.run(lock.renew())
