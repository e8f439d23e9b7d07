"""Holds through the client (issue 17): `Client.hold` and its errors, `Hold`, renew and note by
token, locks with a note (``lock.holder``), ``lock.adopt`` and ``lock.hand_off``, on both faces,
against real servers over real sockets."""

from __future__ import annotations

import asyncio
import json
import pickle
import threading
import time
import zlib
from typing import Any

import pytest

from celery_dflock import (
    AsyncClient,
    Client,
    DflockError,
    Hold,
    HoldsUnsupported,
    InvalidValueError,
    KeyHeld,
    LockNotAcquired,
)
from celery_dflock.client import _replies, _requests
from celery_dflock.client._replies import TimedOut
from celery_dflock.client._requests import Command
from dflockd_server.testing import ServerThread
from tests.support.holds import adopted_in_a_child
from tests.support.ports import free_port
from tests.support.waiting import wait_until
from tests.support.wire import Wire, fence, stats


def lock_entry(address: tuple[str, int], key: str) -> dict[str, Any] | None:
    locks: Any = stats(address)["locks"]
    found = [entry for entry in locks if entry["key"] == key]
    return found[0] if found else None


# ------------------------------------------------------------------------------ the codec
def test_hold_and_note_requests_and_their_replies() -> None:
    token = "0" * 16 + "a" * 16
    assert _requests.checked_hold("k", 0, 30, "t/h", detached=True) == b"hl\nk\n0 30 d t/h\n"
    assert _requests.checked_hold("k", 5, 9, "n", detached=False) == b"hl\nk\n5 9 c n\n"
    assert _requests.checked_note("k", token, "x") == f"note\nk\n{token} x\n".encode()
    assert _replies.decode_reply(Command.HOLD, b"timeout _") == TimedOut(None)
    assert _replies.decode_reply(Command.HOLD, b"timeout id%2F1/h") == TimedOut("id%2F1/h")
    assert _replies.decode_reply(Command.NOTE, b"ok") == _replies.Ok()
    assert _replies.decode_reply(Command.HOLD, b"error_moved 10.0.0.1:6388") == _replies.Moved(
        "10.0.0.1:6388"
    )
    for bad in ("", "a b", "é", "x" * 201, "\t"):
        with pytest.raises(InvalidValueError, match="note must be"):
            _requests.validate_note(bad)
    # A note that is not a str says so ("got 123" alone reads as a valid note).
    with pytest.raises(InvalidValueError, match=r"^note must be a str, got int: 123$"):
        _requests.validate_note(123)  # pyright: ignore[reportArgumentType]


# ------------------------------------------------------------------------------ blocking face
def test_hold_is_detached_and_keyheld_names_the_holder(dflock_server: ServerThread) -> None:
    address = dflock_server.address
    with Client([address]) as client:
        hold = client.hold("q:1", note="task-1", lease_ttl=30)
        assert isinstance(hold, Hold)
        assert (hold.key, hold.lease_ttl) == ("q:1", 30)
        assert hold.server == f"{address[0]}:{address[1]}"
        assert hold.fence == fence(hold.token)
        assert hold.token not in repr(hold)
        client.close()  # every connection gone: the hold stays
        entry = lock_entry(address, "q:1")
        assert entry is not None
        assert (entry["owner"], entry["detached"]) == ("task-1", True)
        with pytest.raises(KeyHeld) as refused:
            client.hold("q:1", note="task-2", lease_ttl=30, timeout=1)
        assert isinstance(refused.value, LockNotAcquired)
        assert (refused.value.key, refused.value.holder) == ("q:1", "task-1")
        assert "task-1" in str(refused.value)
        copy = pickle.loads(pickle.dumps(refused.value))
        assert (copy.key, copy.holder, str(copy)) == ("q:1", "task-1", str(refused.value))
        assert client.release("q:1", hold.token)
        assert lock_entry(address, "q:1") is None
        assert not client.release("q:1", hold.token)


