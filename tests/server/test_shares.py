"""Each address's share of the table (``shares.AddressShares``, ``--max-locks-per-ip``), on the
pure table and a fake clock: a grant counts against the address that took it, or that last
reattached it or took it over, for as long as it is held, bound to a connection, to a closed one
or to none; a reattach or take-over that would put an address over its cap is refused, and the
grant stays as it was. The real server's side: tests/server/test_fair_share.py."""

from __future__ import annotations

import itertools

import pytest

from dflockd_server.recorded import RecordedGrant
from dflockd_server.shares import AddressShares
from dflockd_server.table import Client, Holder, LockTable, MaxLocks
from tests.support.clock import FakeClock as Clock
from tests.support.tables import key_state

LEASE = 60
CAP = 3
HERE, THERE = "10.0.0.1", "10.0.0.2"


def make(clock: Clock) -> tuple[LockTable, AddressShares]:
    serial = itertools.count(1)
    table = LockTable(clock=clock, new_token=lambda: f"{next(serial):032x}", max_locks=100)
    shares = table.grants.shares = AddressShares(CAP)
    return table, shares


def connect(table: LockTable, shares: AddressShares, ip: str, *, session: bool = False) -> Client:
    client = table.open_client()
    client.session = session
    shares.opened(client, ip)
    return client


def close(table: LockTable, shares: AddressShares, client: Client, ip: str) -> None:
    table.disconnect(client)
    shares.closed(client, ip)


def take(table: LockTable, client: Client, key: str, *, detached: bool = False) -> Holder:
    got = table.acquire(client, key, LEASE, None, "n", detached, queue=False)
    assert isinstance(got, Holder), got
    return got


def holder_of(table: LockTable, key: str) -> Holder:
    """The lock ``key``'s holder."""
    state = key_state(table, key)
    assert state is not None and state.one is not None
    return state.one


def test_grants_count_against_their_address_whatever_holds_them() -> None:
    clock = Clock()
    table, shares = make(clock)
    here = connect(table, shares, HERE, session=True)
    bound = take(table, here, "a")
    detached = take(table, here, "b", detached=True)
    handed = take(table, here, "c")
    assert table.hand_down("c", handed.token, LEASE)
    assert shares.load(HERE) == 3
    close(table, shares, here, HERE)  # a session: its grant is kept for the session's time
    assert table.is_busy("a")
    assert shares.load(HERE) == 3
    # Another connection of the address reattaches by token: the same address, no change.
    again = connect(table, shares, HERE)
    assert table.renew("a", bound.token, LEASE, again) == LEASE
    assert table.take(again, "b", detached.token, LEASE, note="n", on_close=None) is not None
    assert shares.load(HERE) == 3
    # Every end counts them out; a closed client is forgotten with its last grant.
    assert table.release("a", bound.token)
    assert table.release("b", detached.token)
    clock.now += LEASE + 1
    table.expire()
    assert shares.load(HERE) == 0
    close(table, shares, again, HERE)
    assert shares.held == {} and shares.ip_of == {} and shares.clients == {}
    assert shares.detached == {}


def test_a_reattach_or_take_over_past_the_cap_is_refused_and_the_grant_stays() -> None:
    clock = Clock()
    table, shares = make(clock)
    there = connect(table, shares, THERE, session=True)
    theirs = take(table, there, "theirs")
    hold = take(table, there, "hold", detached=True)
    close(table, shares, there, THERE)
    here = connect(table, shares, HERE)
    for i in range(CAP):
        take(table, here, f"mine-{i}")
    assert shares.load(HERE) == CAP
    ends = key_state(table, "theirs")
    assert ends is not None
    with pytest.raises(MaxLocks):
        table.renew("theirs", theirs.token, LEASE, here)
    with pytest.raises(MaxLocks):
        table.take(here, "hold", hold.token, LEASE, note="n", on_close=None)
    # Nothing changed: the grants are held as they were, by the other address.
    assert (shares.load(HERE), shares.load(THERE)) == (CAP, 2)
    kept = key_state(table, "theirs")
    assert kept is not None
    assert kept.holders[theirs.token].client is there
    assert kept.earliest == ends.earliest
    assert table.is_detached(holder_of(table, "hold"))
    # Below the cap, the same reattach moves the grant to this address.
    assert table.release("mine-0", holder_of(table, "mine-0").token)
    assert table.renew("theirs", theirs.token, LEASE, here) == LEASE
    assert (shares.load(HERE), shares.load(THERE)) == (CAP, 1)


def test_restored_grants_belong_to_no_address_until_reattached() -> None:
    clock = Clock()
    table, shares = make(clock)
    token = f"{1 << 40:032x}"
    restored = table.restore(
        RecordedGrant(token, "old", 1, False, LEASE, 0, False, None, None), LEASE, clock()
    )
    assert restored is not None
    here = connect(table, shares, HERE)
    assert shares.load(HERE) == 0
    for i in range(CAP):
        take(table, here, f"mine-{i}")
    with pytest.raises(MaxLocks):
        table.renew("old", token, LEASE, here)
    assert holder_of(table, "old").client is table.grants.restored
    assert table.release("mine-0", holder_of(table, "mine-0").token)
    assert table.renew("old", token, LEASE, here) == LEASE
    assert shares.load(HERE) == CAP


def test_a_waiters_grant_and_a_detached_hold_count_against_the_waiting_address() -> None:
    clock = Clock()
    table, shares = make(clock)
    there = connect(table, shares, THERE)
    first = take(table, there, "k")
    here = connect(table, shares, HERE)
    waiter = table.acquire(here, "k", LEASE, None, "n", True, queue=True)
    assert waiter is not None and not isinstance(waiter, Holder)
    assert (shares.load(HERE), shares.load(THERE)) == (1, 1)  # its wait counts
    assert table.release("k", first.token)
    assert waiter.holder is not None and table.is_detached(waiter.holder)
    assert (shares.load(HERE), shares.load(THERE)) == (1, 0)  # now its grant, detached
    close(table, shares, here, HERE)
    assert shares.load(HERE) == 1
    assert table.release("k", waiter.holder.token)
    assert shares.held == {} and shares.detached == {}
