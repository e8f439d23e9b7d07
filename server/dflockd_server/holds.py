"""The lock table's holds with an owner note (``hl``, ``note``, ``ht``; ``hd`` is in
``table``, beside the renewal it makes of a detached grant): granting a lock with a note,
bound to the connection or detached (owned by the table's ``detached`` client, which no
connection's close releases), reading and replacing the note, taking a detached grant over
and rebinding a grant to another owner (``_move``, also what a close's ``<onclose>`` detach
does). Pure state, no I/O, as the rest of the table.
"""

from __future__ import annotations

from dflockd_server.keys import Bound, Client, Entry, Holder, Waiter
from dflockd_server.tablecore import CLIENT_COMPACT_MIN, TableCore

__all__ = ["HoldTable"]


class HoldTable(TableCore):
    """The table's mechanics and its holds with an owner note (``table.LockTable`` adds the
    other operations)."""

    def hold(
        self, client: Client, key: str, lease_ttl: int, note: str, *, detached: bool, queue: bool
    ) -> Holder | Waiter | None:
        """``hl``: acquire the lock ``key`` (limit 1, the FIFO queue ``acquire`` uses) with the
        owner note ``note``, as ``acquire`` does otherwise. A ``detached`` grant belongs to the
        table's ``detached`` client, not to ``client``: closing ``client`` does not free it
        (a wait of ``client`` is dropped as any wait is)."""
        now = self.clock()
        try:
            if self.in_grace:
                self._in_grace(now)
            owner = self.detached if detached else client
            holder = self._grant_bare(key, client, owner, lease_ttl, now, note=note)
            if holder is not None:
                return holder
            if not queue and self._held_alone(key):
                self.counts.timeouts[0] += 1  # answered without making the key a state
                return None
            state = self._state_for(key, None, now)
            if state.n_held < state.limit and state.n_waiting == 0 and not self.in_grace:
                if self.max_locks_per_connection:
                    self._check_client_locks(client, key, state)
                return self._grant(state, owner, lease_ttl, now, note)
            if not queue:
                self.counts.timeouts[state.is_sem] += 1
                self._idle.note(self.keys, state)  # a key new in the grace is idle: prunable
                return None
            if self.max_waits_per_connection:
                self._check_client_waits(client, key, state)
            if self.max_locks_per_connection:
                self._check_client_locks(client, key, state)
            waiter = self._queue(state, client, lease_ttl)
            waiter.note = note
            waiter.detached = detached
            return waiter
        finally:
            if self._wakes:
                self._flush()

    def holder_note(self, key: str) -> str | None:
        """The owner note of the lock ``key``'s holder (``None``: no holder, or it gave none)."""
        entry = self.keys.get(key)
        if entry is None:
            return None
        if isinstance(entry, Holder):
            return entry.note if entry.live else None
        one = entry.one
        return one.note if one is not None else None

    def set_note(self, key: str, token: str, note: str) -> bool:
        """``note``: replace the owner note of the grant ``token`` holds on ``key``; ``False``
        if it holds none."""
        holder = self._holder_of(key, token)
        if holder is None:
            return False
        holder.note = note
        if self.journal is not None:
            self.journal.note(token, note)
        return True

    def is_detached(self, holder: Holder) -> bool:
        """Whether the grant is bound to no live connection: a detached hold, or (without
        auto-release) a grant whose connection has closed."""
        owner = holder.client
        return owner is self.detached or owner.closed

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
        cap."""
        holder = self._holder_of(key, token)
        if holder is None or not self._is_lock_grant(holder):
            return None
        if not self.is_detached(holder):
            raise Bound(key, holder.note)
        if self.max_locks_per_connection:
            self._check_client_locks(client, key, None)
        longest = max(lease_ttl, on_close or 0)
        if longest > self.lease_noted:
            self._note(longest, key)  # the close's lease too: a disconnect must not fail
        holder.note = note
        taken = self._move(holder, client, lease_ttl, self.clock(), on_close)
        if on_close is not None:
            self._detach_at_close(client, taken, on_close)
        return taken

    @staticmethod
    def _detach_at_close(client: Client, holder: Holder, lease_ttl: int) -> None:
        """When ``client`` closes, detach ``holder`` with a lease of ``lease_ttl`` instead of
        releasing it (``ht``'s ``<onclose>``); entries of released holders are pruned as the
        map grows."""
        leases = client.on_close
        if leases is None:
            leases = client.on_close = {}
        elif len(leases) > 2 * client.n_held + CLIENT_COMPACT_MIN:
            for gone in [h for h in leases if not h.live]:
                del leases[gone]
        leases[holder] = lease_ttl

    def _move(
        self,
        holder: Holder,
        client: Client,
        lease_ttl: int,
        now: float,
        on_close: int | None = None,
    ) -> Holder:
        """Rebind the grant ``holder`` to ``client`` with the lease ``lease_ttl`` from
        ``now``: a new ``Holder`` (same token and note) takes its place, and the old one is
        dropped from its client's view as a released one is (no count changes: nothing is
        granted or released). ``on_close``: the lease it is detached with when ``client``
        closes (recorded in the journal; the caller keeps it in ``client.on_close``)."""
        old = holder.client
        holder.live = False
        old.n_held -= 1
        held = old.held
        while held and not held[-1].live:
            held.pop()
        if len(held) > 2 * old.n_held + CLIENT_COMPACT_MIN:
            old.held = [h for h in held if h.live]
        if old.on_close:
            old.on_close.pop(holder, None)
        state = self._state_of(holder)
        expires_at = now + lease_ttl
        moved = Holder(holder.token, holder.key, client, lease_ttl, expires_at, since=holder.since)
        moved.note = holder.note
        journal = self.journal
        if journal is not None:
            moved.covered = journal.move(
                holder.token,
                detached=client is self.detached,
                on_close=on_close,
                lease_ttl=lease_ttl,
                expires_at=expires_at,
                note=moved.note,
            )
        if state is None:
            self.keys[holder.key] = moved
        elif state.limit == 1:
            state.one = moved
            state.earliest = expires_at
            state.last_used = expires_at  # not read while held (see KeyState)
        else:
            assert state.many is not None
            state.many[holder.token] = moved
            state.earliest = min(h.expires_at for h in state.many.values())
            state.last_used = expires_at
        client.held.append(moved)
        client.n_held += 1
        self._leases.add(moved, expires_at, lease_ttl)
        return moved

    def _holder_of(self, key: str, token: str) -> Holder | None:
        """The live grant ``token`` holds on ``key`` (leases checked first), or ``None``."""
        entry = self.keys.get(key)
        if entry is None:
            return None
        return self._live_holder(entry, token, self.clock())

    def _live_holder(self, entry: Entry, token: str, now: float) -> Holder | None:
        """The grant ``token`` holds on the key of ``entry`` once its leases due by ``now``
        have run out (their waiters woken), or ``None``."""
        if isinstance(entry, Holder):  # a lock nobody waits for
            if not entry.live:
                return None
            if now >= entry.expires_at:
                self._expire_bare(entry, now)
                return None
            return entry if entry.token == token else None
        state = entry
        if now >= state.earliest:
            self._check(state, now)
            self._flush()
        holder = state.one
        if holder is None or holder.token != token:
            holder = state.many.get(token) if state.many else None
        return holder

    def _is_lock_grant(self, holder: Holder) -> bool:
        """Whether the live ``holder`` is the grant of a key of limit 1 (a lock's)."""
        state = self._state_of(holder)
        return state is None or state.one is holder
