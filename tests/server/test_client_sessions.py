"""Client sessions (docs/protocol.md, "Client sessions"): one session a client, shared by its
connections, kept alive by one ``ping _ session <id>`` for every grant on it. The table's rules
step by step on a fake clock, the journal's records, then the wire of a real server."""

from __future__ import annotations

import itertools
import socket
import struct
import time
from pathlib import Path

import pytest

from dflockd_server.journal import Journal
from dflockd_server.replay import read_journal, restored_leases
from dflockd_server.table import Holder, LockTable, Waiter
from tests.support.clock import FakeClock as Clock
from tests.support.servers import dflockd_subprocess
from tests.support.waiting import wait_until
from tests.support.wire import Wire

LEASE = 10
SESSION = "s" * 16
OTHER = "t" * 16


def make_table(clock: Clock, journal: Journal | None = None) -> LockTable:
    serial = itertools.count(1)
    return LockTable(
        clock=clock, new_token=lambda: f"{next(serial):032x}", max_locks=100, journal=journal
    )


@pytest.fixture
def clock() -> Clock:
    return Clock(100.0)


@pytest.fixture
def table(clock: Clock) -> LockTable:
    return make_table(clock)


def grant(table: LockTable, key: str, session: str | None, ttl: int = 15) -> Holder:
    client = table.open_client()
    if session is not None:
        table.join_session(client, session, ttl)
    got = table.acquire(client, key, LEASE, None, queue=False)
    assert isinstance(got, Holder), got
    return got


def test_a_close_of_a_session_connection_ends_nothing_while_the_session_lives(
    table: LockTable, clock: Clock
) -> None:
    held = grant(table, "k", SESSION)
    table.disconnect(held.client, by_peer=True)
    clock.now += LEASE - 1  # within its own lease too: a grant lives while both do
    table.expire()
    assert held.live
    assert table.acquire(table.open_client(), "k", LEASE, None, queue=False) is None


def test_a_keep_alive_renews_the_session_and_every_grant_on_it(
    table: LockTable, clock: Clock
) -> None:
    """One ``ping _ session <id>`` every few seconds: every grant of every connection of the
    session, open or closed, lives on past its own lease; a grant of another client does not."""
    grants = [grant(table, f"k{n}", SESSION) for n in range(5)]
    table.disconnect(grants[0].client, by_peer=True)
    other = grant(table, "theirs", OTHER)
    for _ in range(10):  # 50 s: five leases, three sessions
        clock.now += 5
        assert table.keep_alive(SESSION)
        table.expire()
    assert all(h.live for h in grants)
    assert all(h.expires_at == clock.now + LEASE for h in grants)
    assert not other.live  # its own session ended: nobody kept it alive


def test_a_session_not_kept_alive_ends_with_its_grants_and_the_next_waiter_is_granted(
    table: LockTable, clock: Clock
) -> None:
    held = grant(table, "k", SESSION, ttl=3)
    waiter = table.acquire(table.open_client(), "k", LEASE, None, queue=True)
    assert isinstance(waiter, Waiter)
    clock.now += 2.9
    table.expire()
    assert held.live and waiter.holder is None
    clock.now += 0.1
    table.expire()
    assert not held.live
    assert waiter.holder is not None and waiter.holder.live
    assert not table.keep_alive(SESSION)  # gone: its grants too, its client must know
    assert SESSION not in table.sessions


def test_a_keep_alive_that_comes_after_the_session_ran_out_ends_it_and_is_refused(
    table: LockTable, clock: Clock
) -> None:
    """Not swept yet, a session past its time is still over: the keep-alive does not bring
    it, or the grants its client has counted as lost, back."""
    held = grant(table, "k", SESSION, ttl=3)
    clock.now += 3
    assert not table.keep_alive(SESSION)
    assert not held.live


def test_a_renewal_by_token_that_comes_after_its_session_ran_out_is_refused(
    table: LockTable, clock: Clock
) -> None:
    """Not swept yet, a session past its time is over for a renewal of one of its grants by
    token too (``n``, from any connection): answered ``ok``, the grant would be freed at the
    next sweep under a holder just told its lease runs on."""
    held = grant(table, "k", SESSION, ttl=3)
    clock.now += 3
    assert table.renew("k", held.token, LEASE, table.open_client()) is None
    assert not held.live
    assert SESSION not in table.sessions
    assert isinstance(table.acquire(table.open_client(), "k", LEASE, None, queue=False), Holder)


def test_a_hand_down_that_comes_after_its_session_ran_out_is_refused(
    table: LockTable, clock: Clock
) -> None:
    """``hd`` (a queue-once hold detached for its task) of a grant whose session ran out, not
    swept yet, is refused as a renewal by token is: it detached the grant with a new lease,
    and the key stayed held for that lease by a grant its client had counted as lost."""
    held = grant(table, "k", SESSION, ttl=3)
    clock.now += 3
    assert not table.hand_down("k", held.token, LEASE)
    assert not held.live
    assert SESSION not in table.sessions
    assert isinstance(table.acquire(table.open_client(), "k", LEASE, None, queue=False), Holder)


