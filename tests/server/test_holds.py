"""Holds (issue 17): ``hl`` (a lock with an owner note, bound to its connection or detached),
``note``, and what ``stats`` and ``hello`` say of them, over real sockets against the
in-process server."""

from __future__ import annotations

import json
import zlib
from typing import Any

import pytest

from dflockd_server import constants
from dflockd_server.testing import ServerThread
from tests.support.waiting import wait_until
from tests.support.wire import Wire, fence, held_keys


def stats_of(wire: Wire) -> dict[str, Any]:
    status, payload = wire.req("stats").split(" ", 1)
    assert status == "ok"
    result: dict[str, Any] = json.loads(payload)
    return result


def lock_entry(wire: Wire, key: str) -> dict[str, Any]:
    entries = [entry for entry in stats_of(wire)["locks"] if entry["key"] == key]
    assert len(entries) == 1, entries
    return entries[0]


def hold(wire: Wire, key: str, arg: str) -> str:
    """``hl`` granted at once: its token (fails the test on any other reply)."""
    reply = wire.req("hl", key, arg).split()
    assert reply[0] == "ok" and len(reply) == 3, reply
    return reply[1]


def test_hello_lists_holds(dflock_server: ServerThread) -> None:
    with Wire(dflock_server.address) as wire:
        status, payload = wire.req("hello").split(" ", 1)
    assert status == "ok"
    assert "holds" in json.loads(payload)["features"]
    assert constants.FEATURE_HOLDS in constants.FEATURES


def test_a_hold_is_granted_with_a_token_and_its_lease(dflock_server: ServerThread) -> None:
    with Wire(dflock_server.address) as wire:
        status, token, lease = wire.req("hl", "k", "0 17 d task-1").split()
        assert (status, lease) == ("ok", "17")
        assert len(token) == 32 and int(token, 16) >= 0
        later = wire.lock("other")
        assert fence(later) > fence(token)  # a hold takes a fence like any grant


def test_stats_show_the_owner_note_and_whether_a_lock_is_detached(
    dflock_server: ServerThread,
) -> None:
    with Wire(dflock_server.address) as a:
        hold(a, "bound", "0 30 c run%2F1/host")
        hold(a, "loose", "0 30 d queued-7")
        a.lock("plain")
        assert lock_entry(a, "bound")["owner"] == "run%2F1/host"
        assert lock_entry(a, "bound")["detached"] is False
        assert lock_entry(a, "loose")["owner"] == "queued-7"
        assert lock_entry(a, "loose")["detached"] is True
        plain = lock_entry(a, "plain")
        assert plain["owner"] is None and plain["detached"] is False
        assert set(plain) >= {"key", "owner_conn_id", "lease_expires_in_s", "waiters"}


def test_a_detached_hold_survives_its_connection_and_is_freed_by_any_connection(
    dflock_server: ServerThread,
) -> None:
    addr = dflock_server.address
    with Wire(addr) as a:
        token = hold(a, "k", "0 30 d t1")
        bound = hold(a, "c", "0 30 c t2")
    wait_until(lambda: "c" not in held_keys(addr), what="the bound hold freed by the close")
    assert "k" in held_keys(addr)
    with Wire(addr) as b:
        assert b.req("hl", "k", "0 30 d t3") == "timeout t1"
        assert b.req("l", "k", "0") == "timeout"
        assert b.req("n", "k", f"{token} 40") == "ok 40"
        assert lock_entry(b, "k")["detached"] is True  # a renew keeps it detached
        assert b.req("r", "c", bound) == "error"
        assert b.req("r", "k", token) == "ok"
        assert b.req("r", "k", token) == "error"
        b.lock("k")


def test_detached_holds_count_as_held_locks(dflock_server: ServerThread) -> None:
    table = dflock_server.server.table
    with Wire(dflock_server.address) as a:
        hold(a, "k1", "0 30 d t1")
        hold(a, "k2", "0 30 c t2")
    wait_until(lambda: dflock_server.call(lambda: table.held) == 1, what="one lock held")


def test_a_detached_hold_ends_with_its_lease(dflock_server: ServerThread) -> None:
    addr = dflock_server.address
    with Wire(addr) as a:
        token = hold(a, "k", "0 1 d t1")
    wait_until(lambda: "k" not in held_keys(addr), what="the lease to run out")
    with Wire(addr) as b:
        assert b.req("n", "k", token) == "error"
        hold(b, "k", "0 5 d t2")


def test_a_busy_key_answers_with_the_holders_note(dflock_server: ServerThread) -> None:
    addr = dflock_server.address
    with Wire(addr) as a, Wire(addr) as b:
        a.lock("plain")
        assert b.req("hl", "plain", "0 30 d mine") == "timeout _"
        hold(a, "noted", "0 30 c theirs")
        assert b.req("hl", "noted", "0 30 c mine") == "timeout theirs"
        assert b.req("hl", "noted", "1 30 d mine") == "timeout theirs"  # after waiting 1 s
        assert lock_entry(b, "noted")["waiters"] == 0
        assert b.req("ping") == "ok"


def test_a_waiting_hold_is_granted_in_fifo_order_with_its_note_and_mode(
    dflock_server: ServerThread,
) -> None:
    addr = dflock_server.address
    with Wire(addr) as holder, Wire(addr) as probe:
        token = holder.lock("k")
        waiter = Wire(addr)
        waiter.send("hl", "k", "10 30 d second")
        wait_until(lambda: lock_entry(probe, "k")["waiters"] == 1, what="the hold queued")
        assert probe.req("hl", "k", "0 30 c third") == "timeout _"
        assert holder.req("r", "k", token) == "ok"
        status, granted, lease = waiter.recv().split()
        assert (status, lease) == ("ok", "30")
        waiter.close()
        entry = lock_entry(probe, "k")
        assert (entry["owner"], entry["detached"]) == ("second", True)
        assert probe.req("r", "k", granted) == "ok"


