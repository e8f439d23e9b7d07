"""An acquire whose reply is lost (its connection reset after the server granted the key, or
the process interrupted just as it read the reply): the grant belongs to the client's session,
and nobody knows its token. The client stops using that session for new connections, so the
locks it takes later do not keep that grant alive: the session ends once the locks held on it
then are let go, and the key with it. (Before, every later lock joined the same session and
its keep-alives kept the key held for as long as the process held any lock.)"""

from __future__ import annotations

import threading

import pytest

from celery_dflock import Client, DistributedLock, DistributedSemaphore, ServerUnavailable
from celery_dflock.client._replies import Granted, Reply, ReplyParser
from celery_dflock.client._requests import Command
from celery_dflock.client._router import KeyRoute
from dflockd_server.testing import ServerThread
from tests.support.proxy import FaultProxy
from tests.support.waiting import wait_until
from tests.support.wire import holders_and_waiters

SESSION_S = 2
"""The client's session time: the orphaned grant ends this long after its session's last
keep-alive."""
FREED_WITHIN_S = 5 * SESSION_S
"""A rival's acquire of the key must succeed within this (without the fix: never, while the
client holds another lock)."""


class Interrupted(Exception):
    """What a signal handler raises in the blocked acquire (as Celery's soft time limit)."""


@pytest.mark.parametrize("fault", ["reset", "interrupted", "interrupted-after-parse"])
@pytest.mark.parametrize("semaphore", [False, True], ids=["lock", "semaphore"])
def test_a_grant_whose_reply_was_lost_is_not_kept_by_later_locks(
    dflock_server: ServerThread, monkeypatch: pytest.MonkeyPatch, semaphore: bool, fault: str
) -> None:
    """``reset``: the connection reset before the reply came; ``interrupted``: a signal's
    exception raised just after the reply's bytes were read from the socket, before they
    were parsed (no leftover to read: the reply is gone); ``interrupted-after-parse``: just
    after it was parsed, before the lock took the grant."""
    armed: list[bool] = []
    feed_reply = ReplyParser.feed_reply

    def interrupted_after_recv(parser: ReplyParser, command: Command, data: bytes) -> Reply | None:
        if armed and command in {Command.LOCK, Command.SEM_LOCK}:
            armed.clear()
            raise Interrupted
        return feed_reply(parser, command, data)

    def interrupted_after_parse(reply: Reply) -> bool:
        if armed and isinstance(reply, Granted):
            armed.clear()
            raise Interrupted
        return redirected(reply)

    redirected = KeyRoute.redirected
    if fault == "interrupted":
        monkeypatch.setattr(ReplyParser, "feed_reply", interrupted_after_recv)
    else:
        monkeypatch.setattr(KeyRoute, "redirected", staticmethod(interrupted_after_parse))
    expected = ServerUnavailable if fault == "reset" else Interrupted
    address = dflock_server.address
    with (
        FaultProxy(address).start() as proxy,
        Client([proxy.address], session_ttl_s=SESSION_S) as client,
    ):

        def make(key: str) -> DistributedLock | DistributedSemaphore:
            return client.semaphore(key, 1) if semaphore else client.lock(key)

        keeper = make("keeper")
        assert keeper.acquire()  # keeps the client's session alive
        lock = make("k")
        raised: list[BaseException] = []

        def acquire() -> None:
            try:
                lock.acquire()
            except expected as exc:
                raised.append(exc)

        if fault != "reset":
            armed.append(True)
            acquire()
        else:
            held = proxy.hold_reply_after(b"\nk\n")
            thread = threading.Thread(target=acquire)
            thread.start()
            assert held.wait(10)
            wait_until(
                lambda: holders_and_waiters(address, "k", semaphore)[0] == 1,
                what="the key granted",
            )
            proxy.reset()  # the grant's reply never arrives
            thread.join(30)
        assert raised, "the acquire did not fail"
        assert not lock.locked()
        assert keeper.owned() and keeper.renew()  # the fault costs the held lock nothing
        assert keeper.release()
        later = make("later")
        assert later.acquire()  # a lock taken after the fault, held while the rival waits
        with Client([address], acquire_timeout_s=FREED_WITHIN_S) as rival:
            other = rival.semaphore("k", 1) if semaphore else rival.lock("k")
            assert other.acquire(), "the grant whose reply was lost is held by nobody"
            assert other.release()
        assert later.owned() and later.release()
