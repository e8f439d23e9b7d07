"""Ask tickets (issue 48), pure: a ticket is admitted for exactly the key, shard, members and
move it was issued for, until it expires, and names the issuer's counter."""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import pytest

from dflockd_server import conditions
from dflockd_server.cluster.asktickets import (
    TICKET_LIFE_S,
    AskedKey,
    AskTickets,
    Ticket,
    new_secret,
)
from dflockd_server.cluster.clockskew import ClockSkew
from dflockd_server.cluster.membership import ClusterView
from dflockd_server.cluster.shardmap import SHARD_COUNT, ShardAssignment, ShardMap, shard_id
from dflockd_server.cluster.snapshot import ClusterOwnership
from dflockd_server.fence import FileCeilingStore, fence_of
from dflockd_server.protocol import REPLY_ERROR
from dflockd_server.tokens import FenceCounter

NOW = 1_800_000_000.0
ASKED = AskedKey("job:7", 42, "10.0.0.1:6388", "10.0.0.2:6388")


def check(tickets: AskTickets, ticket: str, asked: AskedKey, *, now: float) -> Ticket | None:
    """The ticket's content when it is genuine for ``asked`` and unexpired at ``now``."""
    got = tickets.genuine(ticket, asked)
    return None if got is None or now > got.expires else got


def test_a_ticket_is_admitted_for_its_own_key_and_move_only() -> None:
    tickets = AskTickets(new_secret())
    ticket = tickets.issue(ASKED, revision=901, floor=12345, now=NOW)
    got = check(tickets, ticket, ASKED, now=NOW + 1)
    assert got is not None and (got.revision, got.floor) == (901, 12345)
    others = [
        AskedKey("job:8", 42, ASKED.current, ASKED.split),
        AskedKey(ASKED.key, 43, ASKED.current, ASKED.split),
        AskedKey(ASKED.key, 42, "10.0.0.3:6388", ASKED.split),
        AskedKey(ASKED.key, 42, ASKED.current, "10.0.0.3:6388"),
    ]
    for other in others:
        assert check(tickets, ticket, other, now=NOW) is None, other
    assert check(tickets, ticket, ASKED, now=NOW + TICKET_LIFE_S + 1) is None  # expired
    assert check(AskTickets(new_secret()), ticket, ASKED, now=NOW) is None  # another cluster


def test_a_changed_or_malformed_ticket_is_refused() -> None:
    tickets = AskTickets(new_secret())
    revision, expires, floor, mac = tickets.issue(ASKED, revision=9, floor=7, now=NOW).split(".")
    for bad in (
        f"{revision}.{expires}.{int(floor, 16) + 1:x}.{mac}",  # a higher counter claimed
        f"a.{expires}.{floor}.{mac}",  # another move
        f"{revision}.{int(expires, 16) + 600:x}.{floor}.{mac}",  # a longer life
        f"{revision}.{expires}.{floor}.{'0' * len(mac)}",
        f"{revision}.{expires}.{floor}",
        "_",
        "",
        f"{revision}.{expires}.-1.{mac}",
        f"{revision}.{expires}.zz.{mac}",
    ):
        assert check(tickets, bad, ASKED, now=NOW) is None, bad


def test_the_importing_member_raises_its_counter_above_a_tickets_floor(tmp_path: Path) -> None:
    """On the loop at once while the floor is below the stored ceiling (no store write);
    above it, not there (the node's thread stores a higher ceiling first): the next token is
    above the floor either way once it returned True."""
    counter = FenceCounter(
        store=FileCeilingStore(str(tmp_path / "fence")),
        wall_clock_ns=lambda: 1_000,
        persist_block=1_000,
    )
    assert counter.ceiling == 2_000
    assert counter.raise_within(500)  # already above
    assert counter.raise_within(1_500)
    assert fence_of(counter.next_token()) == 1_501
    assert not counter.raise_within(2_500)  # would need the store: left to raise_to
    assert fence_of(counter.next_token()) == 1_502
    counter.raise_to(2_500)
    assert fence_of(counter.next_token()) == 2_501 and counter.ceiling == 3_500


def test_a_member_whose_clock_is_off_says_so_and_counts_the_stale_tickets(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 73: with the members' clocks 90 s apart, every ticket arrived expired and the
    free keys of a split stayed unavailable for the whole split, seen nowhere. The importing
    member now finds the offset in each genuine ticket: it logs it once, counts the stale
    tickets, and ``clock_off`` is one of its degraded states; all clear at the next ticket
    that shows the clocks agreeing."""
    key = ASKED.key
    shard = shard_id(key)
    asked = AskedKey(key, shard, ASKED.current, ASKED.split)
    tickets = AskTickets(new_secret())
    shard_map = ShardMap({shard: ShardAssignment(ASKED.split, ASKED.current)})
    view = ClusterView(frozenset({ASKED.current, ASKED.split}), None, shard_map, {shard: 901})
    skew = ClockSkew(ASKED.split)
    wall = [NOW + 90.0]  # this member's clock, 90 s ahead of the issuer's
    member = ClusterOwnership(
        ASKED.split,
        view,
        (None,) * SHARD_COUNT,
        math.inf,
        time.monotonic,
        importing=frozenset({shard}),
        tickets=tickets,
        wall=lambda: wall[0],
        clock_seen=skew.seen,
    )
    caplog.set_level(logging.INFO, logger="dflockd_server")
    stale = tickets.issue(asked, revision=901, floor=7, now=NOW)
    assert member.admit_ask(key, stale) == REPLY_ERROR  # expired by this member's clock
    assert member.admit_ask(key, stale) == REPLY_ERROR
    assert (skew.off, skew.stale_tickets, skew.issuer) == (True, 2, ASKED.current)
    assert round(skew.offset_s) == 90
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned  # once, not per ticket
    assert f"wall clock is 90 s ahead of member {ASKED.current}'s" in warned[0]
    said = conditions.clock_off(skew.offset_s, skew.issuer, TICKET_LIFE_S)
    assert (said.name, said.severity) == ("clock_off", conditions.WARNING)
    assert "refused until the split ends" in said.message and "NTP" in said.message
    forged = AskTickets(new_secret()).issue(asked, revision=901, floor=7, now=NOW - 500)
    assert member.admit_ask(key, forged) == REPLY_ERROR  # not genuine: tells nothing
    assert skew.stale_tickets == 2 and round(skew.offset_s) == 90

    wall[0] = NOW + 1.0  # the clocks agree again
    assert member.admit_ask(key, tickets.issue(asked, revision=901, floor=7, now=NOW)) is None
    assert not skew.off and skew.stale_tickets == 2
    assert any("agrees with member" in r.getMessage() for r in caplog.records)
    behind = ClockSkew(ASKED.split)
    behind.seen(-(TICKET_LIFE_S + 30.0), ASKED.current)
    assert behind.off and behind.stale_tickets == 0
