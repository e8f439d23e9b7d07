"""Holds through the client (issue 17): `Client.hold` and its errors, `Hold`, renew and note by
token, locks with a note (``lock.holder``), ``lock.adopt`` and ``lock.hand_off``, on both faces,
against real servers over real sockets."""

from __future__ import annotations

import asyncio
import json
import pickle
import time
import zlib
from typing import Any

import pytest

from celery_dflock import (
    AsyncClient,
    Client,
    Hold,
    HoldsUnsupported,
    InvalidValueError,
    KeyHeld,
    LockNotAcquired,
    protocol,
)
from celery_dflock.protocol import Command, TimedOut
from dflockd_server.testing import ServerThread
from tests.support.wire import Wire, fence, stats


def lock_entry(address: tuple[str, int], key: str) -> dict[str, Any] | None:
    locks: Any = stats(address)["locks"]
    found = [entry for entry in locks if entry["key"] == key]
    return found[0] if found else None


# ------------------------------------------------------------------------------ the codec
def test_hold_and_note_requests_and_their_replies() -> None:
    token = "0" * 16 + "a" * 16
    assert protocol.encode_hold("k", 0, 30, "t/h", detached=True) == b"hl\nk\n0 30 d t/h\n"
    assert protocol.encode_hold("k", 5, 9, "n", detached=False) == b"hl\nk\n5 9 c n\n"
    assert protocol.encode_note("k", token, "x") == f"note\nk\n{token} x\n".encode()
    assert protocol.decode_reply(Command.HOLD, b"timeout _") == TimedOut(None)
    assert protocol.decode_reply(Command.HOLD, b"timeout id%2F1/h") == TimedOut("id%2F1/h")
    assert protocol.decode_reply(Command.NOTE, b"ok") == protocol.Ok()
    assert protocol.decode_reply(Command.HOLD, b"error_moved 10.0.0.1:6388") == protocol.Moved(
        "10.0.0.1:6388"
    )
    for bad in ("", "a b", "é", "x" * 201, "\t"):
        with pytest.raises(InvalidValueError, match="note must be"):
            protocol.encode_hold("k", 0, 30, bad, detached=True)


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
        assert not lock.adopt(hold.token)  # released: nothing to take over
        assert not lock.locked()


def test_hand_off_keeps_the_hold_and_release_is_then_a_no_op(dflock_server: ServerThread) -> None:
    address = dflock_server.address
    lost: list[object] = []
    with Client([address]) as client:
        hold = client.hold("q:h", note="t1", lease_ttl=30)
        lock = client.lock("q:h", lease_ttl_s=5, on_lost=lost.append)
        assert lock.adopt(hold.token)
        assert lock.hand_off(120)
        assert not lock.locked() and lock.token is None
        assert not lock.release()
        assert not lock.lost and lost == []
        client.close()
        entry = lock_entry(address, "q:h")
        assert entry is not None and entry["lease_expires_in_s"] > 100
        assert entry["detached"] is True
        again = client.lock("q:h")
        assert again.adopt(hold.token)  # the retry's run takes it over again
        assert again.release()
        assert not client.lock("q:h").hand_off(5)  # nothing held


def test_a_server_without_holds_gets_no_hold(dflock_server: ServerThread) -> None:
    """A real server whose hello does not list ``holds`` (as a foreign dflockd's would not):
    the client never sends it ``hl`` or ``note``."""
    body = {"server": "dflockd-server", "version": "0.1.0", "features": ["fence", "ping"]}
    hello = f"ok {json.dumps(body)}\n".encode()
    dflock_server.call(lambda: setattr(dflock_server.server, "hello_reply", hello))
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
            assert lock.adopt(hold.token)
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
            assert await again.adopt(hold.token)
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
