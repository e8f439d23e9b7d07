"""An acquire interrupted just after the server granted it (the grant already sent, not yet
read) while its client holds another lock there: the grant belongs to the client's session,
whose keep-alives would keep it for good with nobody knowing its token. The client reads the
reply left over and releases it, so another client gets the key at once. The interruption is
made certain to come after the grant: asyncio's loop is kept from reading the reply until the
server shows the key held, and the blocking face's signal handler raises only then."""

from __future__ import annotations

import asyncio
import signal
import ssl
import threading
from collections.abc import AsyncIterator, Callable
from types import FrameType
from typing import Any, cast

import pytest

from celery_dflock import AsyncClient, AsyncConnectionPool, Client, ConnectionPool
from celery_dflock.client._core import LockCore
from celery_dflock.client._router import KeyRoute
from celery_dflock.client._sync.held import Holding
from dflockd_server.testing import ServerThread
from tests.client.faces import ASYNCIO, BLOCKING, Face, Maker, until
from tests.support.proxy import FaultProxy
from tests.support.waiting import wait_until
from tests.support.wire import Wire

FREED_WITHIN_S = 5
"""Another client's acquire of the key must succeed within this (the session is 15 s and
kept alive by the other lock: without the fix, never)."""


class Interrupted(Exception):
    """What a signal handler raises in the blocked acquire (as Celery's soft time limit)."""


@pytest.fixture
async def apool() -> AsyncIterator[AsyncConnectionPool]:
    async with AsyncConnectionPool() as pool:
        yield pool


@pytest.fixture
def face() -> Face:
    return ASYNCIO


def _hold(make: Maker, holder: Wire) -> str:
    reply = holder.req("sl", "k", "0 1") if make.semaphore else holder.req("l", "k", "0")
    status, token, _ = reply.split()
    assert status == "ok", reply
    return token


def _release(make: Maker, holder: Wire, token: str) -> None:
    assert holder.req("sr" if make.semaphore else "r", "k", token) == "ok"


@pytest.mark.parametrize("two_phase", [False, True], ids=["acquire", "enqueue-wait"])
async def test_a_wait_cancelled_after_its_grant_leaves_no_held_key(
    make: Maker, dflock_server: ServerThread, apool: AsyncConnectionPool, two_phase: bool
) -> None:
    address = dflock_server.address
    with Wire(address) as holder:
        token = _hold(make, holder)
        other = make("other", pool=apool)
        assert await other.acquire()  # keeps the client's session alive
        waiter = make("k", pool=apool, acquire_timeout_s=30)
        if two_phase:
            assert await waiter.enqueue() == "queued"
        task = asyncio.create_task(waiter.wait() if two_phase else waiter.acquire())
        await asyncio.sleep(0)  # the task's first step: its request is sent
        await until(lambda: make.holders("k") == (1, 1), what="the waiter queued")
        _release(make, holder, token)
        # Blocking, so the loop cannot read the grant: it is sent, not yet read, when cancelled.
        wait_until(lambda: make.holders("k") == (1, 0), what="the waiter granted")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        rival = make("k", acquire_timeout_s=FREED_WITHIN_S)
        assert await rival.acquire(), "the interrupted acquire's grant is held by nobody"
        assert await rival.release()
        assert await other.release()


async def test_an_enqueue_cancelled_before_its_reply_leaves_no_held_key(
    make: Maker, dflock_server: ServerThread, apool: AsyncConnectionPool
) -> None:
    """An enqueue cancelled with its reply (``queued``) unread, its place in the queue granted
    before the connection's close reached the server: the grant is the client session's. The
    reaper read ``queued`` and closed, leaving it there, kept by the keep-alives of the
    client's other lock with nobody knowing its token; it asks ``w 0`` for it now, and
    releases it. (The proxy holds the reply back, so the cancel comes before it is read.)"""
    with Wire(dflock_server.address) as holder, FaultProxy(dflock_server.address) as proxy:
        token = _hold(make, holder)
        servers = [proxy.address]
        other = make("other", pool=apool, servers=servers)
        assert await other.acquire()  # keeps the client's session alive
        waiter = make("k", pool=apool, servers=servers)
        sent = proxy.hold_reply_after(b"e\nk\n")
        task = asyncio.create_task(waiter.enqueue())
        await until(sent.is_set, what="the enqueue sent")
        await until(lambda: make.holders("k") == (1, 1), what="the waiter queued")
        _release(make, holder, token)
        await until(lambda: make.holders("k") == (1, 0), what="the waiter granted")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        proxy.release_replies()
        rival = make("k", acquire_timeout_s=FREED_WITHIN_S)
        assert await rival.acquire(), "the cancelled enqueue's grant is held by nobody"
        assert await rival.release()
        assert await other.release()


