"""`Client.force_release` / `AsyncClient.force_release` (``fr``): an operator frees a key
whoever holds it. The codec byte by byte, then both faces against the real server: the next
waiter is granted at once with a higher fence, the old holder learns its loss at its next
renewal (or at once, where its session's keep-alives spare it renewals), a restart of a
durable server does not bring the freed grant back, and a server that predates the request is
never sent it."""

from __future__ import annotations

import json
import logging
import zlib
from collections.abc import Callable
from typing import Any

import pytest

from celery_dflock import (
    AsyncClient,
    Client,
    ForceReleaseUnsupported,
    InvalidValueError,
    ProtocolError,
)
from celery_dflock.client import _replies, _requests
from celery_dflock.client._replies import ErrorReply, Freed, Moved
from celery_dflock.client._requests import Command
from dflockd_server.testing import ServerThread
from tests.client.faces import Lock, Maker, assert_lost_reported, until
from tests.support.wire import raw_request


def owner_index(key: str, members: int) -> int:
    """The static members' strategy: ``zlib.crc32(key) % len(members)``."""
    return zlib.crc32(key.encode()) % members


# ------------------------------------------------------------------------------ the codec
def test_the_request_and_its_replies() -> None:
    assert _requests.checked_force_release("k") == b"fr\nk\n_\n"
    assert _requests.checked_force_release("k", "ops:alice") == b"fr\nk\nops:alice\n"
    assert _replies.decode_reply(Command.FORCE_RELEASE, b"ok 2") == Freed(2)
    assert _replies.decode_reply(Command.FORCE_RELEASE, b"error") == ErrorReply("error")
    assert _replies.decode_reply(Command.FORCE_RELEASE, b"error_moved b:1") == Moved("b:1")
    for bad in (b"ok", b"ok -1", b"ok 1 2"):
        with pytest.raises(ProtocolError):
            _replies.decode_reply(Command.FORCE_RELEASE, bad)
    # What it carries is checked where it enters, before any I/O (no server listens here).
    client = Client([("127.0.0.1", 1)])
    with pytest.raises(InvalidValueError, match="whitespace"):
        client.force_release("a b")
    with pytest.raises(InvalidValueError, match="must not be empty"):
        client.force_release("")
    with pytest.raises(InvalidValueError, match="the operator's note"):
        client.force_release("k", note="two words")


# ------------------------------------------------------------------------------ both faces
def client_of(make: Maker) -> Any:
    client_class = AsyncClient if make.face.is_async else Client
    return client_class([make.server.address])


async def test_the_next_waiter_is_granted_with_a_higher_fence_and_the_holder_learns_it_lost(
    make: Maker, caplog: pytest.LogCaptureFixture
) -> None:
    run = make.face.run
    caplog.set_level(logging.WARNING, logger="celery_dflock")
    calls: list[Lock] = []
    holder = make("ops:k", lease_ttl_s=2, on_lost=calls.append)
    assert await run(holder.acquire()) and holder.token is not None
    token, fence = holder.token, holder.fence
    waiter = make("ops:k", 60)
    got: list[bool] = []

    async def take() -> None:
        got.append(await run(waiter.acquire()))

    join = make.face.spawn(take if make.face.is_async else lambda: got.append(waiter.acquire()))
    await until(lambda: make.holders("ops:k") == (1, 1), what="the waiter queued")
    client = client_of(make)
    assert await run(client.force_release("ops:k", note="ops:test")) == 1
    await join(30.0)
    assert got == [True]
    assert waiter.fence is not None and fence is not None and waiter.fence > fence
    await assert_lost_reported(make.face, holder, calls, caplog, token)
    assert await run(waiter.release()) is True
    assert await run(client.force_release("ops:k")) == 0  # nothing holds it now
    with pytest.raises(InvalidValueError, match="whitespace"):
        await run(client.force_release("ops k"))
    await run(client.close())


async def test_a_holder_its_sessions_keep_alives_keep_learns_it_lost_at_once(
    make: Maker, caplog: pytest.LogCaptureFixture
) -> None:
    """With the server's default lease (33 s), the session's keep-alives keep the grant and the
    lock sends no renewal of its own: the server closes the grant's connection, and the lock,
    reattaching, learns it lost in well under a keep-alive's interval."""
    run = make.face.run
    caplog.set_level(logging.WARNING, logger="celery_dflock")
    calls: list[Lock] = []
    holder = make("ops:kept", on_lost=calls.append)
    assert await run(holder.acquire()) and holder.token is not None
    token = holder.token
    client = client_of(make)
    assert await run(client.force_release("ops:kept", note="ops:test")) == 1
    assert await make.face.wait_lost(holder, 3.0), "the holder was not told within 3 s"
    await assert_lost_reported(make.face, holder, calls, caplog, token)
    await run(client.close())


def test_a_server_that_predates_it_is_never_sent_it(dflock_server: ServerThread) -> None:
    body = {"server": "dflockd-server", "version": "0.2.0", "features": ["fence", "holds"]}
    hello = f"ok {json.dumps(body)}\n".encode()
    dflock_server.call(lambda: setattr(dflock_server.server, "_hello", hello))
    address = dflock_server.address
    with Client([address]) as client, client.lock("ops:old") as lock:
        with pytest.raises(ForceReleaseUnsupported) as refused:
            client.force_release("ops:old")
        message = str(refused.value)
        assert f"{address[0]}:{address[1]}" in message
        assert "does not list 'force_release'" in message and "predates" in message
        assert lock.renew()  # nothing was sent: still held


# ------------------------------------------------------------------------------ routing
def test_a_member_that_does_not_serve_the_key_redirects_and_the_client_follows(
    static_fleet: list[ServerThread],
) -> None:
    """Static members answer ``fr`` for a key they do not serve with ``error_moved``; a
    client that knows only one of them follows the redirect to the key's member."""
    servers = [server.address for server in static_fleet]
    key = next(k for k in (f"moved:{n}" for n in range(100)) if owner_index(k, 3) == 1)
    with Client(servers) as fleet:
        lock = fleet.lock(key)
        assert lock.acquire()
        first = servers[0]
        assert raw_request(first, _requests.checked_force_release(key)) == (
            f"error_moved {servers[1][0]}:{servers[1][1]}".encode()
        )
        with Client([first]) as one:
            assert one.force_release(key) == 1
        assert not lock.renew()
        lock.release()


def test_force_release_needs_the_secret_where_the_server_has_one(
    dflock_server_factory: Callable[..., ServerThread],
) -> None:
    server = dflock_server_factory(auth_token="s3cret")
    assert raw_request(server.address, _requests.checked_force_release("k")) == b"error_auth"
    with Client([server.address], auth_token="s3cret") as client, client.lock("k"):
        assert client.force_release("k") == 1
