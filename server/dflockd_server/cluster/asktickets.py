"""Ask tickets (pure): the exporting member's signed word that it lets one key go.

During a key-level move (docs/protocol.md, *Key-level moves*: the ticket's fields, and when the
split's node admits one) the shard's current member A answers an acquire of a key it neither
holds nor queues ``error_ask <B> <ticket>`` and never holds or queues that key again during the
split; B grants the key only against that ticket, so the two never grant it both. The MAC
(HMAC-SHA256 under the cluster's ask secret, ``<prefix>/asksecret``, cut to 128 bits) covers the
key, shard, A, B and the ticket's revision (the move), expiry and fence floor: a client can
neither forge a ticket nor move it to another key, member or split; clients only pass it along.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from dataclasses import dataclass

__all__ = ["TICKET_LIFE_S", "AskTickets", "AskedKey", "Ticket", "new_secret"]

TICKET_LIFE_S = 60  # wall-clock s; a ticket is used at once, the rest covers clocks apart

_MAC_HEX = 32


def new_secret() -> str:
    return secrets.token_hex(32)


@dataclass(frozen=True, slots=True)
class AskedKey:
    """The key a ticket is for: ``shard`` split from ``current`` towards ``split``."""

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
        """How far ``now`` is past the issuer's clock when it made the ticket: beyond a few
        seconds, how far the two members' clocks are apart (positive: ``now``'s is ahead)."""
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
        expires = int(now) + TICKET_LIFE_S
        return f"{revision:x}.{expires:x}.{floor:x}.{self._mac(asked, revision, expires, floor)}"

    def genuine(self, ticket: str, asked: AskedKey) -> Ticket | None:
        """The ticket's content when made for exactly this key and move, expired or not."""
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
