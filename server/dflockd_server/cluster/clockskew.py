"""What a cluster member learns of its wall clock from the ask tickets it is brought.

A client brings an ask ticket within moments, so a genuine ticket's ``Ticket.clock_offset``
is how far the issuer's wall clock and this member's are apart. Past ``TICKET_LIFE_S`` ahead,
every ticket arrives expired (the free keys of a split here are refused for the whole split);
as far behind, tickets live too long. The member warns once when its clock is found off (and
says when it is right again), and reports the offset, the stale tickets and ``clock_off`` in
its metrics and status. Used on the server's loop only: no lock.
"""

from __future__ import annotations

import logging

from dflockd_server.cluster.asktickets import TICKET_LIFE_S

__all__ = ["ClockSkew"]

log = logging.getLogger("dflockd_server")


class ClockSkew:
    """The offset of this member's wall clock from the issuers' of the tickets it checked."""

    __slots__ = ("issuer", "me", "off", "offset_s", "stale_tickets")

    def __init__(self, me: str) -> None:
        self.me = me
        self.offset_s = 0.0  # the last offset seen (positive: this member's clock is ahead)
        self.issuer = ""
        self.off = False  # the last ticket showed the clocks further apart than a ticket lives
        self.stale_tickets = 0  # genuine tickets that arrived expired by this member's clock

    def seen(self, offset_s: float, issuer: str) -> None:
        self.offset_s, self.issuer = offset_s, issuer
        if offset_s > TICKET_LIFE_S:
            self.stale_tickets += 1
        off = abs(offset_s) > TICKET_LIFE_S
        if off and not self.off:
            log.warning(
                "cluster member %s: its wall clock is %.0f s %s member %s's (an ask ticket "
                "lives %d s): %s; sync the members' clocks (NTP)",
                self.me,
                abs(offset_s),
                "ahead of" if offset_s > 0 else "behind",
                issuer,
                TICKET_LIFE_S,
                "every ticket arrives expired, so the free keys of a shard split to this member "
                "are refused for the whole split"
                if offset_s > 0
                else "tickets are admitted here longer than they should be",
            )
        elif self.off and not off:
            log.info(
                "cluster member %s: its wall clock agrees with member %s's again (%.1f s apart)",
                self.me,
                issuer,
                offset_s,
            )
        self.off = off
