"""Ask tickets: the exporting member's signed word that it lets one key go (pure, no I/O).

During a key-level move (a shard *split* from its current member A towards B, ``decide``'s
docstring) B may grant a key of the shard only when A will never grant or renew that key
while the split stands. A answers an acquire of a key it neither holds nor queues with
``error_ask <B> <ticket>``; from then on A never holds or queues that key during this split
(it creates no key of a shard moving out). The ticket is A's proof of that, for one key:

    <revision>.<expires>.<floor>.<mac>      (lowercase hex, dot-separated)

- ``revision``: the shard key's ``mod_revision`` in etcd as A read it (current = A, split = B).
  B admits the ticket only while its own view shows the shard at exactly that revision, with
  current = A and split = B: the same move (a ticket of an earlier split, or of a map A had not
  read yet, is refused; the client asks A again).
- ``expires``: wall-clock seconds (A's clock) after which B refuses it (``TICKET_LIFE_S``).
- ``floor``: A's fencing counter when it answered. Every token A issued for this key is at or
  below it (A grants the key no more), so B raises its own counter above it before it grants:
  a key's fences rise across the move whichever member's counter runs ahead.
- ``mac``: HMAC-SHA256 over the key, the shard, A, B and the three numbers, under the cluster's
  ask secret (``<prefix>/asksecret`` in etcd, created once by a conditional put, read by every
  member when it joins), cut to 128 bits. A client cannot make one up, nor move one to another
  key, member or split.

B answers an ``asking`` without a valid ticket for the key it names ``error`` (the client pauses
and routes by the map again). Clients never build or read a ticket: they pass it along.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

__all__ = ["TICKET_LIFE_S", "AskTickets", "AskedKey", "Ticket", "new_secret"]

TICKET_LIFE_S = 60
"""How long a ticket is admitted (wall clock, seconds): a client follows an ``error_ask`` at
once; a longer life only covers clocks that disagree."""

_MAC_HEX = 32
"""The MAC's length in the ticket (128 bits, hex)."""

SECRET_BYTES = 32


def new_secret() -> str:
    """A fresh cluster ask secret (hex), for the one conditional put that creates it."""
    return secrets.token_hex(SECRET_BYTES)


@dataclass(frozen=True, slots=True)
class AskedKey:
    """The key a ticket is for, and the move it is of: ``shard`` split from ``current``
    towards ``split``."""

    key: str
    shard: int
    current: str
    split: str


@dataclass(frozen=True, slots=True)
class Ticket:
    """What an admitted ticket says."""

    revision: int
    expires: int
    floor: int

    def clock_offset(self, now: float) -> float:
        """How far ``now`` (the checking member's wall clock) is past the moment the issuer's
        clock said when it made the ticket. A client brings it within moments of its
        ``error_ask``, so past a few seconds this is how far the two members' clocks are
        apart (positive: the checking member's is ahead); past ``TICKET_LIFE_S``, every ticket
        arrives expired and the keys of a split wait for its end."""
        return now - (self.expires - TICKET_LIFE_S)


class AskTickets:
    """Issues and checks the tickets of one cluster (its ask secret)."""

    __slots__ = ("_key",)

    def __init__(self, secret: str) -> None:
        if len(secret) < 32:
            raise ValueError("the cluster's ask secret in etcd is too short; delete it")
        self._key = secret.encode()

    def _mac(self, asked: AskedKey, revision: int, expires: int, floor: int) -> str:
        message = (
            f"{asked.key}\n{asked.shard}\n{asked.current}\n{asked.split}\n"
            f"{revision:x}\n{expires:x}\n{floor:x}"
        )
        return hmac.new(self._key, message.encode(), hashlib.sha256).hexdigest()[:_MAC_HEX]

    def issue(self, asked: AskedKey, *, revision: int, floor: int, now: float) -> str:
        """A ticket for ``asked`` (split at ``revision``), with ``floor`` above every token
        its current member issued for the key."""
        expires = int(now) + TICKET_LIFE_S
        mac = self._mac(asked, revision, expires, floor)
        return f"{revision:x}.{expires:x}.{floor:x}.{mac}"

    def check(self, ticket: str, asked: AskedKey, *, now: float) -> Ticket | None:
        """The ticket's content when it is genuine for exactly this key and move and has not
        expired (the caller compares ``revision`` with its view); None otherwise."""
        got = self.genuine(ticket, asked)
        if got is None or now > got.expires:
            return None
        return got

    def genuine(self, ticket: str, asked: AskedKey) -> Ticket | None:
        """The ticket's content when its issuer made it for exactly this key and move, expired
        or not; None otherwise."""
        parts = ticket.split(".")
        if len(parts) != 4 or len(parts[3]) != _MAC_HEX:
            return None
        try:
            revision, expires, floor = (int(part, 16) for part in parts[:3])
        except ValueError:
            return None
        if min(revision, expires, floor) < 0:
            return None
        if not hmac.compare_digest(self._mac(asked, revision, expires, floor), parts[3]):
            return None
        return Ticket(revision, expires, floor)
