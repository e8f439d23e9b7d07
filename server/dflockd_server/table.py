"""The lock table: locks and semaphores, FIFO queues, leases. Pure state, no I/O.

A key is one resource, as in dflockd Go: a lock is a semaphore of limit 1. The first acquire on
an idle key fixes its limit and kind; an acquire with another limit while the key has holders or
waiters is refused (``LimitMismatch``). Renew and release take any token of the key, whichever
command granted it. Clock and token generator are injected, so tests drive the table step by
step; a waiter granted later is announced through its ``wake`` callback once the table has
finished changing.

A table made with ``grace_s > 0`` is in its restart grace until ``clock() + grace_s``: every
key counts as busy, and the waiters are granted, in order, once the grace is over. Before a
lease longer than ``lease_noted`` is granted or renewed, ``note_lease`` is called (it persists
the bound the next start's grace relies on) and may refuse by raising.

A grant is one ``Holder`` whoever keeps it alive: a connection, no connection (a detached hold,
``hl`` mode ``d`` or ``hd``: the ``detached`` client's), or nobody yet (restored from the
journal: the ``restored`` client's, until a connection renews it by token). ``ht`` takes a
detached grant over for a connection, with the ``<onclose>`` lease it is detached with again
when that connection closes.

``LockTable`` is the table's face; the state and steps are its ``grants.Grants``, the records
are in ``keys``, the expiry index and idle log in ``leases``."""

from __future__ import annotations

import itertools
import math
import operator
from collections.abc import Callable, Iterator
from typing import Any

from dflockd_server.constants import TOKEN_HEX_CHARS
from dflockd_server.fence import fence_of
from dflockd_server.grants import Grants
from dflockd_server.journal import Journal, RecordedGrant
from dflockd_server.keys import (
    AlreadyEnqueued,
    Bound,
    Client,
    ClientSession,
    Entry,
    Holder,
    KeyState,
    LimitMismatch,
    MaxLocks,
    MaxWaiters,
    Waiter,
)
from dflockd_server.leases import COMPACT_MIN

__all__ = ["AlreadyEnqueued", "Bound", "Client", "ClientSession", "Entry", "Holder", "KeyState",
           "LimitMismatch", "LockTable", "MaxLocks", "MaxWaiters", "Waiter"]  # fmt: skip


def _run_of(holder: Holder, now: float) -> int:
    """The lease index's run of a grant restored at ``now``: its lease's, or, if it runs longer
    than its lease (the journal covers a lease ahead; a restart across a boot gives each grant
    the longest lease recorded), its time left rounded up: a run stays in expiry order only if
    every grant of that length made later ends after it."""
    return max(holder.lease_ttl, math.ceil(holder.expires_at - now))


def _grants_of(session: ClientSession) -> Iterator[Holder]:
    """The live grants the connections of ``session`` hold, each its own."""
    for client in session.clients:
        yield from (h for h in client.held if h.live and h.client is client)