def test_a_bound_hold_dies_with_its_connection_until_detached(
    dflock_server: ServerThread,
) -> None:
    """``hold(detached=False)`` (a publish not yet sent): bound to the pooled connection, so
    closing it frees the key; `detach` (the message was sent) makes it outlive it."""
    address = dflock_server.address
    with Client([address]) as client:
        bound = client.hold("q:b", note="task-b", lease_ttl=30, detached=False)
        entry = lock_entry(address, "q:b")
        assert entry is not None
        assert (entry["owner"], entry["detached"]) == ("task-b", False)
        client.close()  # the publisher gave up: its connection closes, the hold goes with it
        wait_until(lambda: lock_entry(address, "q:b") is None, timeout=10, what="freed")
        assert not client.detach("q:b", bound.token, lease_ttl=30)

        sent = client.hold("q:b", note="task-c", lease_ttl=30, detached=False)
        assert client.detach("q:b", sent.token, lease_ttl=60)
        client.close()
        entry = lock_entry(address, "q:b")
        assert entry is not None
        assert (entry["owner"], entry["detached"]) == ("task-c", True)
        assert entry["lease_expires_in_s"] > 30
        assert client.release("q:b", sent.token)


def test_a_plain_holder_gives_no_note(dflock_server: ServerThread) -> None:
    with Client([dflock_server.address]) as client, client.lock("q:plain"):
        with pytest.raises(KeyHeld) as refused:
            client.hold("q:plain", note="t", lease_ttl=5)
        assert refused.value.holder is None


def test_renew_and_note_by_token(dflock_server: ServerThread) -> None:
    address = dflock_server.address
    with Client([address]) as client:
        hold = client.hold("q:r", note="t", lease_ttl=5)
        assert client.renew("q:r", hold.token, lease_ttl=60)
        entry = lock_entry(address, "q:r")
        assert entry is not None and entry["lease_expires_in_s"] > 30
        assert entry["detached"] is True
        assert client.note("q:r", hold.token, "t/worker-1")
        entry = lock_entry(address, "q:r")
        assert entry is not None and entry["owner"] == "t/worker-1"
        assert client.release("q:r", hold.token)
        assert not client.renew("q:r", hold.token, lease_ttl=60)
        assert not client.note("q:r", hold.token, "late")
        with pytest.raises(InvalidValueError, match="note"):
            client.note("q:r", hold.token, "has space")
        with pytest.raises(InvalidValueError, match="lease_ttl"):
            client.renew("q:r", hold.token, lease_ttl=0)


def test_a_bad_token_is_refused_before_any_server_is_asked() -> None:
    # No server listens there: each call names its bad value, none says the server is gone
    # (note said ServerUnavailable: it checked the token only as it built the request).
    with Client([("127.0.0.1", free_port())], connect_timeout_s=1) as client:
        for call in (
            lambda: client.note("k", "not-a-token", "n"),
            lambda: client.renew("k", "not-a-token", lease_ttl=5),
            lambda: client.detach("k", "not-a-token", lease_ttl=5),
            lambda: client.release("k", "not-a-token"),
        ):
            with pytest.raises(InvalidValueError, match="token"):
                call()


def test_a_bad_hold_note_is_named_before_the_server_or_the_locks_state() -> None:
    # A hold's note (an adopt's token) is checked where it enters: with no server listening
    # it is the value that is named, not the server (it was checked only as the request was
    # built, after connecting), and so on a lock that already holds its key.
    with Client([("127.0.0.1", free_port())], connect_timeout_s=1) as client:
        with pytest.raises(InvalidValueError, match=r"^note must be .* got 'a b'$"):
            client.hold("k", note="a b", lease_ttl=5)
        with pytest.raises(InvalidValueError, match=r"^note must be .* got 'a b'$"):
            client.lock("k").hold("a b")
        with pytest.raises(InvalidValueError, match=r"^a token is .* got 'nope'$"):
            client.lock("k", note="n").adopt("nope")