@pytest.mark.parametrize("face", [BLOCKING], ids=["blocking"])
def test_a_wait_interrupted_by_a_signal_after_its_grant_leaves_no_held_key(
    make: Maker, dflock_server: ServerThread, pool: ConnectionPool
) -> None:
    address = dflock_server.address
    entered, granted = threading.Event(), threading.Event()

    def handler(signum: int, frame: FrameType | None) -> None:
        del signum, frame
        entered.set()
        assert granted.wait(10)
        raise Interrupted

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        with Wire(address) as holder:
            token = _hold(make, holder)
            other = make("other", pool=pool)
            assert other.acquire()  # keeps the client's session alive
            waiter = make("k", pool=pool, acquire_timeout_s=30)

            def interrupt() -> None:
                wait_until(lambda: make.holders("k") == (1, 1), what="the waiter queued")
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGUSR1)
                assert entered.wait(10)  # the handler holds the waiter until it is granted
                _release(make, holder, token)
                wait_until(lambda: make.holders("k") == (1, 0), what="the waiter granted")
                granted.set()

            thread = threading.Thread(target=interrupt)
            thread.start()
            with pytest.raises(Interrupted):
                waiter.acquire()
            thread.join(10)
            rival = make("k", acquire_timeout_s=FREED_WITHIN_S)
            assert rival.acquire(), "the interrupted acquire's grant is held by nobody"
            assert rival.release()
            assert other.release()
    finally:
        signal.signal(signal.SIGUSR1, previous)


def tls_counts(client: Client) -> tuple[int, int]:
    """Holders and waiters of ``k``, as the server's ``stats`` shows them (over TLS)."""
    (status,) = client.stats()
    for entry in (status.stats or {}).get("locks", []):
        if entry["key"] == "k":
            return 1, int(entry["waiters"])
    return 0, 0


def test_over_tls_a_wait_interrupted_after_its_grant_leaves_no_held_key(
    dflock_server_factory: Callable[..., ServerThread], tls_files: tuple[str, str]
) -> None:
    """The same over TLS, whose close cannot be half: the grant was left to the session."""
    cert, key = tls_files
    server = dflock_server_factory(tls_cert=cert, tls_key=key)
    context = ssl.create_default_context(cafile=cert)
    entered, granted = threading.Event(), threading.Event()

    def handler(signum: int, frame: FrameType | None) -> None:
        del signum, frame
        entered.set()
        assert granted.wait(10)
        raise Interrupted

    previous = signal.signal(signal.SIGUSR1, handler)
    with (
        Client([server.address], ssl_context=context) as rivals,
        Client([server.address], ssl_context=context) as waiting,
    ):
        try:
            holder = rivals.lock("k", acquire_timeout_s=0)
            assert holder.acquire()
            other = waiting.lock("other")
            assert other.acquire()  # keeps the client's session alive
            waiter = waiting.lock("k", acquire_timeout_s=30)

            def interrupt() -> None:
                wait_until(lambda: tls_counts(rivals) == (1, 1), what="the waiter queued")
                signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGUSR1)
                assert entered.wait(10)  # the handler holds the waiter until it is granted
                assert holder.release()
                wait_until(lambda: tls_counts(rivals) == (1, 0), what="the waiter granted")
                granted.set()

            thread = threading.Thread(target=interrupt)
            thread.start()
            with pytest.raises(Interrupted):
                waiter.acquire()
            thread.join(10)
            rival = rivals.lock("k", acquire_timeout_s=FREED_WITHIN_S)
            assert rival.acquire(), "the interrupted acquire's grant is held by nobody"
            assert rival.release()
            assert other.release()
        finally:
            signal.signal(signal.SIGUSR1, previous)


async def test_over_tls_a_wait_cancelled_after_its_grant_leaves_no_held_key(
    dflock_server_factory: Callable[..., ServerThread], tls_files: tuple[str, str]
) -> None:
    """The asyncio face over TLS: the cancelled wait's grant is read and released."""
    cert, key = tls_files
    server = dflock_server_factory(tls_cert=cert, tls_key=key)
    context = ssl.create_default_context(cafile=cert)
    with Client([server.address], ssl_context=context) as rivals:
        async with AsyncClient([server.address], ssl_context=context) as waiting:
            holder = rivals.lock("k", acquire_timeout_s=0)
            assert holder.acquire()
            other = waiting.lock("other")
            assert await other.acquire()  # keeps the client's session alive
            waiter = waiting.lock("k", acquire_timeout_s=30)
            task = asyncio.create_task(waiter.acquire())
            await until(lambda: tls_counts(rivals) == (1, 1), what="the waiter queued")
            # Blocking, so the loop cannot read the grant: it is sent, not yet read, when
            # cancelled.
            assert holder.release()
            wait_until(lambda: tls_counts(rivals) == (1, 0), what="the waiter granted")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            rival = waiting.lock("k", acquire_timeout_s=FREED_WITHIN_S)  # the loop runs on
            assert await rival.acquire(), "the interrupted acquire's grant is held by nobody"
            assert await rival.release()
            assert await other.release()


