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


def lock_entry(wire: Wire, key: str) -> dict[str, Any]:
    entries = [entry for entry in wire.stats()["locks"] if entry["key"] == key]
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


# ---------------------------------------------------------------- ht (take over), hd (hand down)
def test_ht_binds_a_detached_grant_to_its_connection(dflock_server: ServerThread) -> None:
    addr = dflock_server.address
    with Wire(addr) as a:
        token = hold(a, "k", "0 30 d queued")
    with Wire(addr) as b:
        assert b.req("ht", "k", f"{token} 40 r run/host-b") == "ok 40"
        entry = lock_entry(b, "k")
        assert (entry["owner"], entry["detached"]) == ("run/host-b", False)
        assert 39 < entry["lease_expires_in_s"] <= 40
        assert b.req("n", "k", token) == "ok 33"  # the same token holds it, renewable
        assert b.req("hl", "k", "0 30 d dup") == "timeout run/host-b"


def test_a_second_ht_while_the_first_connection_lives_is_error_bound(
    dflock_server: ServerThread,
) -> None:
    addr = dflock_server.address
    with Wire(addr) as a, Wire(addr) as b:
        token = hold(a, "k", "0 30 d queued")
        assert a.req("ht", "k", f"{token} 30 r run/a") == "ok 30"
        assert b.req("ht", "k", f"{token} 30 r run/b") == "error_bound run/a"
        assert a.req("ht", "k", f"{token} 30 r again") == "error_bound run/a"  # its own too
        plain = a.lock("plain")
        assert b.req("ht", "plain", f"{plain} 30 r x") == "error_bound _"  # an l grant is bound
        assert lock_entry(b, "k")["owner"] == "run/a"
        assert b.req("ping") == "ok"


def test_closing_the_binding_connection_with_onclose_r_frees_the_key_for_a_waiter(
    dflock_server: ServerThread,
) -> None:
    addr = dflock_server.address
    with Wire(addr) as probe:
        token = hold(probe, "k", "0 30 d queued")
        taker = Wire(addr)
        assert taker.req("ht", "k", f"{token} 30 r run") == "ok 30"
        waiter = Wire(addr)
        try:
            waiter.send("l", "k", "10")
            wait_until(lambda: lock_entry(probe, "k")["waiters"] == 1, what="the l queued")
            taker.close()
            status, granted, _lease = waiter.recv().split()
            assert status == "ok" and fence(granted) > fence(token)
            assert probe.req("n", "k", token) == "error"
        finally:
            waiter.close()


def test_with_onclose_n_the_close_detaches_the_grant_for_the_next_taker(
    dflock_server: ServerThread,
) -> None:
    addr = dflock_server.address
    with Wire(addr) as probe:
        token = hold(probe, "k", "0 30 d queued")
        first = Wire(addr)
        assert first.req("ht", "k", f"{token} 30 7 run/first") == "ok 30"
        assert probe.req("ht", "k", f"{token} 30 7 run/second") == "error_bound run/first"
        first.close()
        wait_until(lambda: lock_entry(probe, "k")["detached"], what="the grant detached")
        entry = lock_entry(probe, "k")
        assert entry["owner"] == "run/first"
        assert 5 < entry["lease_expires_in_s"] <= 7
        with Wire(addr) as second:
            assert second.req("ht", "k", f"{token} 30 r run/second") == "ok 30"
            assert lock_entry(probe, "k")["owner"] == "run/second"
            assert second.req("r", "k", token) == "ok"  # same token: same grant, same fence


def test_a_grant_detached_by_its_close_expires_if_nobody_takes_it(
    dflock_server: ServerThread,
) -> None:
    addr = dflock_server.address
    with Wire(addr) as a:
        token = hold(a, "k", "0 30 d queued")
        with Wire(addr) as b:
            assert b.req("ht", "k", f"{token} 30 1 run") == "ok 30"
        wait_until(lambda: "k" not in held_keys(addr), what="the 1 s lease after the close")
        assert a.req("ht", "k", f"{token} 30 r late") == "error"
        hold(a, "k", "0 30 d next")