def test_a_bad_hold_note_on_a_held_lock_names_the_note(dflock_server: ServerThread) -> None:
    with Client([dflock_server.address]) as client:
        lock = client.lock("q:bad-note", acquire_timeout_s=0)
        assert lock.acquire()
        with pytest.raises(InvalidValueError, match=r"^note must be .* got ''$"):
            lock.hold("")
        with pytest.raises(InvalidValueError, match=r"^a token is .* got 'nope'$"):
            lock.adopt("nope")
        assert lock.owned()
        assert lock.release()


def test_bad_hold_arguments_name_themselves(dflock_server: ServerThread) -> None:
    with Client([dflock_server.address]) as client:
        with pytest.raises(InvalidValueError, match="note must be"):
            client.hold("k", note="", lease_ttl=5)
        with pytest.raises(InvalidValueError, match="lease_ttl"):
            client.hold("k", note="n", lease_ttl=0)
        with pytest.raises(InvalidValueError, match="timeout"):
            client.hold("k", note="n", lease_ttl=5, timeout=-1)
        with pytest.raises(InvalidValueError, match="note"):
            client.lock("k", note="a b")
    assert lock_entry(dflock_server.address, "k") is None


def test_a_lock_with_a_note_shows_it_and_learns_the_holders(dflock_server: ServerThread) -> None:
    address = dflock_server.address
    with Client([address]) as client:
        with client.lock("q:n", note="run-1/host-a") as lock:
            assert lock.note == "run-1/host-a"
            entry = lock_entry(address, "q:n")
            assert entry is not None
            assert (entry["owner"], entry["detached"]) == ("run-1/host-a", False)
            other = client.lock("q:n", note="run-2", acquire_timeout_s=0)
            assert not other.acquire()
            assert other.holder == "run-1/host-a"
            assert client.lock("q:n", acquire_timeout_s=0).holder is None
        assert other.acquire()
        assert other.holder is None
        other.release()


def test_a_lock_without_a_lease_holds_and_adopts_for_the_servers_default_lease(
    dflock_server_factory: Any,
) -> None:
    """The lease default lives in the server (issue 53): its hello says it, and a lock with a
    note made without a lease asks ``hl`` and ``ht`` (which always name a lease) for that
    one: a server started with another default grants it, not the protocol's 33 s."""
    server: ServerThread = dflock_server_factory(default_lease_ttl_s=10)
    address = server.address
    with Client([address]) as client:
        with client.lock("q:d", note="run-1/host-a") as lock:
            assert lock.lease == 10
            entry = lock_entry(address, "q:d")
            assert entry is not None and entry["owner"] == "run-1/host-a"
        info = client.pool.server_info(*address)
        assert info is not None and info.default_lease_ttl_s == 10
        hold = client.hold("q:d2", note="t1", lease_ttl=30)
        lock = client.lock("q:d2")
        assert lock.adopt(hold.token, note="t1/host")
        assert lock.lease == 10
        assert lock.release()


def test_adopt_takes_over_a_hold_as_if_acquired(dflock_server: ServerThread) -> None:
    address = dflock_server.address
    with Client([address]) as client:
        hold = client.hold("q:a", note="t1", lease_ttl=30)
        lock = client.lock("q:a", lease_ttl_s=2)
        assert lock.adopt(hold.token, note="t1/host")
        assert lock.locked() and lock.owned()
        assert (lock.token, lock.fence, lock.lease) == (hold.token, hold.fence, 2)
        entry = lock_entry(address, "q:a")
        assert entry is not None and entry["owner"] == "t1/host"
        time.sleep(4.5)  # renewed in the background: alive after two of its 2 s leases
        assert lock.owned() and not lock.lost
        assert lock.release()
        assert lock_entry(address, "q:a") is None
        assert not lock.adopt(hold.token, note="t1/host")  # released: nothing to take over
        assert lock.holder is None
        assert not lock.locked()


