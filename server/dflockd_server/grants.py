"""The lock table's grants: the key map with every grant, queue and lease, and the steps that change
them (granting, queueing, ending and rebinding a grant, expiring leases, filling the FIFO queues,
the per-connection caps and the restart grace). ``table.LockTable`` owns one."""

from __future__ import annotations

import math
from collections.abc import Callable

from dflockd_server.fence import FenceStateError
from dflockd_server.journal import Journal, drop_record
from dflockd_server.keys import (
    AT_LEASE_START,
    CLIENT_COMPACT_MIN,
    Client,
    Counts,
    Entry,
    Holder,
    KeyState,
    LimitMismatch,
    MaxLocks,
    MaxWaiters,
    Waiter,
    WaitQueue,
    lock_state,
)
from dflockd_server.leases import COMPACT_MIN, IdleLog, LeaseIndex, LeaseRun
from dflockd_server.shares import AddressShares

__all__ = ["Grants"]


class Grants:
    """One server's keys with their grants, queues and leases, and the steps that change them."""

    def __init__(
        self,
        *,
        clock: Callable[[], float],
        new_token: Callable[[], str],
        max_locks: int,
        max_waiters: int,
        max_locks_per_connection: int,
        max_waits_per_connection: int,
        grace_s: float,
        journal: Journal | None,
        note_lease: Callable[[int], int] | None,
        lease_noted: int,
    ) -> None:
        self.asking = False  # the request under way follows an `asking` (`asked_check` decides)
        self.journal = journal
        self.note_lease = note_lease  # records a longer lease bound before a grant; may raise
        self.lease_noted = lease_noted  # leases up to this long need no `note_lease` call
        self.asked_check: Callable[[str], bytes | None] | None = None
        self.grant_check: Callable[[str], bytes | None] | None = None
        """The ownership check (None: every key is served), asked before promoting a waiter."""
        self.clock = clock
        self.new_token = new_token
        self.max_locks = max_locks
        self.max_waiters = max_waiters
        self.max_locks_per_connection = max_locks_per_connection
        self.max_waits_per_connection = max_waits_per_connection
        self.keys: dict[str, Entry] = {}
        self.idle = IdleLog()
        self.leases = LeaseIndex()
        self.wakes: list[Waiter] = []  # granted by the change under way, woken by `flush` once done
        self.stalled: set[str] = set()
        """Keys with a free slot whose first waiter could be issued no token yet (``fill``)."""
        self.held_back: set[str] = set()
        """Keys whose waiters ``grant_check`` kept from promotion (a cluster member's shard
        while its fence is raised). Nothing else wakes either kind once it could be granted:
        both are filled again at each lease sweep (``fill_again``)."""
        self.detached = Client(0)  # the owner of detached holds (connections are numbered from 1)
        self.restored = Client(-1)
        """Owns restored connection-bound grants until renewed (closed: ``ht`` may take them)."""
        self.restored.closed = True
        self.shares: AddressShares | None = None
        """The grants each client address holds (``--max-locks-per-ip``); None: no cap."""
        self.counts = Counts()
        self.in_grace = grace_s > 0
        self.grace_until = clock() + grace_s if grace_s > 0 else -math.inf

    def in_grace_at(self, now: float) -> bool:
        """Whether the grace still holds at ``now``; at its end, grant the waiters queued
        during it (their wakes are left for the caller to flush)."""
        if not self.in_grace:
            return False
        if now < self.grace_until:
            return True
        self.in_grace = False
        self._fill_each(list(self.keys.values()), now)
        return False

    def fill_waiting(self) -> None:
        """Grant the waiters of every key with free slots (the journal is writable again)."""
        self._fill_each(list(self.keys.values()), self.clock())
        self.flush()

    def fill_again(self, now: float) -> None:
        """Fill the ``stalled`` and ``held_back`` keys again (the sweep)."""
        keys = self.stalled | self.held_back
        self.stalled, self.held_back = set(), set()
        self._fill_each([self.keys.get(key) for key in keys], now)

    def _fill_each(self, entries: list[Entry | None], now: float) -> None:
        """``fill`` each of ``entries`` that is a key's state with waiters."""
        for state in entries:
            if isinstance(state, KeyState) and state.n_waiting:
                self.fill(state, now)

    def raise_bound(self, lease_ttl: int, key: str) -> None:
        """Before a lease longer than ``lease_noted``: record the new bound, then ask about the
        key again (it may have stopped being served meanwhile)."""
        note_lease = self.note_lease
        self.lease_noted = note_lease(lease_ttl) if note_lease is not None else lease_ttl
        check = self.asked_check if self.asking else self.grant_check
        if check is not None and check(key) is not None:
            raise FenceStateError(
                f"stopped serving {key!r} while recording a longer lease; nothing granted"
            )

    def check_client_locks(self, client: Client, key: str, state: KeyState | None) -> None:
        """Refuse (``MaxLocks``) a client whose holds plus queued waits reach its cap.
        ``state``: the key about to be granted or queued on (logged idle on a refusal)."""
        if client.n_held + len(client.waiting) >= self.max_locks_per_connection:
            if state is not None:
                self.idle.note(self.keys, state)
            raise MaxLocks(key)

    def check_client_waits(self, client: Client, key: str, state: KeyState | None) -> None:
        """Refuse (``MaxWaiters``) a client whose queued acquires plus pending enqueues reach
        its cap (a queued enqueue is in both: counted exactly only near the cap)."""
        cap = self.max_waits_per_connection
        waiting, enqueued = client.waiting, client.enqueued
        if len(waiting) + len(enqueued) < cap:
            return
        if len(waiting) + sum(1 for w in enqueued.values() if not w.active) < cap:
            return
        if state is not None:
            self.idle.note(self.keys, state)
        raise MaxWaiters(key)

    def state_for(self, key: str, limit: int | None, now: float) -> KeyState:
        """The key's state for an acquire with ``limit`` (``None``: a lock): made if new, its
        limit and kind fixed anew if idle, refused if busy with another limit."""
        is_sem = limit is not None
        wanted = 1 if limit is None else limit
        states = self.keys
        entry = states.get(key)
        if entry is None:
            # Idle keys hold nothing: make room before refusing.
            if len(states) >= self.max_locks and not self.idle.evict_oldest(states):
                raise MaxLocks(key)
            state = states[key] = KeyState(key, is_sem, wanted, now)
            return state
        if isinstance(entry, Holder):  # a lock nobody waited for: it gets a state now
            if entry.live and now >= entry.expires_at:
                self.free_holder(entry, None, now, self.counts.expiries)
            if not entry.live:  # was idle
                state = states[key] = KeyState(key, is_sem, wanted, now)
                return state
            state = states[key] = lock_state(entry)
            if wanted != 1:
                raise LimitMismatch(key, 1)
            return state
        state = entry
        if now >= state.earliest:
            self.check(state, now)
        state.last_used = now
        if not state.n_held and not state.n_waiting:  # idle
            if wanted != state.limit:
                state.limit = wanted
                state.many = None  # empty: a key of limit 1 holds its holder in `one`
            state.is_sem = is_sem
        elif wanted != state.limit:
            raise LimitMismatch(key, state.limit)
        return state

    def queue(self, state: KeyState, client: Client, lease_ttl: int) -> Waiter:
        if self.max_waiters and state.n_waiting >= self.max_waiters:
            self.idle.note(self.keys, state)  # a new key (in the restart grace) left idle: prune it
            raise MaxWaiters(state.key)
        waiter = Waiter(client, state, lease_ttl)
        queue = state.queue
        if queue is None:
            queue = state.queue = WaitQueue()
        queue.items.append(waiter)
        state.n_waiting += 1
        client.waiting.add(waiter)
        return waiter

    def grant(  # noqa: PLR0917 - positional: the hot path's calls pass no keywords
        self,
        state: KeyState,
        client: Client,
        lease_ttl: int,
        now: float,
        note: str | None = None,
        taker: Client | None = None,
    ) -> Holder:
        """Grant a slot of ``state`` to ``client``, for ``taker``'s request (``None``: its)."""
        try:
            holder = self._new_holder(state.key, state, client, lease_ttl, now, note, taker)
        except BaseException:
            self.idle.note(self.keys, state)  # a new key left idle must still be pruned
            raise
        state.seat(holder)
        return holder

    def grant_bare(  # noqa: PLR0917 - positional: the hot path's calls pass no keywords
        self, key: str, client: Client, owner: Client, lease_ttl: int, now: float, note: str | None
    ) -> Holder | None:
        """Grant the lock ``key`` to ``owner`` (for ``client``'s request) as the key's entry,
        with no ``KeyState``, if it is free; else ``None``: then through the key's state."""
        if self.in_grace:
            return None
        keys = self.keys
        entry = keys.get(key)
        if entry is None:
            if len(keys) >= self.max_locks and not self.idle.evict_oldest(keys):
                raise MaxLocks(key)
        elif isinstance(entry, Holder):
            if entry.live:
                if now < entry.expires_at:
                    return None
                self.free_holder(entry, None, now, self.counts.expiries)
        elif entry.n_waiting:
            return None
        elif entry.n_held:
            self.check(entry, now)  # its run-out leases (nothing before its earliest)
            if entry.n_held:
                return None
        if self.max_locks_per_connection:
            self.check_client_locks(client, key, None)
        holder = self._new_holder(key, None, owner, lease_ttl, now, note, client)
        keys[key] = holder
        return holder

    def _new_holder(  # noqa: PLR0917 - positional: the hot path's calls pass no keywords
        self,
        key: str,
        state: KeyState | None,
        client: Client,
        lease_ttl: int,
        now: float,
        note: str | None,
        taker: Client | None = None,
    ) -> Holder:
        """Issue a grant on ``key`` to ``client`` (token, count, journal record, client's view,
        address share, expiry index); the caller puts it in the entry."""
        if lease_ttl > self.lease_noted:
            self.raise_bound(lease_ttl, key)  # before the token: a failed write grants nothing
        token = self.new_token()
        self.counts.grants[False if state is None else state.is_sem] += 1
        expires_at = now + lease_ttl
        holder = Holder(token, key, client, lease_ttl, expires_at, since=AT_LEASE_START)
        if note is not None:
            holder.note = note
        journal = self.journal
        if journal is not None:
            journal.buf.append(journal.grant_record(holder, state, client is self.detached, None))
        client.held.append(holder)
        client.n_held += 1
        shares = self.shares
        if shares is not None:
            shares.granted(holder, client if taker is None else taker)
        index = self.leases  # index.add, inlined: the hot path
        run = index.by_ttl.get(lease_ttl)
        if run is None:
            run = index.by_ttl[lease_ttl] = LeaseRun()
        run.times.append(expires_at)
        run.holders.append(holder)
        index.count += 1
        if index.count > index.cap:
            index.compact()
        return holder

    def unqueue(self, waiter: Waiter, now: float) -> None:
        if not waiter.active:
            return
        waiter.active = False
        state = waiter.state
        state.n_waiting -= 1
        state.last_used = now
        if (queue := state.queue) is not None:
            items, head = queue.items, queue.head
            if len(items) - head > COMPACT_MIN and len(items) - head > 2 * state.n_waiting:
                queue.items = [w for w in items[head:] if w.active]
                queue.head = 0
        self.fill(state, now)
        self.idle.note(self.keys, state)

    def free_holder(
        self, holder: Holder, state: KeyState | None, now: float, why: list[int]
    ) -> None:
        """THE one place a grant ends and its slot becomes free (docs/protocol.md, "Tokens, leases
        and disconnects"); the caller then calls ``fill``. ``why``: the ``Counts`` pair it counts
        in. ``state`` ``None``: the holder is the key's entry and stays it, as the idle key's."""
        why[0 if state is None else state.is_sem] += 1
        holder.live = False
        journal = self.journal
        if journal is not None:
            journal.buf.append(drop_record(holder.token))
        client = holder.client  # Client.let_go, written out: the release's hot path
        client.n_held -= 1
        held = client.held
        while held and not held[-1].live:
            held.pop()
        if len(held) > 2 * client.n_held + CLIENT_COMPACT_MIN:
            client.held = [h for h in held if h.live]
        shares = self.shares
        if shares is not None:
            shares.ended(holder)  # before the token goes (a detached hold's is its entry)
        index = self.leases
        run = index.by_ttl.get(holder.lease_ttl)
        if run is not None:  # stale entries at the back: dropped now (short holds leave none)
            times, holders, head = run.times, run.holders, run.head
            while len(holders) > head and not holders[-1].live:
                holders.pop()
                times.pop()
                index.count -= 1
        if state is None:
            holder.expires_at = now  # when the key went idle (see Holder)
            holder.token = ""
            self.idle.log(self.keys, holder, now)
            return
        if state.one is holder:
            state.one = None
        else:
            assert state.many is not None
            del state.many[holder.token]
        state.n_held -= 1
        state.last_used = now
        if not state.n_held:
            state.earliest = math.inf
            if not state.n_waiting:
                self.idle.note(self.keys, state)

    def state_of(self, holder: Holder) -> KeyState | None:
        """The state that holds the live ``holder`` (``None``: it is its key's entry)."""
        entry = self.keys[holder.key]
        return entry if isinstance(entry, KeyState) else None

    def check(self, state: KeyState, now: float) -> int:
        """Expire the key's run-out leases and hand their slots on; returns how many."""
        if now < state.earliest:
            return 0
        one = state.one
        if one is not None:
            gone = [one] if one.expires_at <= now else []
        else:
            gone = [h for h in state.many.values() if h.expires_at <= now] if state.many else []
        expiries = self.counts.expiries
        for holder in gone:
            self.free_holder(holder, state, now, expiries)
        one = state.one
        if one is not None:
            state.earliest = one.expires_at
        else:
            many = state.many
            state.earliest = (
                min((h.expires_at for h in many.values()), default=math.inf) if many else math.inf
            )
        self.fill(state, now)
        return len(gone)

    def fill(self, state: KeyState, now: float) -> None:
        """Grant queued waiters, in FIFO order, while the key has free slots."""
        queue = state.queue
        if queue is None or self.in_grace:
            return
        journal = self.journal
        if journal is not None and not journal.writable:
            return  # they wait for it (``fill_waiting``)
        check = self.grant_check
        if check is not None and check(state.key) is not None:
            self.held_back.add(state.key)
            return
        items = queue.items
        while state.n_waiting and state.n_held < state.limit:
            waiter = items[queue.head]
            if not waiter.active:
                queue.head += 1
                continue
            # Grant first: if no token can be issued, the waiter stays at the head, and the
            # key is filled again at the next sweep (what freed the slot is done all the same).
            try:
                owner = self.detached if waiter.detached else waiter.client  # (an hl mode d)
                waiter.holder = self.grant(
                    state, owner, waiter.lease_ttl, now, waiter.note, waiter.client
                )
            except FenceStateError:
                self.stalled.add(state.key)
                return
            queue.head += 1
            waiter.active = False
            state.n_waiting -= 1
            waiter.client.waiting.discard(waiter)
            if waiter.wake is not None:
                self.wakes.append(waiter)
        if not state.n_waiting:
            state.queue = None
        elif queue.head > COMPACT_MIN and 2 * queue.head > len(items):
            del items[: queue.head]
            queue.head = 0

    def flush(self) -> None:
        while self.wakes:
            wakes, self.wakes = self.wakes, []
            for waiter in wakes:
                if waiter.wake is not None:
                    waiter.wake(waiter)

    def move(
        self,
        holder: Holder,
        client: Client,
        lease_ttl: int,
        now: float,
        on_close: int | None = None,
    ) -> Holder:
        """Rebind the grant to ``client`` with ``lease_ttl`` from ``now``: a new ``Holder``
        (same token and note) takes its place. ``on_close``: its lease when ``client`` closes."""
        old = holder.client
        holder.live = False
        old.let_go()
        if old.on_close:
            old.on_close.pop(holder, None)
        state = self.state_of(holder)
        expires_at = now + lease_ttl
        since = holder.held_since()
        moved = Holder(holder.token, holder.key, client, lease_ttl, expires_at, since=since)
        moved.note = holder.note
        if (journal := self.journal) is not None:
            journal.move(
                holder.token,
                detached=client is self.detached,
                on_close=on_close,
                lease_ttl=lease_ttl,
                expires_at=expires_at,
                note=moved.note,
            )
            moved.covered = expires_at
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
        if (shares := self.shares) is not None:
            shares.moved(holder, moved)
        self.leases.add(moved, expires_at, lease_ttl)
        if on_close is not None:
            client.detach_at_close(moved, on_close)
        return moved

    def holder_of(self, key: str, token: str) -> Holder | None:
        """The live grant ``token`` holds on ``key``, or ``None``."""
        entry = self.keys.get(key)
        return None if entry is None else self.live_holder(entry, token, self.clock())

    def live_holder(self, entry: Entry, token: str, now: float) -> Holder | None:
        """The grant ``token`` holds on ``entry``'s key once its leases due by ``now`` have run
        out, or ``None``."""
        if isinstance(entry, Holder):  # a lock nobody waits for
            if not entry.live:
                return None
            if now >= entry.expires_at:
                self.free_holder(entry, None, now, self.counts.expiries)
                return None
            return entry if entry.token == token else None
        state = entry
        if now >= state.earliest:
            self.check(state, now)
            self.flush()
        holder = state.one
        if holder is None or holder.token != token:
            holder = state.many.get(token) if state.many else None
        return holder

    def is_lock_grant(self, holder: Holder) -> bool:
        state = self.state_of(holder)
        return state is None or state.one is holder
