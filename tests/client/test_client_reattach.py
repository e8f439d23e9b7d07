"""Holders reattach (issue 26): a held lock whose connection closes is not lost for that; it
reconnects to its server and renews by token there while its lease runs, and is lost only when
that renewal is refused or the lease runs out first. `release()` on a broken connection
reconnects and releases by token; when the server is not there, it returns at once and the
release goes on in the background while the lease runs (issue 49).

Each body runs on both faces (``face``: the blocking lock's calls run in a thread), lock and
semaphore. A server that keeps a lock across a connection loss is, until the journal, one
without auto-release on disconnect; `FaultProxy` cuts the connection on the way.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from celery_dflock import AsyncClient, AsyncDistributedLock, Client, DistributedLock
from celery_dflock.client._core import LockCore
from celery_dflock.client._grant import (
    CLOSED_BY_SERVER,
    REATTACH_FIRST_PAUSE_S,
    REATTACH_MAX_PAUSE_S,
    LockState,
)
from celery_dflock.client._replies import ErrorReply, Granted, Ok, Renewed
from celery_dflock.client._settings import ClientSettings
from celery_dflock.client.errors import InvalidValueError
from dflockd_server import constants
from dflockd_server.testing import ServerThread
from tests.support.proxy import FaultProxy
from tests.support.servers import dflockd_subprocess
from tests.support.waiting import wait_until

ServerFactory = Callable[..., ServerThread]

LONG_LEASE_S = 60
"""Renewed every 30 s: whatever a test sees within its waits was not a scheduled renewal."""
SHORT_LEASE_S = 3
RENEWED_LEASE_S = 2
"""Renewed every second."""
TOLD_WITHIN_S = 10.0
RELEASE_LEASE_S = 8
"""Long enough that a release that waited for it is told from one that did not."""
TOKEN = "0123456789abcdef" * 2

faces = pytest.mark.parametrize("face", ["blocking", "asyncio"])
kinds = pytest.mark.parametrize("kind", ["lock", "semaphore"])


class Holder:
    """One lock or semaphore of either face, driven from a coroutine (one test body for both:
    the blocking face's calls run in a worker thread)."""

    def __init__(self, lock: Any, blocking: bool, lost: list[str]) -> None:
        self.lock = lock
        self.blocking = blocking
        self.lost_calls = lost
        """``on_lost`` calls (the key, once per call)."""

    async def _call(self, name: str, *args: object) -> Any:
        method = getattr(self.lock, name)
        if self.blocking:
            return await asyncio.to_thread(method, *args)
        return await method(*args)

    async def acquire(self) -> bool:
        return await self._call("acquire")

    async def renew(self) -> bool:
        return await self._call("renew")

    async def release(self) -> bool:
        return await self._call("release")

    async def adopt(self, token: str, note: str, on_close_lease: int) -> bool:
        method = self.lock.adopt
        if self.blocking:
            return await asyncio.to_thread(
                lambda: method(token, note=note, on_close_lease=on_close_lease)
            )
        return await method(token, note=note, on_close_lease=on_close_lease)

    async def hand_off(self, lease_ttl: int) -> bool:
        return await self._call("hand_off", lease_ttl)

    async def lost_within(self, seconds: float) -> bool:
        """True once the loss is reported within ``seconds``: `lost_event` set, and the
        ``on_lost`` call that follows it made (the blocking face sets the event, then calls
        back, on its renewal thread: the call may still be under way when the event is
        seen)."""
        event = self.lock.lost_event
        if self.blocking:
            if not await asyncio.to_thread(event.wait, seconds):
                return False
            await asyncio.to_thread(
                wait_until, lambda: self.lost_calls, timeout=seconds, what="on_lost called"
            )
            return True
        try:
            async with asyncio.timeout(seconds):
                await event.wait()
        except TimeoutError:
            return False
        return True

    @property
    def lost(self) -> bool:
        return self.lock.lost

    @property
    def token(self) -> str | None:
        return self.lock.token


@asynccontextmanager
async def holder(
    face: str,
    kind: str,
    address: tuple[str, int],
    *,
    lease_ttl_s: int = LONG_LEASE_S,
    context: ssl.SSLContext | None = None,
    key: str = "held",
    limit: int = 2,
    auth_token: str | None = None,
) -> AsyncIterator[Holder]:
    """A lock (``kind``) of ``face`` on ``address``, made by a `Client` / `AsyncClient` (so
    through its pool); its ``on_lost`` calls are counted."""
    lost: list[str] = []

    def on_lost(lock: Any) -> None:
        lost.append(lock.key)

    def make(client: Any) -> Any:
        if kind == "lock":
            return client.lock(key, lease_ttl_s=lease_ttl_s, on_lost=on_lost)
        return client.semaphore(key, limit, lease_ttl_s=lease_ttl_s, on_lost=on_lost)

    if face == "blocking":
        client = Client(servers=[address], ssl_context=context, auth_token=auth_token)
        try:
            yield Holder(make(client), True, lost)
        finally:
            await asyncio.to_thread(client.close)
    else:
        async with AsyncClient(
            servers=[address], ssl_context=context, auth_token=auth_token
        ) as aclient:
            yield Holder(make(aclient), False, lost)


def holders(server: ServerThread, key: str = "held") -> int:
    """Holders of ``key`` on ``server`` now (lock or semaphore)."""
    stats = server.stats()
    locks = [entry for entry in stats["locks"] if entry["key"] == key]
    sems = [entry for entry in stats["semaphores"] if entry["key"] == key]
    return len(locks) + sum(int(entry["holders"]) for entry in sems)


async def eventually(
    predicate: Callable[[], object], *, what: str, timeout: float = TOLD_WITHIN_S
) -> None:
    """`wait_until` without blocking the event loop (the asyncio face works on it)."""
    await asyncio.to_thread(wait_until, predicate, what=what, timeout=timeout)


@pytest.fixture
def keeping_server(dflock_server_factory: ServerFactory) -> ServerThread:
    """A server that keeps a lock when its connection closes (the lease alone frees it)."""
    return dflock_server_factory(auto_release_on_disconnect=False)


@pytest.fixture
def proxy(keeping_server: ServerThread) -> Iterator[FaultProxy]:
    with FaultProxy(keeping_server.address) as fault_proxy:
        yield fault_proxy


# ---------------------------------------------------------------------- kept: reattached


@faces
@kinds
@pytest.mark.parametrize("transport", ["plain", "tls"])
async def test_a_cut_connection_reattaches_and_the_lock_stays_held(
    dflock_server_factory: ServerFactory,
    tls_files: tuple[str, str],
    face: str,
    kind: str,
    transport: str,
) -> None:
    cert, key = tls_files
    tls = {"tls_cert": cert, "tls_key": key} if transport == "tls" else {}
    context = ssl.create_default_context(cafile=cert) if transport == "tls" else None
    server = dflock_server_factory(auto_release_on_disconnect=False, **tls)
    with FaultProxy(server.address) as cut:
        async with holder(face, kind, cut.address, context=context) as lock:
            assert await lock.acquire()
            token = lock.token
            assert cut.accepted == 1

            cut.reset()  # RST both ways: the server keeps the grant, unbound
            # Noticed at once (no renewal is due for 30 s): a new connection, renewed by token.
            await eventually(lambda: cut.connections == 1 and cut.accepted == 2, what="reattached")
            assert await lock.renew()  # on the new, pinned connection: no third one
            assert cut.accepted == 2
            assert not lock.lost and lock.token == token and lock.lock.owned()

            cut.drop()  # FIN both ways, this time: reattached again
            await eventually(lambda: cut.connections == 1 and cut.accepted == 3, what="reattached")
            assert await lock.renew()
            assert holders(server) == 1
            assert await lock.release() is True
            assert holders(server) == 0
            assert not lock.lost and lock.lost_calls == []


@faces
@pytest.mark.parametrize(
    ("cut", "seen"), [("drop", "EOF from the peer"), ("reset", "a socket error (")]
)
async def test_a_held_connection_found_cut_is_logged_with_what_its_check_saw(
    keeping_server: ServerThread,
    proxy: FaultProxy,
    face: str,
    cut: str,
    seen: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A held connection found unusable while idle is dropped saying what the check saw (an EOF,
    # an error, bytes nobody asked for, a close of this client's): a lost lock's reason tells
    # them apart.
    caplog.set_level(logging.INFO, logger="celery_dflock.client")
    async with holder(face, "lock", proxy.address) as lock:
        assert await lock.acquire()
        getattr(proxy, cut)()
        await eventually(lambda: "reattaching by token" in caplog.text, what="reattaching")
        assert f"{CLOSED_BY_SERVER}; seen: {seen}" in caplog.text
        await eventually(lambda: proxy.accepted == 2 and proxy.connections == 1, what="reattached")
        assert await lock.release() is True
        assert lock.lost_calls == []


@faces
@kinds
async def test_renewals_continue_on_the_reattached_connection(
    keeping_server: ServerThread, proxy: FaultProxy, face: str, kind: str
) -> None:
    async with holder(face, kind, proxy.address, lease_ttl_s=RENEWED_LEASE_S) as lock:
        assert await lock.acquire()
        proxy.reset()
        await eventually(lambda: proxy.accepted == 2 and proxy.connections == 1, what="reattached")
        # The background renewal goes on there: held through two leases, no new connection.
        assert not await lock.lost_within(2 * RENEWED_LEASE_S)
        assert proxy.accepted == 2 and holders(keeping_server) == 1
        assert await lock.release() is True
        assert lock.lost_calls == []


@faces
async def test_release_of_a_cut_lock_reconnects_and_releases_by_token(
    keeping_server: ServerThread, proxy: FaultProxy, face: str
) -> None:
    async with holder(face, "lock", proxy.address) as lock:
        assert await lock.acquire()
        proxy.stall(TOLD_WITHIN_S)  # a new connection gets no answer until resumed
        proxy.reset()
        releasing = asyncio.ensure_future(lock.release())
        await asyncio.sleep(0)
        proxy.resume()
        assert await releasing is True
        assert holders(keeping_server) == 0
        assert lock.lost_calls == []


@faces
async def test_an_adopted_hold_reattaches(dflock_server: ServerThread, face: str) -> None:
    """A hold taken over with ``ht`` and an ``<onclose>`` lease: the server detaches it when
    the connection closes (auto-release on), and the holder renews it by token from a new
    connection."""
    with Client(servers=[dflock_server.address]) as owner:
        hold = owner.hold("adopted", note="publisher", lease_ttl=LONG_LEASE_S)
    with FaultProxy(dflock_server.address) as cut:
        lost: list[str] = []
        lock: Any
        if face == "blocking":
            lock = DistributedLock("adopted", servers=[cut.address], lease_ttl_s=LONG_LEASE_S)
        else:
            lock = AsyncDistributedLock("adopted", servers=[cut.address], lease_ttl_s=LONG_LEASE_S)
        adopted = Holder(lock, face == "blocking", lost)
        assert await adopted.adopt(hold.token, "worker", LONG_LEASE_S)
        cut.reset()
        await eventually(lambda: cut.accepted == 2 and cut.connections == 1, what="reattached")
        assert await adopted.renew()
        assert not adopted.lost
        assert await adopted.release() is True
        assert holders(dflock_server, "adopted") == 0


# ---------------------------------------------------------------------- refused: lost


@faces
@kinds
async def test_a_reset_session_connection_reattaches_within_the_session_time(
    dflock_server: ServerThread, face: str, kind: str
) -> None:
    """A session connection reset on the way: the server keeps the grant for its session time,
    and the holder renews it by token on a new connection meanwhile (issue 47)."""
    with FaultProxy(dflock_server.address) as cut:
        async with holder(face, kind, cut.address) as lock:
            assert await lock.acquire()
            cut.reset()
            await asyncio.sleep(constants.DEFAULT_SESSION_TTL_S + 1.0)
            assert not lock.lost and lock.lost_calls == []
            assert await lock.renew()
            assert await lock.release() is True


@faces
@kinds
async def test_a_server_that_released_the_lock_with_its_connection_reports_it_lost(
    dflock_server_factory: ServerFactory, face: str, kind: str
) -> None:
    """Auto-release on disconnect, no restart, a server without sessions (so the connection
    is a plain one): the renewal by token is refused."""
    server = dflock_server_factory(session_ttl_s=0)
    with FaultProxy(server.address) as cut:
        async with holder(face, kind, cut.address) as lock:
            assert await lock.acquire()
            cut.reset()
            assert await lock.lost_within(TOLD_WITHIN_S)
            assert lock.lost and lock.lost_calls == ["held"]
            assert await lock.release() is False


@faces
async def test_a_lock_released_elsewhere_by_token_is_lost_after_a_cut(
    keeping_server: ServerThread, proxy: FaultProxy, face: str
) -> None:
    async with holder(face, "lock", proxy.address) as lock:
        assert await lock.acquire()
        token = lock.token
        assert token is not None
        with Client(servers=[keeping_server.address]) as other:
            assert other.release("held", token)
        proxy.reset()
        assert await lock.lost_within(TOLD_WITHIN_S)
        assert lock.lost_calls == ["held"]
        assert await lock.release() is False


@faces
async def test_a_server_restarted_without_the_lock_reports_it_lost(
    dflock_server_factory: ServerFactory, face: str
) -> None:
    server = dflock_server_factory()
    async with holder(face, "semaphore", server.address) as lock:
        assert await lock.acquire()
        server.stop()
        dflock_server_factory(port=server.port)  # knows nothing of the grant
        assert await lock.lost_within(TOLD_WITHIN_S)
        assert lock.lost_calls == ["held"]
        assert await lock.release() is False


@faces
async def test_a_refused_auth_on_reconnect_reports_the_lock_lost_at_once(
    dflock_server_factory: ServerFactory,
    face: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The server came back (with the lease, restored from its journal) but refuses this
    client's secret: no later attempt does better, so the lock is lost now, not when its
    lease runs out."""
    caplog.set_level(logging.WARNING, logger="celery_dflock.client")
    state = str(tmp_path / "state")
    server = dflock_server_factory(auth_token="first-secret", state_dir=state)
    async with holder(face, "lock", server.address, auth_token="first-secret") as lock:
        assert await lock.acquire()
        server.stop()
        dflock_server_factory(port=server.port, auth_token="another-secret", state_dir=state)
        assert await lock.lost_within(TOLD_WITHIN_S)  # the lease is LONG_LEASE_S
        assert lock.lost_calls == ["held"]
        assert "refused this client's auth when it reconnected" in caplog.text


@faces
async def test_a_hand_off_while_reconnecting_refuses_a_lease_too_long_before_letting_go(
    dflock_server_factory: ServerFactory, face: str, tmp_path: Path
) -> None:
    """A hand-off asking more than the server's ``--max-lease-ttl`` while the lock has no
    connection (its server restarting) is refused at once and the lock kept, as with a
    connection: the limit is the one the server's ``hello`` told. Before, the check was
    skipped then: the lock let go and waited for the server, which refused the lease, so a
    queue-once retry's hold, handed on next with a lease the server allows, was gone."""
    state = str(tmp_path / "state")
    server = dflock_server_factory(max_lease_ttl_s=60, state_dir=state)
    async with holder(face, "lock", server.address, lease_ttl_s=RELEASE_LEASE_S) as lock:
        assert await lock.acquire()
        token = lock.token
        server.stop()
        held = lock.lock._holding  # pyright: ignore[reportPrivateUsage]
        await eventually(lambda: held.conn is None, what="the lock's connection dropped")
        with pytest.raises(InvalidValueError, match=r"above the longest lease .*\(60 s"):
            await lock.hand_off(61)
        assert lock.lock.locked()
        back = dflock_server_factory(port=server.port, max_lease_ttl_s=60, state_dir=state)
        assert await lock.hand_off(60)
        (entry,) = [e for e in back.stats()["locks"] if e["key"] == "held"]
        assert entry["detached"] is True
        assert await lock.adopt(token or "", "run/2", 30)  # the same grant, handed on
        assert await lock.release()


# ---------------------------------------------------------------------- unreachable


@faces
async def test_the_lock_is_lost_when_the_lease_runs_out_before_the_server_is_back(
    dflock_server_factory: ServerFactory, face: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="celery_dflock.client")
    server = dflock_server_factory(auto_release_on_disconnect=False)
    async with holder(face, "lock", server.address, lease_ttl_s=SHORT_LEASE_S) as lock:
        assert await lock.acquire()
        server.stop()  # and nothing comes back on its port
        await eventually(lambda: "reattaching by token" in caplog.text, what="reattaching")
        assert not lock.lost  # not at the close: while the lease runs, it tries again
        assert await lock.lost_within(SHORT_LEASE_S + TOLD_WITHIN_S)
        assert lock.lost_calls == ["held"]
        assert "could not be reached again before the lease ran out" in caplog.text
        assert await lock.release() is False


@faces
async def test_release_returns_at_once_and_gives_up_in_the_background_when_the_lease_runs_out(
    dflock_server_factory: ServerFactory, face: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The server goes away and does not come back: `release` returns at once (issue 49: a
    caller never waits out an outage to let go; before, it returned only once the lease had
    run out), the lock object is free, and the background release gives up, logged, when
    the lease has run out."""
    caplog.set_level(logging.INFO, logger="celery_dflock.client")
    server = dflock_server_factory(auto_release_on_disconnect=False)
    async with holder(face, "lock", server.address, lease_ttl_s=RELEASE_LEASE_S) as lock:
        assert await lock.acquire()
        server.stop()
        assert await lock.release() is False
        gave_up = "could not be reached before the lease ran out"
        assert gave_up not in caplog.text  # returned before the lease ran out
        assert "releasing in the background" in caplog.text
        assert not lock.lock.locked() and lock.lost_calls == []
        await eventually(
            lambda: gave_up in caplog.text,
            what="the background gave up",
            timeout=RELEASE_LEASE_S + TOLD_WITHIN_S,
        )


# ---------------------------------------------------------------------- the core's decisions


def make_core(limit: int | None = None) -> LockCore:
    settings = ClientSettings.checked([("127.0.0.1", 1)])
    return LockCore("k", settings, limit=limit, acquire_timeout_s=0, lease_ttl_s=10)


def held_core(sent_at: float = 100.0, lease: int = 10) -> LockCore:
    core = make_core()
    command = core.acquire_request()[0]
    assert core.on_grant_reply(command, Granted(TOKEN, lease), sent_at, None)
    return core


def test_the_core_pauses_between_attempts_doubling_within_the_lease() -> None:
    core = held_core(sent_at=100.0, lease=10)  # surely held until 110
    core.connection_broke(CLOSED_BY_SERVER)
    pauses = [core.grant.reattach_pause("refused", now=101.0) for _ in range(8)]
    assert pauses[0] == REATTACH_FIRST_PAUSE_S
    assert pauses[1] == 2 * REATTACH_FIRST_PAUSE_S
    assert max(p or 0 for p in pauses) == REATTACH_MAX_PAUSE_S
    assert core.grant.reattach_pause("refused", now=109.75) == pytest.approx(0.25)  # never past it
    assert core.grant.reattach_pause("refused", now=110.0) is None  # the lease ran out
    assert not core.lost  # the caller marks it, and notifies
    assert core.mark_unreachable() and core.lost
    assert not core.mark_unreachable()  # once


def test_the_core_counts_the_lease_from_when_the_last_renewal_was_sent() -> None:
    core = held_core(sent_at=100.0, lease=10)
    assert core.on_renew_reply(Renewed(10), sent_at=105.0).renewed
    assert core.grant.lease_left(now=114.0) == pytest.approx(1.0)
    assert core.grant.reattach_pause("x", now=115.0) is None


def test_the_core_cuts_the_connect_timeout_to_the_lease_left() -> None:
    core = held_core(sent_at=100.0, lease=10)
    assert core.reattach_endpoint(now=101.0).connect_timeout_s == 5.0
    assert core.reattach_endpoint(now=108.0).connect_timeout_s == pytest.approx(2.0)
    assert core.reattach_endpoint(now=108.0) == core.endpoint  # the same pool key


def test_the_core_reattaches_on_draining_and_is_lost_on_a_refusal() -> None:
    core = held_core()
    draining = core.on_renew_reply(ErrorReply(constants.STATUS_ERROR_DRAINING), 101.0)
    assert draining.reattach and not draining.renewed
    core.connection_broke(CLOSED_BY_SERVER)
    refused = core.on_renew_reply(ErrorReply(constants.STATUS_ERROR), 101.0)
    assert not refused.reattach and not refused.renewed
    assert refused.lost_reason is not None and "by token on a new connection" in refused.lost_reason
    renewed = held_core()
    renewed.connection_broke(CLOSED_BY_SERVER)
    renewed.grant.reattach_pause("refused", now=101.0)
    assert renewed.on_renew_reply(Renewed(10), 102.0).renewed
    assert renewed.grant.broken is None and renewed.grant.reattach_failures == 0


def test_a_release_sent_again_is_no_proof_of_a_loss() -> None:
    core = held_core()
    assert core.on_release_reply(ErrorReply(constants.STATUS_ERROR), retried=True) is False
    assert not core.lost and core.state is LockState.IDLE
    first = held_core()
    assert first.on_release_reply(ErrorReply(constants.STATUS_ERROR)) is False
    assert first.lost and first.state is LockState.HELD  # refused at once: lost
    assert held_core().on_release_reply(Ok(), retried=True) is True
    assert LockCore.draining(ErrorReply(constants.STATUS_ERROR_DRAINING))
    assert not LockCore.draining(ErrorReply(constants.STATUS_ERROR))


# ---------------------------------------------------------------------- a durable server


@pytest.mark.parametrize("face", ["blocking", "asyncio"])
async def test_a_release_while_the_server_is_down_past_the_session_time_is_confirmed_once_back(
    tmp_path: Path, face: str
) -> None:
    """A release sent while a durable server (``--state-dir``) is down, longer than the
    session time (3 s by default), still goes on in the background and frees the key once the
    server is back: a refused connection means the server is not running, so only the lease
    can end the grant (the restart restores it), not the session's deadline. (Before: the
    background release took the session's deadline for the lease's, gave up 2.25 s after the
    last answer, and the restored grant held the key for the rest of its 60 s lease; a loaded
    CI run restarted the server that late.)"""
    args = ["--state-dir", str(tmp_path / "state")]
    log = tmp_path / "dflockd.log"
    async with AsyncExitStack() as stack:
        with dflockd_subprocess(log, *args) as (proc, address):
            lock = await stack.enter_async_context(holder(face, "lock", address, key="down"))
            assert await lock.acquire()
            proc.kill()
            proc.wait()
        assert await lock.release() is False  # at once; the release goes on in the background
        await asyncio.sleep(4.0)  # past the session's 3 s
        with dflockd_subprocess(log, *args, port=address[1]):

            def free() -> bool:
                with Client(servers=[address]) as other:
                    probe = other.lock("down", acquire_timeout_s=0)
                    if not probe.acquire():
                        return False
                    assert probe.release()
                    return True

            await eventually(free, what="the background release, once the server is back")
        assert lock.lost_calls == []


@kinds
@pytest.mark.parametrize("transport", ["plain", "tls"])
async def test_holders_keep_their_locks_across_a_killed_and_restarted_server(
    tmp_path: Path, tls_files: tuple[str, str], kind: str, transport: str
) -> None:
    """SIGKILL of a real ``dflockd`` with a state directory, started again on the same port
    and directory: it restores the leases from its journal, each holder (both faces) renews
    by token on a new connection and keeps its lock, and a `release` called while the server
    was down returns at once and is confirmed in the background once the server is back."""
    cert, key = tls_files
    args = ["--state-dir", str(tmp_path / "state")]
    if transport == "tls":
        args += ["--tls-cert", cert, "--tls-key", key]
    context = ssl.create_default_context(cafile=cert) if transport == "tls" else None
    log = tmp_path / "dflockd.log"
    # A semaphore's four holders share one key of limit 4; a lock's have a key each.
    keys = ["sem"] * 4 if kind == "semaphore" else ["kept-b", "kept-a", "freed-b", "freed-a"]

    def free(address: tuple[str, int], key: str) -> int:
        """Slots of ``key`` another client can take now (a lock has one)."""
        with Client(servers=[address], ssl_context=context) as other:
            probes: list[Any] = []
            for _ in range(4 if kind == "semaphore" else 1):
                if kind == "semaphore":
                    probe: Any = other.semaphore(key, 4, acquire_timeout_s=0)
                else:
                    probe = other.lock(key, acquire_timeout_s=0)
                if not probe.acquire():
                    break
                probes.append(probe)
            for probe in probes:
                assert probe.release()
            return len(probes)

    async with AsyncExitStack() as stack:
        with dflockd_subprocess(log, *args) as (proc, address):
            locks = [
                await stack.enter_async_context(
                    holder(face, kind, address, context=context, key=key, limit=4)
                )
                for face, key in zip(["blocking", "asyncio"] * 2, keys, strict=True)
            ]
            for lock in locks:
                assert await lock.acquire()
            tokens = [lock.token for lock in locks]
            proc.kill()
            proc.wait()
        kept, freed = locks[:2], locks[2:]
        # Released while the server is down: each returns at once (issue 49), and its
        # release goes on in the background, confirmed once the server is back.
        assert [await lock.release() for lock in freed] == [False, False]
        with dflockd_subprocess(log, *args, port=address[1]):
            if kind == "semaphore":
                await eventually(
                    lambda: free(address, keys[0]) == 2, what="the background releases"
                )
            else:
                for key in keys[2:]:
                    await eventually(
                        lambda key=key: free(address, key) == 1, what="the background release"
                    )
            for lock, token in zip(kept, tokens[:2], strict=True):
                assert await lock.renew()
                assert lock.token == token and not lock.lost
            # Held: a lock's key has no free slot, the semaphore two (the kept holders' are not).
            for key in keys[:2]:
                assert await asyncio.to_thread(free, address, key) == (
                    2 if kind == "semaphore" else 0
                )
            for lock in kept:
                assert await lock.release() is True
            for key in keys:
                assert await asyncio.to_thread(free, address, key) == (
                    4 if kind == "semaphore" else 1
                )
        assert all(lock.lost_calls == [] for lock in locks)