@pytest.mark.parametrize("face", ["blocking", "asyncio"])
def test_hold_or_adopt_on_a_held_lock_is_refused_and_the_lock_stays_held(
    dflock_server: ServerThread, face: str
) -> None:
    """``hold()`` or ``adopt()`` called on a lock that holds its key: refused, the lock still
    held, renewed and released. (They reset the lock on the way out: the grant was forgotten,
    not renewed nor released, and the key stayed busy until its lease ran out, the lock
    reporting nothing.)"""
    address = dflock_server.address

    async def check(run: Any, client: Any) -> None:
        lock = client.lock("q:held", note="me", acquire_timeout_s=0, lease_ttl_s=2)
        assert await run(lock.acquire())
        token = lock.token
        with pytest.raises(DflockError, match="already held by this object"):
            await run(lock.hold("other"))
        with pytest.raises(DflockError, match="already held by this object"):
            await run(lock.adopt("0" * 32))
        assert lock.locked() and lock.owned() and lock.token == token
        await asyncio.sleep(3.0)  # renewed past its 2 s lease
        assert lock.owned() and not lock.lost
        assert await run(lock.release())
        assert lock_entry(address, "q:held") is None

    async def blocking(value: Any) -> Any:
        return value

    async def awaited(value: Any) -> Any:
        return await value

    async def main() -> None:
        if face == "blocking":
            with Client([address]) as client:
                await check(blocking, client)
        else:
            async with AsyncClient([address]) as client:
                await check(awaited, client)

    asyncio.run(main())


def test_hand_off_keeps_the_hold_and_release_is_then_a_no_op(dflock_server: ServerThread) -> None:
    address = dflock_server.address
    lost: list[object] = []
    with Client([address]) as client:
        hold = client.hold("q:h", note="t1", lease_ttl=30)
        lock = client.lock("q:h", lease_ttl_s=5, on_lost=lost.append, note="t1/h")
        assert lock.adopt(hold.token)  # the lock's note
        assert lock.hand_off(120)
        assert not lock.locked() and lock.token is None
        assert not lock.release()
        assert not lock.lost and lost == []
        client.close()
        entry = lock_entry(address, "q:h")
        assert entry is not None and entry["lease_expires_in_s"] > 100
        assert entry["detached"] is True
        again = client.lock("q:h")
        assert again.adopt(hold.token, note="t1/h2")  # the retry's run takes it over again
        assert again.release()
        assert not client.lock("q:h").hand_off(5)  # nothing held


def test_a_server_without_holds_gets_no_hold(dflock_server: ServerThread) -> None:
    """A real server whose hello does not list ``holds`` (as a foreign dflockd's would not):
    the client never sends it ``hl`` or ``note``."""
    body = {"server": "dflockd-server", "version": "0.1.0", "features": ["fence", "ping"]}
    hello = f"ok {json.dumps(body)}\n".encode()
    dflock_server.call(lambda: setattr(dflock_server.server, "_hello", hello))
    address = dflock_server.address
    with Client([address]) as client:
        with pytest.raises(HoldsUnsupported) as refused:
            client.hold("q:f", note="t", lease_ttl=5)
        message = str(refused.value)
        assert f"{address[0]}:{address[1]}" in message
        assert "needs celery-dflock's dflockd-server (the 'holds' feature)" in message
        assert "dflockd-server 0.1.0" in message
        assert lock_entry(address, "q:f") is None
        with client.lock("q:f", note="ignored") as lock:
            entry = lock_entry(address, "q:f")
            assert entry is not None and entry["owner"] is None  # sent as a plain `l`
            with pytest.raises(HoldsUnsupported):
                client.note("q:f", lock.token or "", "x")
            with pytest.raises(HoldsUnsupported):
                client.lock("q:f").adopt(lock.token or "", note="x")


