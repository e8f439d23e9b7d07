"""Ask tickets (issue 48), pure: a ticket is admitted for exactly the key, shard, members and
move it was issued for, until it expires, and names the issuer's counter."""

from __future__ import annotations

from pathlib import Path

from dflockd_server.cluster.asktickets import TICKET_LIFE_S, AskedKey, AskTickets, new_secret
from dflockd_server.fence import fence_of
from dflockd_server.tokens import FenceCounter

NOW = 1_800_000_000.0
ASKED = AskedKey("job:7", 42, "10.0.0.1:6388", "10.0.0.2:6388")


def test_a_ticket_is_admitted_for_its_own_key_and_move_only() -> None:
    tickets = AskTickets(new_secret())
    ticket = tickets.issue(ASKED, revision=901, floor=12345, now=NOW)
    got = tickets.check(ticket, ASKED, now=NOW + 1)
    assert got is not None and (got.revision, got.floor) == (901, 12345)
    others = [
        AskedKey("job:8", 42, ASKED.current, ASKED.split),
        AskedKey(ASKED.key, 43, ASKED.current, ASKED.split),
        AskedKey(ASKED.key, 42, "10.0.0.3:6388", ASKED.split),
        AskedKey(ASKED.key, 42, ASKED.current, "10.0.0.3:6388"),
    ]
    for other in others:
        assert tickets.check(ticket, other, now=NOW) is None, other
    assert tickets.check(ticket, ASKED, now=NOW + TICKET_LIFE_S + 1) is None  # expired
    assert AskTickets(new_secret()).check(ticket, ASKED, now=NOW) is None  # another cluster


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
        assert tickets.check(bad, ASKED, now=NOW) is None, bad


def test_the_importing_member_raises_its_counter_above_a_tickets_floor(tmp_path: Path) -> None:
    """On the loop at once while the floor is below the stored ceiling (no store write);
    above it, not there (the node's thread stores a higher ceiling first): the next token is
    above the floor either way once it returned True."""
    counter = FenceCounter(
        str(tmp_path / "fence"), wall_clock_ns=lambda: 1_000, persist_block=1_000
    )
    assert counter.ceiling == 2_000
    assert counter.raise_within(500)  # already above
    assert counter.raise_within(1_500)
    assert fence_of(counter.next_token()) == 1_501
    assert not counter.raise_within(2_500)  # would need the store: left to raise_to
    assert fence_of(counter.next_token()) == 1_502
    counter.raise_to(2_500)
    assert fence_of(counter.next_token()) == 2_501 and counter.ceiling == 3_500