def test_hd_detaches_a_bound_grant_and_another_connection_takes_it(
    dflock_server: ServerThread,
) -> None:
    addr = dflock_server.address
    with Wire(addr) as a:
        token = hold(a, "k", "0 30 c bound")
        assert a.req("hd", "k", f"{token} 20") == "ok"
        entry = lock_entry(a, "k")
        assert entry["detached"] is True and 19 < entry["lease_expires_in_s"] <= 20
        assert a.req("hd", "k", f"{token} 25") == "ok"  # a detached grant stays so
    assert "k" in held_keys(addr)  # its close did not free it
    with Wire(addr) as b:
        assert b.req("ht", "k", f"{token} 30 r taken") == "ok 30"
        assert b.req("hd", "k", f"{token} 30") == "ok"  # a taken grant is handed down again
        assert lock_entry(b, "k")["detached"] is True
    with Wire(addr) as c:
        assert c.req("ht", "k", f"{token} 30 r again") == "ok 30"
        plain = c.lock("plain")
        assert c.req("hd", "plain", f"{plain} 30") == "ok"  # any lock grant, l's included
    with Wire(addr) as d:
        assert d.req("hd", "k", f"{'0' * 32} 30") == "error"
        assert d.req("hd", "nokey", f"{token} 30") == "error"
        assert d.req("ht", "plain", f"{plain} 30 r mine") == "ok 30"
        assert d.req("r", "plain", plain) == "ok"
        assert d.req("hd", "plain", f"{plain} 30") == "error"  # released


def test_ht_and_hd_refuse_semaphore_slots(dflock_server: ServerThread) -> None:
    with Wire(dflock_server.address) as wire:
        token = wire.req("sl", "s", "0 2").split()[1]
        assert wire.req("hd", "s", f"{token} 30") == "error"
        assert wire.req("ht", "s", f"{token} 30 r note") == "error"
        assert wire.req("sr", "s", token) == "ok"


def test_without_auto_release_a_closed_connections_grant_can_be_taken(
    dflock_server_factory: Any,
) -> None:
    server: ServerThread = dflock_server_factory(auto_release_on_disconnect=False)
    with Wire(server.address) as wire:
        token = wire.lock("k", lease=30)
        assert wire.req("ht", "k", f"{token} 30 r x") == "error_bound _"
    with Wire(server.address) as wire:
        wait_until(lambda: lock_entry(wire, "k")["detached"], what="its connection closed")
        assert wire.req("ht", "k", f"{token} 30 r taken") == "ok 30"


def test_a_draining_server_still_answers_ht_and_hd(dflock_server: ServerThread) -> None:
    with Wire(dflock_server.address) as wire:
        token = hold(wire, "k", "0 30 d note")
        dflock_server.call(lambda: setattr(dflock_server.server, "draining", True))
        assert wire.req("ht", "k", f"{token} 30 r run") == "ok 30"
        assert wire.req("hd", "k", f"{token} 30") == "ok"
        assert wire.req("r", "k", token) == "ok"


@pytest.mark.parametrize(
    ("cmd", "arg"),
    [
        ("ht", ""),
        ("ht", "{t}"),
        ("ht", "{t} 30"),
        ("ht", "{t} 30 r"),
        ("ht", "{t} 30 r note extra"),
        ("ht", "{t} 0 r note"),
        ("ht", "{t} 30 0 note"),
        ("ht", "{t} 30 x note"),
        ("ht", "{t} 30 -1 note"),
        ("ht", "{t} 30 rr note"),
        ("ht", "{t} 30 r bad\x01note"),
        ("ht", "{t} 30 r " + "n" * 201),
        ("ht", "{t} 99999999 r note"),  # above max_lease_ttl_s
        ("ht", "{t} 30 99999999 note"),  # the close's lease too
        ("ht", "{t}\xff 30 r note"),
        ("hd", ""),
        ("hd", "{t}"),
        ("hd", "{t} 0"),
        ("hd", "{t} x"),
        ("hd", "{t} 30 extra"),
        ("hd", "{t} 99999999"),
    ],
)
def test_malformed_ht_and_hd_get_error_and_change_nothing(
    dflock_server: ServerThread, cmd: str, arg: str
) -> None:
    with Wire(dflock_server.address) as wire:
        token = hold(wire, "k", "0 30 d queued")
        assert wire.req(cmd, "k", arg.format(t=token)) == "error"
        assert wire.req("ping") == "ok"
        entry = lock_entry(wire, "k")
        assert (entry["owner"], entry["detached"]) == ("queued", True)


def test_the_longest_ht_fits_the_line_limit(dflock_server: ServerThread) -> None:
    note = "~" * constants.MAX_NOTE_BYTES
    with Wire(dflock_server.address) as wire:
        token = hold(wire, "k", "0 30 d queued")
        arg = f"{token} 300 300 {note}"
        assert len(arg) <= constants.MAX_LINE_BYTES
        assert wire.req("ht", "k", arg) == "ok 300"
        assert lock_entry(wire, "k")["owner"] == note
