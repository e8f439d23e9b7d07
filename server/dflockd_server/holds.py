"""The lock table's hold book: whom a grant is bound to, and the owner note it carries.

A grant is one ``Holder`` whoever keeps it alive: a connection (until its close ends it, or,
for a session, cuts its lease short), no connection (a detached hold, ``hl`` mode ``d`` or
``hd``: it belongs to the grants' ``detached`` client, which no close releases), or nobody yet
(restored from the journal: the ``restored`` client's, until a connection renews it). The hold
book reads and replaces the owner note (``note``), takes a detached grant over for a connection
(``ht``, with the ``<onclose>`` lease it is detached with again when that connection closes)
and binds a grant whose connection is gone to the one that renews it (a reattach by token).
The table (``table.LockTable``) owns one and answers those requests through it; granting a
hold (``hl``) is an acquire with a note, and rebinding a grant is ``grants.Grants.move``. Pure
state, no I/O, as the rest of the table.
"""

from __future__ import annotations

from dflockd_server.grants import CLIENT_COMPACT_MIN, Grants
from dflockd_server.keys import Bound, Client, Holder

__all__ = ["HoldBook", "detach_at_close"]


def detach_at_close(client: Client, holder: Holder, lease_ttl: int) -> None:
    """When ``client`` closes, detach ``holder`` with a lease of ``lease_ttl`` instead of
    releasing it (``ht``'s ``<onclose>``); entries of released holders are pruned as the map
    grows."""
    leases = client.on_close
    if leases is None:
        leases = client.on_close = {}
    elif len(leases) > 2 * client.n_held + CLIENT_COMPACT_MIN:
        for gone in [h for h in leases if not h.live]:
            del leases[gone]
    leases[holder] = lease_ttl


class HoldBook:
    """The owners and owner notes of the grants of ``grants`` (see the module's doc)."""

    __slots__ = ("grants",)

    def __init__(self, grants: Grants) -> None:
        self.grants = grants

    def holder_note(self, key: str) -> str | None:
        """The owner note of the lock ``key``'s holder (``None``: no holder, or it gave none)."""
        entry = self.grants.keys.get(key)
        if entry is None:
            return None
        if isinstance(entry, Holder):
            return entry.note if entry.live else None
        one = entry.one
        return one.note if one is not None else None

    def set_note(self, key: str, token: str, note: str) -> bool:
        """``note``: replace the owner note of the grant ``token`` holds on ``key``; ``False``
        if it holds none."""
        grants = self.grants
        holder = grants.holder_of(key, token)
        if holder is None:
            return False
        holder.note = note
        journal = grants.journal
        if journal is not None:
            journal.note(token, note)
        return True

    def is_detached(self, holder: Holder) -> bool:
        """Whether the grant is bound to no live connection: a detached hold, or (without
        auto-release) a grant whose connection has closed, unless a client session keeps it."""
        owner = holder.client
        return owner is self.grants.detached or (owner.closed and owner.kept_by is None)

    def take(
        self,
        client: Client,
        key: str,
        token: str,
        lease_ttl: int,
        *,
        note: str,
        on_close: int | None,
    ) -> Holder | None:
        """``ht``: bind the detached grant ``token`` holds on the lock ``key`` to ``client``
        (same token, so same fence), with the lease ``lease_ttl`` from now and the note
        ``note``. When ``client`` closes the grant is released as any of its grants
        (``on_close`` ``None``) or detached again with a lease of ``on_close`` seconds from
        then. ``None`` if ``token`` holds no lock on ``key``; raises ``Bound`` if the grant is
        bound to a live connection (this one included), ``MaxLocks`` if ``client`` is at its
        cap, or its address at its own (``shares.AddressShares.check_rebind``)."""
        grants = self.grants
        holder = grants.holder_of(key, token)
        if holder is None or not grants.is_lock_grant(holder):
            return None
        if not self.is_detached(holder):
            raise Bound(key, holder.note)
        if grants.max_locks_per_connection:
            grants.check_client_locks(client, key, None)
        shares = grants.shares
        if shares is not None:
            shares.check_rebind(holder, client, len(grants.keys))
        longest = max(lease_ttl, on_close or 0)
        if longest > grants.lease_noted:
            grants.raise_bound(longest, key)  # the close's lease too: a disconnect must not fail
        holder.note = note
        taken = grants.move(holder, client, lease_ttl, grants.clock(), on_close)
        if on_close is not None:
            detach_at_close(client, taken, on_close)
        return taken

    def reattach(self, holder: Holder, client: Client, lease_ttl: int, now: float) -> None:
        """A grant whose connection is gone (restored from the journal, or its connection
        closed) is renewed on a connection: bind the grant to it, so its close ends the
        grant as that connection's, with the ``<onclose>`` lease it had. Raises ``MaxLocks``,
        the grant left as it was, when that adds a grant to an address at its cap
        (``shares.AddressShares.check_rebind``)."""
        grants = self.grants
        shares = grants.shares
        if shares is not None:
            shares.check_rebind(holder, client, len(grants.keys))
        restored = holder.client.on_close
        on_close = restored.pop(holder, None) if restored else None
        moved = grants.move(holder, client, lease_ttl, now, on_close)
        if on_close is not None:
            detach_at_close(client, moved, on_close)