def test_holds_are_routed_over_a_static_fleet(static_fleet: list[ServerThread]) -> None:
    servers = [server.address for server in static_fleet]
    with Client(servers) as client:
        for key in ("a", "b", "c", "d", "e", "f"):
            owner = servers[zlib.crc32(key.encode()) % len(servers)]
            hold = client.hold(key, note="t", lease_ttl=30)
            assert hold.server == f"{owner[0]}:{owner[1]}"
            assert lock_entry(owner, key) is not None
            assert client.note(key, hold.token, "t/h")
            assert client.renew(key, hold.token, lease_ttl=40)
            lock = client.lock(key)
            assert lock.adopt(hold.token, note="t/h2")
            assert lock.release()


# ------------------------------------------------------------------------------ asyncio face
def test_the_async_client_does_the_same(dflock_server: ServerThread) -> None:
    address = dflock_server.address

    async def main() -> None:
        async with AsyncClient([address]) as client:
            hold = await client.hold("qa:1", note="t1", lease_ttl=30)
            assert hold.fence == fence(hold.token)
            with pytest.raises(KeyHeld) as refused:
                await client.hold("qa:1", note="t2", lease_ttl=30)
            assert refused.value.holder == "t1"
            busy = client.lock("qa:1", note="r", acquire_timeout_s=0)
            assert not await busy.acquire()
            assert busy.holder == "t1"
            assert await client.note("qa:1", hold.token, "t1/h")
            assert await client.renew("qa:1", hold.token, lease_ttl=60)
            lock = client.lock("qa:1", lease_ttl_s=10)
            assert await lock.adopt(hold.token, note="t1/h2")
            assert lock.owned()
            assert await lock.hand_off(90)
            assert not await lock.release()
            again = client.lock("qa:1")
            assert await again.adopt(hold.token, note="t1/h3")
            assert await again.release()
            assert not await client.release("qa:1", hold.token)

    asyncio.run(main())
    assert lock_entry(address, "qa:1") is None


def test_a_hold_waits_for_a_key_freed_meanwhile(dflock_server: ServerThread) -> None:
    with Client([dflock_server.address]) as client, Wire(dflock_server.address) as wire:
        token = wire.lock("q:w")

        async def hold_then_free() -> Hold:
            async with AsyncClient([dflock_server.address]) as aclient:
                waiting = asyncio.ensure_future(
                    aclient.hold("q:w", note="next", lease_ttl=30, timeout=10)
                )
                await asyncio.sleep(0.3)
                assert wire.req("r", "q:w", token) == "ok"
                return await waiting

        hold = asyncio.run(hold_then_free())
        entry = lock_entry(dflock_server.address, "q:w")
        assert entry is not None and (entry["owner"], entry["detached"]) == ("next", True)
        assert client.release("q:w", hold.token)


# ------------------------------------------------------------------------------ ht / hd
def test_take_over_and_hand_down_requests_and_their_replies() -> None:
    token = "0" * 16 + "a" * 16
    assert (
        _requests.checked_take("k", token, 30, None, "t/h") == f"ht\nk\n{token} 30 r t/h\n".encode()
    )
    assert _requests.checked_take("k", token, 30, 300, "t") == f"ht\nk\n{token} 30 300 t\n".encode()
    assert _requests.checked_hand_down("k", token, 9) == f"hd\nk\n{token} 9\n".encode()
    assert _replies.decode_reply(Command.TAKE, b"ok 30") == _replies.Renewed(30)
    assert _replies.decode_reply(Command.TAKE, b"error_bound t/h") == _replies.Bound("t/h")
    assert _replies.decode_reply(Command.TAKE, b"error_bound _") == _replies.Bound(None)
    assert _replies.decode_reply(Command.HAND_DOWN, b"ok") == _replies.Ok()
    with (
        Client([("127.0.0.1", 1)]) as client,
        pytest.raises(InvalidValueError, match="on_close_lease"),
    ):
        client.lock("k", note="t").adopt(token, on_close_lease=0)