def test_joining_a_session_that_ran_out_starts_a_new_one_without_its_grants(
    table: LockTable, clock: Clock
) -> None:
    held = grant(table, "k", SESSION, ttl=3)
    clock.now += 4
    again = grant(table, "other", SESSION, ttl=3)
    assert not held.live and again.live
    assert table.sessions[SESSION].clients == [again.client]


def test_closed_connections_that_hold_nothing_leave_the_session(
    table: LockTable, clock: Clock
) -> None:
    held = grant(table, "k", SESSION)
    idle = table.open_client()
    table.join_session(idle, SESSION, 15)
    table.disconnect(idle, by_peer=True)
    assert table.sessions[SESSION].clients == [held.client]
    table.disconnect(held.client, by_peer=True)
    assert table.release("k", held.token)
    assert table.keep_alive(SESSION)  # the last: it keeps nothing alive any more
    assert SESSION not in table.sessions
    assert not table.keep_alive(SESSION)


def test_a_session_its_client_ends_ends_at_once_with_its_grants(
    table: LockTable, clock: Clock
) -> None:
    held = grant(table, "k", SESSION)
    table.end_session(SESSION)
    assert not held.live
    assert not table.keep_alive(SESSION)
    table.end_session(SESSION)  # again, or of a session never made: nothing to do
    table.end_session(OTHER)


def test_without_auto_release_a_session_end_frees_nothing_early(clock: Clock) -> None:
    table = LockTable(
        clock=clock,
        new_token=lambda: "0" * 31 + "1",
        max_locks=10,
        auto_release_on_disconnect=False,
    )
    held = grant(table, "k", SESSION, ttl=3)
    clock.now += 4
    table.expire()
    assert held.live  # its lease (10 s) runs on
    clock.now += 6
    table.expire()
    assert not held.live


def test_a_kept_alive_grant_writes_a_record_a_lease_not_one_a_keep_alive(
    tmp_path: Path, clock: Clock
) -> None:
    """Keep-alives every 2 s for a minute on 10 grants of a 10 s lease: a record per grant
    about every lease (the record covers one lease ahead), not one per keep-alive; read back on
    the same boot, each grant runs at least to the end its last keep-alive gave."""
    journal = Journal(str(tmp_path / "journal"), "everysec", clock)
    journal.anchor()
    journal.open([])
    table = make_table(clock, journal)
    held = [grant(table, f"k{n}", SESSION) for n in range(10)]
    journal.flush()
    records = 0
    for _ in range(30):
        clock.now += 2
        assert table.keep_alive(SESSION)
        records += len(journal.buf)
        journal.flush()
    assert 0 < records <= 10 * 6  # 60 s: at most one a lease of 10 s, not 30 keep-alives
    read = read_journal(str(tmp_path / "journal"))
    now_ms = journal._anchor_mono_ms + int((clock.now - journal._anchor_clock) * 1000)  # pyright: ignore[reportPrivateUsage]
    restore = restored_leases(read, monotonic_ms=now_ms)
    assert sorted(rec.key for rec in restore.leases) == sorted(h.key for h in held)
    assert all(rec.left >= LEASE - 0.01 for rec in restore.leases)
    journal.close()


# ---------------------------------------------------------------- the wire, a real server
RESET = struct.pack("ii", 1, 0)
"""SO_LINGER on, 0 s: the close is a reset (what a killed holder's kernel may send)."""


def test_the_wire_a_session_outlives_its_connections_and_ends_when_not_kept_alive(
    tmp_path: Path,
) -> None:
    """``hello _ session <id> <ttl>`` on one connection, an acquire, a reset of that
    connection: the key stays held while ``ping _ session <id>`` comes from another connection, past
    its own lease; once the pings stop, the session's end frees it for the waiter."""
    with (
        dflockd_subprocess(tmp_path / "log", "--state-dir", str(tmp_path / "state")) as (
            _,
            address,
        ),
        Wire(address) as keeper,
        Wire(address) as rival,
    ):
        first = Wire(address)
        assert '"keepalive"' in first.req("hello", "_", f"session {SESSION} 3")
        token = first.lock("k", lease=2)
        first.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, RESET)
        first.close()
        for _ in range(8):  # 4 s: past its lease of 2 s and its session of 3
            assert keeper.req("ping", "_", f"session {SESSION}") == "ok"
            assert rival.req("l", "k", "0") == "timeout"
            time.sleep(0.5)
        started = time.monotonic()
        assert rival.req("l", "k", "10").startswith("ok ")  # granted once the session ends
        # not before its lease of 2 s from the last keep-alive (less the half second since)
        assert time.monotonic() - started >= 1.4
        time.sleep(max(0.0, started + 3.0 - time.monotonic()))  # the session's 3 s are over
        assert keeper.req("ping", "_", f"session {SESSION}") == "error"
        assert keeper.req("n", "k", token) == "error"