@pytest.mark.parametrize("two_phase", [False, True], ids=["acquire", "enqueue-wait"])
@pytest.mark.parametrize("after", ["on_grant_reply", "start_renewing"])
def test_an_acquire_interrupted_once_it_read_its_grant_leaves_no_held_key(
    dflock_server: ServerThread, monkeypatch: pytest.MonkeyPatch, two_phase: bool, after: str
) -> None:
    """The interruption (a signal's exception: Ctrl-C, a soft time limit) comes after the
    reply was read: the lock was held, with nobody to release it (a ``with`` block's
    ``__exit__`` is not called when ``__enter__`` raises), renewed by its own renewal or its
    session's keep-alives for as long as the process lived. It is released in the
    background, as an interrupted release's grant is."""
    owner = LockCore if after == "on_grant_reply" else Holding
    original = getattr(owner, after)
    armed: list[bool] = []

    def interrupted_after(self: object, *args: object, **kwargs: object) -> object:
        result = original(self, *args, **kwargs)
        core = self if isinstance(self, LockCore) else cast(Holding, self).core
        if core.key == "k" and armed:
            armed.clear()
            raise Interrupted
        return result

    monkeypatch.setattr(owner, after, interrupted_after)
    with Client([dflock_server.address]) as client:
        other = client.lock("other")
        assert other.acquire()  # keeps the client's session alive
        lock = client.lock("k", acquire_timeout_s=30)
        if two_phase:
            with Wire(dflock_server.address) as holder:
                status, token, _ = holder.req("l", "k", "0").split()
                assert status == "ok"
                assert lock.enqueue() == "queued"
                assert holder.req("r", "k", token) == "ok"
                armed.append(True)
                with pytest.raises(Interrupted):
                    lock.wait()
        else:
            armed.append(True)
            with pytest.raises(Interrupted), lock:
                pytest.fail("the body ran")
        assert not armed, "not interrupted"
        assert not lock.locked()
        with Client([dflock_server.address], acquire_timeout_s=FREED_WITHIN_S) as rival:
            taken = rival.lock("k")
            assert taken.acquire(), "the interrupted acquire's grant is held by nobody"
            assert taken.release()
        assert other.release()


@pytest.mark.parametrize("after", ["on_grant_reply", "end_acquire"])
def test_an_enqueue_interrupted_once_it_read_queued_leaves_no_place_and_no_held_key(
    dflock_server: ServerThread, monkeypatch: pytest.MonkeyPatch, after: str
) -> None:
    """A signal's exception (Ctrl-C, a soft time limit) after the server answered ``queued``:
    ``enqueue`` raises, so its caller never learns of the place and calls neither ``wait`` nor
    ``release``. The place, granted in its turn, was the client session's grant, kept by the
    keep-alives of the client's other lock with nobody knowing its token. The interrupted
    enqueue leaves the queue (a grant that came meanwhile is released)."""
    owner = LockCore if after == "on_grant_reply" else KeyRoute
    original = getattr(owner, after)
    armed: list[bool] = []

    def interrupted_after(self: object, *args: object, **kwargs: object) -> object:
        result = original(self, *args, **kwargs)
        if armed:
            armed.clear()
            raise Interrupted
        return result

    monkeypatch.setattr(owner, after, interrupted_after)
    with Client([dflock_server.address]) as client, Wire(dflock_server.address) as holder:
        other = client.lock("other")
        assert other.acquire()  # keeps the client's session alive
        status, token, _ = holder.req("l", "k", "0").split()
        assert status == "ok"
        lock = client.lock("k")
        armed.append(True)
        with pytest.raises(Interrupted):
            lock.enqueue()
        assert not armed, "not interrupted"
        assert not lock.locked()
        assert holder.req("r", "k", token) == "ok"  # the key passes to the place, if any
        with Client([dflock_server.address], acquire_timeout_s=FREED_WITHIN_S) as rival:
            taken = rival.lock("k")
            assert taken.acquire(), "the interrupted enqueue's place holds the key"
            assert taken.release()
        assert other.release()


async def test_an_enqueue_cancelled_once_it_read_queued_leaves_no_place_and_no_held_key(
    dflock_server: ServerThread, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The asyncio face of the above: the cancellation comes once ``queued`` was read."""
    original = LockCore.on_grant_reply
    armed: list[bool] = []

    def cancelled_after(self: LockCore, *args: Any, **kwargs: Any) -> bool:
        result = original(self, *args, **kwargs)
        if armed:
            armed.clear()
            raise asyncio.CancelledError
        return result

    monkeypatch.setattr(LockCore, "on_grant_reply", cancelled_after)
    async with AsyncClient([dflock_server.address]) as client:
        with Wire(dflock_server.address) as holder:
            other = client.lock("other")
            assert await other.acquire()  # keeps the client's session alive
            status, token, _ = holder.req("l", "k", "0").split()
            assert status == "ok"
            lock = client.lock("k")
            armed.append(True)
            with pytest.raises(asyncio.CancelledError):
                await lock.enqueue()
            assert not armed, "not cancelled"
            assert holder.req("r", "k", token) == "ok"  # the key passes to the place, if any
        async with AsyncClient(
            [dflock_server.address], acquire_timeout_s=FREED_WITHIN_S
        ) as rival_client:
            taken = rival_client.lock("k")
            assert await taken.acquire(), "the cancelled enqueue's place holds the key"
            assert await taken.release()
        assert await other.release()