def test_a_waiting_hold_whose_connection_closes_leaves_the_queue(
    dflock_server: ServerThread,
) -> None:
    addr = dflock_server.address
    with Wire(addr) as holder, Wire(addr) as probe:
        token = holder.lock("k")
        waiter = Wire(addr)
        waiter.send("hl", "k", "30 30 d gone")
        wait_until(lambda: lock_entry(probe, "k")["waiters"] == 1, what="the hold queued")
        waiter.close()
        wait_until(lambda: lock_entry(probe, "k")["waiters"] == 0, what="the wait dropped")
        assert holder.req("r", "k", token) == "ok"
        assert "k" not in held_keys(addr)


def test_note_replaces_the_note_of_a_held_grant(dflock_server: ServerThread) -> None:
    with Wire(dflock_server.address) as a:
        token = hold(a, "k", "0 30 d queued")
        assert a.req("note", "k", f"{token} queued/worker-1") == "ok"
        assert lock_entry(a, "k")["owner"] == "queued/worker-1"
        assert a.req("hl", "k", "0 30 d x") == "timeout queued/worker-1"
        plain = a.lock("plain")
        assert a.req("note", "plain", f"{plain} added") == "ok"
        assert lock_entry(a, "plain")["owner"] == "added"
        assert a.req("note", "k", f"{'0' * 32} x") == "error"  # not the holder's token
        assert a.req("note", "nokey", f"{token} x") == "error"
        assert a.req("note", "k", f"{token} bad\x7fnote") == "error"
        assert a.req("note", "k", token) == "error"
        assert a.req("r", "k", token) == "ok"
        assert a.req("note", "k", f"{token} late") == "error"  # released
        assert a.req("ping") == "ok"


@pytest.mark.parametrize(
    "arg",
    [
        "",
        "0",
        "0 30",
        "0 30 d",
        "0 30 x note",
        "0 30 dd note",
        "0 0 d note",
        "-1 30 d note",
        "0 30 d note extra",
        "0 30 d " + "n" * 201,
        "0 30 d caf\u00e9",
        "0 30 d a\x01b",
        "0 9000000001 d note",
        "0 99999999 d note",  # above max_lease_ttl_s
    ],
)
def test_malformed_holds_get_error_and_the_connection_stays_open(
    dflock_server: ServerThread, arg: str
) -> None:
    with Wire(dflock_server.address) as wire:
        assert wire.req("hl", "k", arg) == "error"
        assert wire.req("ping") == "ok"
        assert "k" not in held_keys(dflock_server.address)


def test_the_longest_hold_fits_the_line_limit(dflock_server: ServerThread) -> None:
    note = "~" * constants.MAX_NOTE_BYTES
    arg = f"9000000000 3600 d {note}"
    assert len(arg) <= constants.MAX_LINE_BYTES
    with Wire(dflock_server.address) as wire:
        token = hold(wire, "k", f"0 300 d {note}")
        assert lock_entry(wire, "k")["owner"] == note
        assert len(f"{token} {note}") <= constants.MAX_LINE_BYTES
        assert wire.req("note", "k", f"{token} {note}") == "ok"


def test_a_hold_on_a_semaphore_key_is_a_limit_mismatch(dflock_server: ServerThread) -> None:
    with Wire(dflock_server.address) as wire:
        assert wire.req("sl", "s", "0 2").startswith("ok ")
        assert wire.req("hl", "s", "0 30 d note") == "error_limit_mismatch"
        hold(wire, "h", "0 30 d note")
        assert wire.req("sl", "h", "0 2") == "error_limit_mismatch"


def test_max_locks_refuses_a_hold_on_a_new_key(dflock_server_factory: Any) -> None:
    server: ServerThread = dflock_server_factory(max_locks=1)
    with Wire(server.address) as wire:
        hold(wire, "a", "0 30 d note")
        assert wire.req("hl", "b", "0 30 d note") == "error_max_locks"


def test_without_auto_release_a_bound_hold_stays_too(dflock_server_factory: Any) -> None:
    server: ServerThread = dflock_server_factory(auto_release_on_disconnect=False)
    with Wire(server.address) as wire:
        hold(wire, "k", "0 30 c note")
    with Wire(server.address) as wire:
        assert wire.req("hl", "k", "0 30 c other") == "timeout note"


def test_a_static_member_redirects_holds_of_keys_it_does_not_serve(
    static_fleet: list[ServerThread],
) -> None:
    members = [f"127.0.0.1:{s.port}" for s in static_fleet]
    key = "some-key"
    owner = zlib.crc32(key.encode()) % len(members)
    for position, server in enumerate(static_fleet):
        with Wire(server.address) as wire:
            if position == owner:
                token = hold(wire, key, "0 30 d note")
                assert wire.req("note", key, f"{token} n2") == "ok"
            else:
                assert wire.req("hl", key, "0 30 d note") == f"error_moved {members[owner]}"
                assert wire.req("ping") == "ok"


def test_a_draining_server_refuses_holds_and_still_answers_note(
    dflock_server: ServerThread,
) -> None:
    with Wire(dflock_server.address) as wire:
        token = hold(wire, "k", "0 30 c note")
        dflock_server.call(lambda: setattr(dflock_server.server, "draining", True))
        assert wire.req("hl", "j", "0 30 d note") == "error_draining"
        assert wire.req("note", "k", f"{token} leaving") == "ok"
        assert wire.req("r", "k", token) == "ok"