def test_two_adopters_of_one_hold_exactly_one_wins(dflock_server: ServerThread) -> None:
    address = dflock_server.address
    with Client([address]) as first, Client([address]) as second, Client([address]) as third:
        hold = first.hold("q:two", note="queued", lease_ttl=30)
        locks = [c.lock("q:two", lease_ttl_s=10) for c in (first, second, third)]
        won: list[bool] = [False] * len(locks)
        start = threading.Barrier(len(locks))

        def adopt(index: int) -> None:
            start.wait()
            won[index] = locks[index].adopt(hold.token, note=f"run/{index}")

        threads = [threading.Thread(target=adopt, args=(i,)) for i in range(len(locks))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert won.count(True) == 1, won
        winner = won.index(True)
        for index, lock in enumerate(locks):
            if index != winner:
                assert not lock.locked()
                assert lock.holder == f"run/{winner}"  # error_bound names the winner's note
        assert locks[winner].fence == hold.fence
        assert locks[winner].release()
        assert lock_entry(address, "q:two") is None


def test_two_async_adopters_of_one_hold_exactly_one_wins(dflock_server: ServerThread) -> None:
    address = dflock_server.address

    async def main() -> None:
        async with AsyncClient([address]) as one, AsyncClient([address]) as two:
            hold = await one.hold("qa:two", note="queued", lease_ttl=30)
            locks = [one.lock("qa:two"), two.lock("qa:two")]
            won = await asyncio.gather(
                *(lock.adopt(hold.token, note=f"run/{i}") for i, lock in enumerate(locks))
            )
            assert sorted(won) == [False, True]
            winner = won.index(True)
            loser = locks[1 - winner]
            assert not loser.locked() and loser.holder == f"run/{winner}"
            assert await locks[winner].hand_off(30)
            assert await loser.adopt(hold.token, note="run/again")  # handed down: free to take
            assert loser.fence == hold.fence
            assert await loser.release()

    asyncio.run(main())
    assert lock_entry(address, "qa:two") is None


def test_an_adopter_killed_with_on_close_lease_leaves_the_hold_for_the_next(
    dflock_server: ServerThread,
) -> None:
    address = dflock_server.address
    with Client([address]) as client:
        hold = client.hold("q:kill", note="queued", lease_ttl=30)
        with adopted_in_a_child(address, "q:kill", hold.token, 20) as child:
            assert child.fence == hold.fence
            busy = client.lock("q:kill")
            assert not busy.adopt(hold.token, note="run/dup")  # the child's run has it
            assert busy.holder == "run/child"
        wait_until(
            lambda: (lock_entry(address, "q:kill") or {}).get("detached") is True,
            what="the grant detached by the child's death",
        )
        entry = lock_entry(address, "q:kill")
        assert entry is not None and 10 < entry["lease_expires_in_s"] <= 20
        assert entry["owner"] == "run/child"
        lock = client.lock("q:kill")
        assert lock.adopt(hold.token, note="run/next")
        assert lock.fence == hold.fence
        assert lock.release()


def test_an_adopter_killed_without_on_close_lease_frees_the_key(
    dflock_server: ServerThread,
) -> None:
    address = dflock_server.address
    with Client([address]) as client:
        hold = client.hold("q:free", note="queued", lease_ttl=30)
        with adopted_in_a_child(address, "q:free", hold.token, 0) as child:
            assert child.fence == hold.fence
        wait_until(lambda: lock_entry(address, "q:free") is None, what="the key freed")
        assert not client.lock("q:free").adopt(hold.token, note="run/late")
        with client.lock("q:free", acquire_timeout_s=0) as lock:
            assert lock.fence is not None and hold.fence is not None
            assert lock.fence > hold.fence


def test_hand_off_then_another_client_adopts(dflock_server: ServerThread) -> None:
    address = dflock_server.address
    with Client([address]) as one, Client([address]) as two:
        hold = one.hold("q:pass", note="queued", lease_ttl=30)
        lock = one.lock("q:pass", lease_ttl_s=10)
        assert lock.adopt(hold.token, note="run/1")
        taker = two.lock("q:pass", lease_ttl_s=10, note="run/2")
        assert not taker.adopt(hold.token)
        assert taker.holder == "run/1"
        assert lock.hand_off(60)  # while `one`'s connection lives: detached by hd
        assert not lock.release()
        assert taker.adopt(hold.token)  # the lock's own note
        entry = lock_entry(address, "q:pass")
        assert entry is not None and (entry["owner"], entry["detached"]) == ("run/2", False)
        assert taker.fence == hold.fence
        assert taker.release()


def test_adopt_needs_a_note(dflock_server: ServerThread) -> None:
    with Client([dflock_server.address]) as client:
        hold = client.hold("q:nn", note="queued", lease_ttl=30)
        with pytest.raises(InvalidValueError, match="needs an owner note"):
            client.lock("q:nn").adopt(hold.token)
        with pytest.raises(InvalidValueError, match="on_close_lease"):
            client.lock("q:nn").adopt(hold.token, note="x", on_close_lease=0)
        assert client.release("q:nn", hold.token)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_lease_above_the_servers_longest_is_refused_and_the_grant_kept(
    dflock_server_factory: Any, kind: str
) -> None:
    """A renew, detach, hand-off or adopt asking more than ``--max-lease-ttl`` raises naming it
    and keeps the grant where it was; the server answers such a request ``error``, which read
    as a grant no longer held (False) while it was: a hand-off let go of a lock whose grant
    stayed bound to a pooled connection, held by nobody."""
    server = dflock_server_factory(max_lease_ttl_s=60)
    address = server.address
    too_long = r"above the longest lease .*\(60 s, its --max-lease-ttl"

    async def main(client: Any, call: Any) -> None:
        hold = await call(client.hold("q:m", note="t", lease_ttl=30))
        for refused in (
            lambda: client.renew("q:m", hold.token, lease_ttl=61),
            lambda: client.detach("q:m", hold.token, lease_ttl=61),
        ):
            with pytest.raises(InvalidValueError, match=too_long):
                await call(refused())
        adopter = client.lock("q:m", note="t/a", lease_ttl_s=30)
        with pytest.raises(InvalidValueError, match=too_long):
            await call(adopter.adopt(hold.token, on_close_lease=61))
        entry = lock_entry(address, "q:m")
        assert entry is not None and entry["detached"] is True
        assert await call(adopter.adopt(hold.token))
        with pytest.raises(InvalidValueError, match=too_long):
            await call(adopter.hand_off(61))
        assert adopter.owned() and adopter.token is not None
        assert await call(adopter.release())
        assert lock_entry(address, "q:m") is None

    async def awaited(value: Any) -> Any:
        return await value if kind == "async" else value

    if kind == "async":

        async def run_async() -> None:
            async with AsyncClient([address]) as client:
                await main(client, awaited)

        asyncio.run(run_async())
    else:
        with Client([address]) as client:
            asyncio.run(main(client, awaited))


def test_note_token_refuses_a_token_or_note_the_protocol_cannot_carry(
    dflock_server: ServerThread,
) -> None:
    """``lock.note_token`` checks its token and note before sending, as ``client.note`` does:
    a note with line breaks went to the server as it was, so its lines after the first were
    read as requests of their own (here a release of the lock by its token)."""
    address = dflock_server.address
    with Client([address]) as client:
        lock = client.lock("nt:k", note="first")
        assert lock.acquire()
        token = lock.token
        assert token is not None
        with pytest.raises(InvalidValueError, match="note must be"):
            lock.note_token(token, f"x\nr\nnt:k\n{token}")
        with pytest.raises(InvalidValueError, match="token"):
            lock.note_token("not a token", "n")
        entry = lock_entry(address, "nt:k")
        assert entry is not None and entry["owner"] == "first"
        assert lock.release()