def test_a_malformed_session_hello_or_keep_alive_is_an_error_and_the_connection_goes_on(
    tmp_path: Path,
) -> None:
    with (
        dflockd_subprocess(tmp_path / "log", "--state-dir", str(tmp_path / "state")) as (
            _,
            address,
        ),
        Wire(address) as wire,
    ):
        for arg in (
            "session short 5",
            f"session {SESSION}",
            f"session {SESSION} -1",
            f"session {'x' * 65} 5",
            f"session {SESSION[:-1]}! 5",
            f"session {SESSION} 5 more",
        ):
            assert wire.req("hello", "_", arg) == "error", arg
        assert wire.req("ping", "_", "session " + "!" * 16) == "error"
        assert wire.req("ping", "_", f"session {SESSION} more") == "error"
        assert wire.req("ping", "_", "_") == "ok"
        assert wire.req("ping", "_", SESSION) == "ok"  # any other argument: ignored, as before
        assert wire.req("ping", "_", f"session {SESSION}") == "error"  # no such session


def test_a_waiter_of_the_session_granted_as_it_ends_keeps_its_grant(
    table: LockTable, clock: Clock
) -> None:
    """A session ends holding a key that one of its own connections, still open, waits for:
    the waiter is granted the key as the session's grant is freed, and that new grant is not
    freed with the session (its connection goes on as one of its own). Before, the session's
    end freed it too, after its wait had been answered with it: a grant the server had taken
    back while the client believed it, and a rival granted it meanwhile."""
    held = grant(table, "k", SESSION, ttl=3)
    waiting = table.open_client()
    table.join_session(waiting, SESSION, 3)
    waiter = table.acquire(waiting, "k", LEASE, None, queue=True)
    assert isinstance(waiter, Waiter)
    rival = table.acquire(table.open_client(), "k", LEASE, None, queue=True)
    assert isinstance(rival, Waiter)
    clock.now += 3
    table.expire()
    assert not held.live
    assert waiter.holder is not None and waiter.holder.live
    assert waiter.holder.client.kept_by is None
    assert rival.holder is None


def test_a_connection_that_leaves_a_session_past_its_time_does_not_bring_its_grants_back(
    tmp_path: Path,
) -> None:
    """A session past its time is over even if not swept yet: a connection of it that joins
    another session does not take the grants along (they would be kept alive by the new
    session's keep-alives, while their client counted them lost). A sweep far off leaves the
    run-out session unswept for the whole test."""
    with (
        dflockd_subprocess(
            tmp_path / "log",
            *("--state-dir", str(tmp_path / "state"), "--lease-sweep-interval", "60"),
        ) as (_, address),
        Wire(address) as holder,
        Wire(address) as rival,
    ):
        assert '"keepalive"' in holder.req("hello", "_", f"session {SESSION} 1")
        assert holder.lock("k", lease=60)
        time.sleep(1.2)  # the session's 1 s is over; the lock's 60 s lease is not
        assert holder.req("hello", "_", f"session {OTHER} 60").startswith("ok ")
        assert rival.req("ping", "_", f"session {OTHER}") == "ok"
        assert rival.req("l", "k", "0").startswith("ok ")  # freed by the first session's end


def test_a_session_left_by_every_connection_holding_nothing_is_forgotten(
    tmp_path: Path,
) -> None:
    """A session no open connection is in and no grant is on keeps nothing alive, and is
    forgotten at once: one connection that joins session after session (or one connection
    after another that joins and closes) leaves none behind for the rest of their time.
    Before, each lived up to ``max_lease_ttl_s`` (a million from one connection in seconds
    took a third of a gigabyte, and every lease sweep scanned them all, the loop stalled)."""
    left = [f"{n:016d}" for n in range(3)]
    with (
        dflockd_subprocess(tmp_path / "log", "--state-dir", str(tmp_path / "state")) as (
            _,
            address,
        ),
        Wire(address) as wire,
        Wire(address) as other,
    ):
        for session in left:
            assert wire.req("hello", "_", f"session {session} 300").startswith("ok ")
        with Wire(address) as closed:
            assert closed.req("hello", "_", f"session {SESSION} 300").startswith("ok ")
        with Wire(address) as holder:  # a session whose closed connection holds a grant
            assert holder.req("hello", "_", f"session {OTHER} 300").startswith("ok ")
            token = holder.lock("k", lease=60)
        assert other.req("ping", "_", f"session {OTHER}") == "ok"
        assert other.req("r", "k", token) == "ok"
        assert other.req("ping", "_", f"session {OTHER}") == "ok"  # the last one it answers
        wait_until(lambda: other.stats()["connections"] == 2, what="the closes reached it")
        for session in [*left[:-1], SESSION, OTHER]:
            assert other.req("ping", "_", f"session {session}") == "error", session
        assert other.req("ping", "_", f"session {left[-1]}") == "ok"  # its connection is open