class LockTable:
    """All locks and semaphores of one server."""

    def __init__(
        self,
        *,
        clock: Callable[[], float],
        new_token: Callable[[], str],
        max_locks: int,
        max_waiters: int = 0,
        max_locks_per_connection: int = 0,
        max_waits_per_connection: int = 0,
        auto_release_on_disconnect: bool = True,
        session_ttl_s: int = 3,
        grace_s: float = 0.0,
        note_lease: Callable[[int], int] | None = None,
        lease_noted: int = 0,
        journal: Journal | None = None,
    ) -> None:
        self.clock = clock
        self.auto_release_on_disconnect = auto_release_on_disconnect
        self.session_ttl_s = session_ttl_s
        self.grants = Grants(
            clock=clock,
            new_token=new_token,
            max_locks=max_locks,
            max_waiters=max_waiters,
            max_locks_per_connection=max_locks_per_connection,
            max_waits_per_connection=max_waits_per_connection,
            grace_s=grace_s,
            journal=journal,
            note_lease=note_lease,
            lease_noted=lease_noted,
        )
        self._next_client_id = 0
        self.sessions: dict[str, ClientSession] = {}

    def grace_remaining(self) -> float:
        """Seconds of restart grace left (0 once over); ends the grace when it is due."""
        grants = self.grants
        if not grants.in_grace:
            return 0.0
        now = self.clock()
        if grants.in_grace_at(now):
            return grants.grace_until - now
        grants.flush()
        return 0.0

    def open_client(self) -> Client:
        self._next_client_id += 1
        return Client(self._next_client_id)

    def join_session(self, client: Client, session_id: str, ttl: int) -> None:
        """``hello _ session <id> <ttl>``: ``client`` joins the session (made if none, or if
        run out), which lives ``ttl`` seconds from now unless kept alive. A connection of
        another session leaves it, with its grants (ended first if that session ran out)."""
        now = self.clock()
        session = self.sessions.get(session_id)
        if session is not None and session.expires_at <= now:
            self._end_session_of(session, now)
            session = None
        if session is None:
            session = self.sessions[session_id] = ClientSession(session_id, ttl, now + ttl)
        else:
            session.ttl = ttl
            session.expires_at = max(session.expires_at, now + ttl)
        if (old := client.kept_by) is session:
            return
        if old is not None and old.expires_at <= now:
            self._end_session_of(old, now)
        elif old is not None:
            self._leave(old, client)
        client.kept_by = session
        session.clients.append(client)

    def end_session(self, session_id: str) -> None:
        """``hello _ session <id> 0``: the session ends now."""
        if (session := self.sessions.get(session_id)) is not None:
            self._end_session_of(session, self.clock())

    def keep_alive(self, session_id: str, may_hold: Callable[[str], bool] | None = None) -> bool:
        """``ping _ session <id>``: the session lives ``ttl`` seconds more from now, and each
        of its grants its own lease. ``False`` when there is no such session, or when
        ``may_hold`` refuses the key of one of its grants (a fenced cluster member renews
        nothing): then nothing is renewed, and the holder learns the loss."""
        if (session := self.sessions.get(session_id)) is None:
            return False
        now = self.clock()
        if session.expires_at <= now:
            self._end_session_of(session, now)
            return False
        if may_hold is not None and not all(may_hold(h.key) for h in _grants_of(session)):
            return False
        session.expires_at = now + session.ttl
        keys = self.grants.keys
        for holder in _grants_of(session):
            ttl = holder.lease_ttl
            if now + ttl > holder.expires_at:
                self._extend(holder, keys[holder.key], ttl, now + ttl, ahead=True)
        # without the closed connections that hold nothing
        session.clients = [c for c in session.clients if c.n_held or not c.closed]
        if not session.clients:
            del self.sessions[session_id]  # it keeps nothing alive
        return True

    def session_keys(self, session_id: str) -> list[str]:
        """The keys the live grants of session ``session_id`` hold (none: no such session)."""
        session = self.sessions.get(session_id)
        return [] if session is None else [h.key for h in _grants_of(session)]

    def _leave(self, session: ClientSession, client: Client) -> None:
        """``client`` leaves ``session`` (with its grants, if any); a session left with no
        connection (so no grant) is forgotten: a keep-alive for it is refused."""
        session.clients.remove(client)
        client.kept_by = None
        if not session.clients:
            del self.sessions[session.id]

    def _end_session_of(self, session: ClientSession, now: float) -> None:
        """The session ends: with auto-release on, so does every grant of its connections. Its
        open connections go on alone."""
        del self.sessions[session.id]
        ending = list(_grants_of(session))
        for client in session.clients:
            client.kept_by = None
        session.clients = []
        if self.auto_release_on_disconnect:
            # Listed before any is freed: a key freed may go to a connection of this session.
            self._lose(ending, now)
        self.grants.flush()

    def _lose(self, holders: list[Holder], now: float) -> None:
        """End those of ``holders`` still live, as lost by a disconnect, handing their slots on."""
        grants = self.grants
        lost = grants.counts.lost_by_disconnect
        for holder in holders:
            if holder.live:
                state = grants.state_of(holder)
                grants.free_holder(holder, state, now, lost)
                if state is not None:
                    grants.fill(state, now)

    def disconnect(self, client: Client, *, by_peer: bool = True) -> None:
        """The connection is gone: drop its waits, detach the grants it took over with ``ht``
        and an ``<onclose>`` lease, and end the rest as docs/protocol.md says ("Tokens, leases
        and disconnects"). ``by_peer``: the peer closed it; False: this server did, which frees
        nothing early. With auto-release on, a peer's close frees a plain connection's grants
        at once and cuts a session connection's to end at most ``session_ttl_s`` from now, so
        its client, counting the same time from before, knows of the loss first."""
        grants = self.grants
        now = self.clock()
        client.closed = True
        for waiter in list(client.waiting):
            grants.unqueue(waiter, now)
        client.waiting.clear()
        client.enqueued.clear()
        if on_close := client.on_close:
            client.on_close = None
            for holder, lease_ttl in on_close.items():
                if holder.live:
                    grants.move(holder, grants.detached, lease_ttl, now)
        if (kept := client.kept_by) is not None:
            if not client.n_held:
                self._leave(kept, client)
        elif by_peer and self.auto_release_on_disconnect:
            if not client.session:
                self._lose(list(client.held), now)
            else:  # a session connection: each grant ends by ``session_ttl_s``
                end = now + self.session_ttl_s
                for holder in client.held:
                    if holder.live and holder.expires_at > end:
                        holder.pin_since()
                        holder.expires_at = end
                        state = grants.state_of(holder)
                        if state is not None and end < state.earliest:
                            state.earliest = end
                        grants.leases.add(holder, end, self.session_ttl_s)
        grants.flush()

    def acquire(  # noqa: PLR0917 - positional: the hot path's calls pass no keywords
        self,
        client: Client,
        key: str,
        lease_ttl: int,
        limit: int | None,
        note: str | None = None,
        detached: bool = False,
        *,
        queue: bool,
    ) -> Holder | Waiter | None:
        """Grant at once (a ``Holder``), queue (a ``Waiter``, if ``queue``), or ``None``; ``limit``
        ``None``: a lock. ``LimitMismatch`` when the key is busy with another limit."""
        grants = self.grants
        now = self.clock()
        try:
            if grants.in_grace:
                grants.in_grace_at(now)  # at its end, the waiters queued during it go first
            owner = grants.detached if detached else client
            if limit is None:
                holder = grants.grant_bare(key, client, owner, lease_ttl, now, note)
                if holder is not None:
                    return holder
                if not queue:
                    entry = grants.keys.get(key)
                    if isinstance(entry, Holder) and entry.live:  # no state made for the answer
                        grants.counts.timeouts[0] += 1
                        return None
            state = grants.state_for(key, limit, now)
            if state.n_held < state.limit and state.n_waiting == 0 and not grants.in_grace:
                if grants.max_locks_per_connection:
                    grants.check_client_locks(client, key, state)
                return grants.grant(state, owner, lease_ttl, now, note, client)
            if not queue:
                grants.counts.timeouts[state.is_sem] += 1
                grants.idle.note(grants.keys, state)  # a key new in the grace is idle: prunable
                return None
            if grants.max_waits_per_connection:
                grants.check_client_waits(client, key, state)
            if grants.max_locks_per_connection:
                grants.check_client_locks(client, key, state)
            waiter = grants.queue(state, client, lease_ttl)
            if note is not None:
                waiter.note = note
                waiter.detached = detached
            return waiter
        finally:
            if grants.wakes:
                grants.flush()

    def hand_down(self, key: str, token: str, lease_ttl: int) -> bool:
        """``hd``: detach the grant ``token`` holds on the lock ``key`` from its connection,
        with ``lease_ttl`` from now; ``False`` if ``token`` holds no lock on ``key``."""
        grants = self.grants
        if (holder := grants.holder_of(key, token)) is None or not grants.is_lock_grant(holder):
            return False
        if holder.client.kept_by is not None and self._session_over(holder, self.clock()):
            return False
        if lease_ttl > grants.lease_noted:
            grants.raise_bound(lease_ttl, key)
        if holder.client is grants.detached:
            return self.renew(key, token, lease_ttl) is not None
        grants.move(holder, grants.detached, lease_ttl, self.clock())
        return True

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
        (same token and fence), with ``lease_ttl`` from now and ``note``. At ``client``'s close
        it is released (``on_close`` ``None``) or detached again for ``on_close`` seconds.
        ``None`` if ``token`` holds no lock on ``key``; raises ``Bound`` if the grant is bound
        to a live connection, ``MaxLocks`` if ``client`` or its address is at its cap."""
        grants = self.grants
        if (holder := grants.holder_of(key, token)) is None or not grants.is_lock_grant(holder):
            return None
        if not self.is_detached(holder):
            raise Bound(key, holder.note)
        if grants.max_locks_per_connection:
            grants.check_client_locks(client, key, None)
        if (shares := grants.shares) is not None:
            shares.check_rebind(holder, client, len(grants.keys))
        if (longest := max(lease_ttl, on_close or 0)) > grants.lease_noted:
            grants.raise_bound(longest, key)  # the close's lease too: a disconnect must not fail
        holder.note = note
        return grants.move(holder, client, lease_ttl, self.clock(), on_close)

    def is_detached(self, holder: Holder) -> bool:
        """Whether the grant is bound to no live connection: a detached hold, or (without
        auto-release) a grant whose connection has closed, unless a client session keeps it."""
        owner = holder.client
        return owner is self.grants.detached or (owner.closed and owner.kept_by is None)

    def holder_note(self, key: str) -> str | None:
        """The owner note of the lock ``key``'s holder, if any."""
        entry = self.grants.keys.get(key)
        holder = entry.one if isinstance(entry, KeyState) else entry  # a state's is live
        return holder.note if holder is not None and holder.live else None

    def set_note(self, key: str, token: str, note: str) -> bool:
        """``note``: replace the owner note of ``token``'s grant on ``key``; ``False`` if none."""
        grants = self.grants
        if (holder := grants.holder_of(key, token)) is None:
            return False
        holder.note = note
        if grants.journal is not None:
            grants.journal.note(token, note)
        return True

    def enqueue(self, client: Client, key: str, lease_ttl: int, limit: int | None) -> Waiter:
        """Two-phase step 1: a waiter, already granted (``holder`` set) or queued."""
        grants = self.grants
        try:
            previous = client.enqueued.get(key)
            now = self.clock()
            if previous is not None:
                if previous.holder is not None:
                    grants.check(previous.state, now)
                if previous.holder is None or previous.holder.live:
                    raise AlreadyEnqueued(key)
                del client.enqueued[key]
            if grants.in_grace:
                grants.in_grace_at(now)
            if grants.max_waits_per_connection:
                grants.check_client_waits(client, key, None)
            if grants.max_locks_per_connection:
                grants.check_client_locks(client, key, None)
            state = grants.state_for(key, limit, now)
            if state.n_held < state.limit and state.n_waiting == 0 and not grants.in_grace:
                waiter = Waiter(client, state, lease_ttl)
                waiter.active = False
                waiter.holder = grants.grant(state, client, lease_ttl, now)
            else:
                waiter = grants.queue(state, client, lease_ttl)
            waiter.enqueued = True
            client.enqueued[key] = waiter
            return waiter
        finally:
            if grants.wakes:
                grants.flush()

    def find_enqueued(self, client: Client, key: str) -> Waiter | None:
        """Two-phase step 2: the client's pending enqueue on ``key`` (leases checked first)."""
        if (waiter := client.enqueued.get(key)) is not None and waiter.holder is not None:
            grants = self.grants
            grants.check(waiter.state, self.clock())
            grants.flush()
        return waiter

    def forget_enqueued(self, waiter: Waiter) -> None:
        """The two-phase wait is over (granted, expired or timed out)."""
        if waiter.enqueued:
            waiter.enqueued = False
            key = waiter.state.key
            if waiter.client.enqueued.get(key) is waiter:
                del waiter.client.enqueued[key]

    def cancel_wait(self, waiter: Waiter) -> None:
        """The waiter gives up (timeout); a granted waiter is left alone."""
        if waiter.active:
            grants = self.grants
            grants.counts.timeouts[waiter.state.is_sem] += 1
            grants.unqueue(waiter, self.clock())
            waiter.client.waiting.discard(waiter)
            self.forget_enqueued(waiter)
            grants.flush()

    def release(self, key: str, token: str) -> bool:
        """Release the slot ``token`` holds on ``key``; ``False`` if it holds none."""
        grants = self.grants
        entry = grants.keys.get(key)
        if entry is None:
            return False
        now = self.clock()
        if isinstance(entry, Holder):  # a lock nobody waits for
            # live_holder per branch, on the narrowed type: compiled, a call on the union costs more
            holder = grants.live_holder(entry, token, now)
            if holder is None:
                return False
            grants.free_holder(holder, None, now, grants.counts.releases)
            return True
        holder = grants.live_holder(entry, token, now)
        if holder is None:
            return False
        grants.free_holder(holder, entry, now, grants.counts.releases)
        if entry.queue is not None:
            grants.fill(entry, now)
        if grants.wakes:
            grants.flush()
        return True

    def force_release(self, key: str) -> list[Holder]:
        """``fr``: free every grant on ``key``, whoever holds it, as a release does (a lease
        already run out expires as usual). Returns the grants freed."""
        grants = self.grants
        if (entry := grants.keys.get(key)) is None:
            return []
        now = self.clock()
        forced = grants.counts.forced
        if isinstance(entry, Holder):  # a lock nobody waits for
            if grants.live_holder(entry, entry.token, now) is None:  # idle, or run out now
                return []
            grants.free_holder(entry, None, now, forced)
            return [entry]
        grants.check(entry, now)  # its run-out leases (nothing before its earliest)
        freed = list(entry.holders.values())
        for holder in freed:
            grants.free_holder(holder, entry, now, forced)
        grants.fill(entry, now)
        grants.flush()
        return freed

    def holds(self, key: str, token: str) -> bool:
        """Whether ``token`` holds ``key`` now (its run-out leases expire on the way)."""
        return self.grants.holder_of(key, token) is not None

    def renew(
        self, key: str, token: str, lease_ttl: int, client: Client | None = None
    ) -> int | None:
        """Extend the lease to now + ``lease_ttl``; ``None`` if ``token`` does not hold ``key``
        (its session past its time, not swept yet, ends here, as a keep-alive ends it). A grant
        whose connection is gone (or restored) becomes ``client``'s (a reattach by token);
        ``MaxLocks``, the grant unchanged, when that adds a grant to an address at its cap."""
        grants = self.grants
        entry = grants.keys.get(key)
        if entry is None:
            return None
        now = self.clock()
        holder = grants.live_holder(entry, token, now)
        if holder is None:
            return None
        if holder.client.kept_by is not None and self._session_over(holder, now):
            return None
        if lease_ttl > grants.lease_noted:
            grants.raise_bound(lease_ttl, key)
        if holder.client.closed and client is not None:
            shares = grants.shares
            if shares is not None:
                shares.check_rebind(holder, client, len(grants.keys))
            restored = holder.client.on_close
            on_close = restored.pop(holder, None) if restored else None
            grants.move(holder, client, lease_ttl, now, on_close)
            return lease_ttl
        self._extend(holder, entry, lease_ttl, now + lease_ttl, ahead=False)
        return lease_ttl

    def _session_over(self, holder: Holder, now: float) -> bool:
        """Whether the grant ``holder`` ended with its session: a session past its time, not swept
        yet, ends here (as a keep-alive ends it), with its grants unless auto-release is off."""
        if (kept := holder.client.kept_by) is None or kept.expires_at > now:
            return False
        self._end_session_of(kept, now)
        return not holder.live

    def _extend(
        self, holder: Holder, entry: Entry, lease_ttl: int, expires_at: float, *, ahead: bool
    ) -> None:
        """The live grant ``holder`` now runs to ``expires_at`` with ``lease_ttl``; a journal record
        is written when the new end passes what the records cover, or the lease grows (``ahead``:
        covering a lease past the end, one record a lease per grant, not per keep-alive)."""
        journal = self.grants.journal
        if journal is not None and (expires_at > holder.covered or lease_ttl > holder.lease_ttl):
            end = expires_at + lease_ttl if ahead else expires_at
            journal.extend(holder.token, lease_ttl, end)
            holder.covered = end
        holder.pin_since()
        holder.expires_at = expires_at
        holder.lease_ttl = lease_ttl
        if isinstance(entry, KeyState):  # still the key's entry: nothing above replaces it
            if entry.one is not None:
                entry.earliest = expires_at
            elif expires_at < entry.earliest:
                entry.earliest = expires_at  # a shorter lease may come first
            entry.last_used = expires_at  # not read while held (see KeyState)
        self.grants.leases.add(holder, expires_at, lease_ttl)

    def restore(self, rec: RecordedGrant, left: float, now: float) -> Holder | None:
        """Put back a grant read from the lease journal, ``left`` seconds from its end. ``None``
        when the key is full or fixed with another limit (a journal that contradicts itself)."""
        key, token, limit, lease_ttl = rec.key, rec.token, rec.limit, rec.lease_ttl
        is_sem, detached, on_close = rec.is_sem, rec.detached, rec.on_close
        grants = self.grants
        owner = grants.detached if detached else grants.restored
        expires_at = now + left
        holder = Holder(token, key, owner, lease_ttl, expires_at, since=now)
        holder.note = rec.note
        keys = grants.keys
        # a lock: the holder is the key's entry, unless the key has one (one look-up)
        entry = keys.setdefault(key, holder) if limit == 1 and not is_sem else keys.get(key)
        if entry is not holder:
            if entry is None:
                state = keys[key] = KeyState(key, is_sem, limit, now)
            elif isinstance(entry, Holder) or entry.limit != limit or entry.n_held >= limit:
                return None
            else:
                state = entry
            state.seat(holder)
        owner.held.append(holder)
        owner.n_held += 1
        if on_close is not None and not detached:
            owner.detach_at_close(holder, on_close)
        grants.counts.restored[is_sem] += 1
        return holder

    def restore_all(self, leases: list[RecordedGrant]) -> tuple[int, int, list[RecordedGrant]]:
        """``restore`` each of ``leases``, emptying the list as it goes (records made together
        come free together and the holders take that memory, leaving no holes), and index
        their expiries in the order of their ends. Returns the grants restored, the highest
        fence among them, and the records not restored."""
        index = self.grants.leases
        index.cap = 1 << 62
        restored = highest = 0
        last = ""  # the largest token of the usual width: its fence is the largest of theirs
        refused: list[RecordedGrant] = []
        # ends in order (the usual): indexed as restored; else once all are, sorted
        in_order = all(a.left <= b.left for a, b in itertools.pairwise(leases))
        holders: list[Holder] = []
        leases.reverse()
        pop = leases.pop
        now = self.clock()
        try:
            while leases:
                rec = pop()
                if (holder := self.restore(rec, rec.left, now)) is None:
                    refused.append(rec)
                    continue
                if in_order:
                    index.add(holder, holder.expires_at, _run_of(holder, now))
                else:
                    holders.append(holder)
                restored += 1
                token = rec.token
                if len(token) != TOKEN_HEX_CHARS:
                    highest = max(highest, fence_of(token))
                elif token > last:  # (same width, lowercase hex: as their numbers compare)
                    last = token
            holders.sort(key=operator.attrgetter("expires_at"))
            for holder in holders:
                index.add(holder, holder.expires_at, _run_of(holder, now))
        finally:
            index.cap = 2 * index.count + COMPACT_MIN
        if last:
            highest = max(highest, fence_of(last))
        return restored, highest, refused

    def live_holders(self) -> list[tuple[Holder, KeyState | None, int | None]]:
        """Every grant held now, with its key's state (``None``: a lock that keeps none) and
        its ``<onclose>`` lease."""
        out: list[tuple[Holder, KeyState | None, int | None]] = []
        for entry in self.grants.keys.values():
            if isinstance(entry, Holder):
                state, holders = None, [entry] if entry.live else []
            else:
                state, holders = entry, list(entry.holders.values())
            for holder in holders:
                leases = holder.client.on_close
                out.append((holder, state, leases.get(holder) if leases else None))
        return out

    def busy_keys(self) -> list[str]:
        return [key for key, entry in self.grants.keys.items() if self._busy(entry)]

    def is_busy(self, key: str) -> bool:
        entry = self.grants.keys.get(key)
        return entry is not None and self._busy(entry)

    @staticmethod
    def _busy(entry: Entry) -> bool:
        if isinstance(entry, Holder):
            return entry.live
        return bool(entry.n_held or entry.n_waiting)

    @property
    def queued(self) -> int:
        """Acquires queued now, on every key (a scan)."""
        return sum(e.n_waiting for e in self.grants.keys.values() if isinstance(e, KeyState))

    @property
    def held(self) -> int:
        """Locks and semaphore slots held right now (from the running totals: no scan)."""
        counts = self.grants.counts
        ended = (counts.releases, counts.forced, counts.expiries, counts.lost_by_disconnect)
        return sum(counts.restored) + sum(counts.grants) - sum(sum(pair) for pair in ended)

    def drop_queued(self) -> int:
        """Take every waiter out of every queue (a drain); returns how many."""
        now = self.clock()
        dropped = 0
        for state in list(self.grants.keys.values()):
            if isinstance(state, Holder) or (queue := state.queue) is None:
                continue
            for waiter in queue.items[queue.head :]:
                if waiter.active:
                    waiter.active = False
                    state.n_waiting -= 1
                    waiter.client.waiting.discard(waiter)
                    self.forget_enqueued(waiter)
                    dropped += 1
            state.queue = None
            state.last_used = now
            self.grants.idle.note(self.grants.keys, state)
        return dropped

    def expire(self) -> int:
        """Expire every lease that has run out, and fill the keys whose waiters could not be
        granted before (``Grants.fill_again``); returns how many expired (no scan of the table)."""
        grants = self.grants
        now = self.clock()
        expired = 0
        if grants.in_grace:
            grants.in_grace_at(now)
        if grants.stalled or grants.held_back:
            grants.fill_again(now)
        if self.sessions:
            for session in [s for s in self.sessions.values() if s.expires_at <= now]:
                self._end_session_of(session, now)
        for holder in grants.leases.due(now):
            if holder.live and holder.expires_at <= now:
                if (state := grants.state_of(holder)) is None:
                    grants.free_holder(holder, None, now, grants.counts.expiries)
                    expired += 1
                else:
                    expired += grants.check(state, now)
        grants.flush()
        return expired

    def gc(self, max_idle_s: float) -> int:
        """Forget keys idle for at least ``max_idle_s``."""
        return self.grants.idle.prune(self.grants.keys, self.clock(), max_idle_s)

    def census(self) -> tuple[tuple[int, int, int], tuple[int, int, int], int]:
        """``(keys, holders, waiters)`` of locks, then of semaphores, and how many keys are
        busy (`_busy`, as ``busy_keys``), in one walk of the table (a metrics scrape's)."""
        lock_keys = lock_held = lock_waiting = sem_keys = sem_held = sem_waiting = busy = 0
        for entry in self.grants.keys.values():
            busy += self._busy(entry)
            if isinstance(entry, Holder):  # a lock nobody waits for
                lock_keys += 1
                lock_held += entry.live
            elif entry.is_sem:
                sem_keys += 1
                sem_held += entry.n_held
                sem_waiting += entry.n_waiting
            else:
                lock_keys += 1
                lock_held += entry.n_held
                lock_waiting += entry.n_waiting
        return (lock_keys, lock_held, lock_waiting), (sem_keys, sem_held, sem_waiting), busy

    def session_grants(self) -> int:
        """Grants kept by client sessions now: held on their connections, open or closed."""
        return sum(client.n_held for s in self.sessions.values() for client in s.clients)

    def stats(self, connections: int) -> dict[str, Any]:
        """The ``stats`` reply, in dflockd's shape."""
        grants = self.grants
        now = self.clock()
        self.expire()
        locks: list[dict[str, Any]] = []
        idle_locks: list[dict[str, Any]] = []
        sems: list[dict[str, Any]] = []
        idle_sems: list[dict[str, Any]] = []
        for key, entry in grants.keys.items():
            if isinstance(entry, Holder):  # a lock nobody waits for
                if entry.live:
                    locks.append(self._lock_stats(key, entry, 0, now))
                else:
                    idle_locks.append({"key": key, "idle_s": round(now - entry.expires_at, 3)})
                continue
            if entry.is_sem:
                if entry.idle:
                    idle_sems.append({"key": key, "idle_s": round(now - entry.last_used, 3)})
                else:
                    sems.append(
                        {
                            "key": key,
                            "limit": entry.limit,
                            "holders": entry.n_held,
                            "waiters": entry.n_waiting,
                        }
                    )
            elif entry.n_held:
                holder = next(iter(entry.holders.values()))  # a lock is of limit 1: one holder
                locks.append(self._lock_stats(key, holder, entry.n_waiting, now))
            elif entry.n_waiting == 0:
                idle_locks.append({"key": key, "idle_s": round(now - entry.last_used, 3)})
        return {
            "connections": connections,
            "sessions": len(self.sessions),
            "session_grants": self.session_grants(),
            "locks": locks,
            "semaphores": sems,
            "idle_locks": idle_locks,
            "idle_semaphores": idle_sems,
            "grace_remaining_s": round(grants.grace_until - now, 3) if grants.in_grace else 0.0,
        }

    def _lock_stats(self, key: str, holder: Holder, waiters: int, now: float) -> dict[str, Any]:
        return {
            "key": key,
            "owner_conn_id": holder.client.id,
            "lease_expires_in_s": round(max(0.0, holder.expires_at - now), 3),
            "waiters": waiters,
            "owner": holder.note,
            "detached": self.is_detached(holder),
            "restored": holder.client is self.grants.restored,
            "fence": fence_of(holder.token),
            "held_s": round(max(0.0, now - holder.held_since()), 3),
        }
