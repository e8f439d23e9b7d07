"""The lock table: locks and semaphores, FIFO queues, leases. Pure state, no I/O.

A key is one resource, as in dflockd Go: a lock is a semaphore of limit 1. The first acquire on
an idle key fixes its limit (1 for ``l`` / ``e``, N for ``sl`` / ``se``) and its kind (what
``stats`` and the metrics list it as); an acquire with another limit while the key has holders
or waiters is refused (``LimitMismatch``), so a lock and a semaphore never overlap on one key.
Renew and release take any token of the key, whichever command granted it.

Time comes from an injected clock and tokens from an injected generator, so the table can be
driven step by step (the model-based test does exactly that). A waiter that is granted later
is announced through its ``wake`` callback, called after the table has finished changing.

A table made with ``grace_s > 0`` is in its restart grace until ``clock() + grace_s``: every
key counts as busy (acquires wait in the FIFO queue or time out), and the waiters are granted,
in order, once the grace is over (at the next acquire, enqueue or ``expire``). Before a lease
longer than ``lease_noted`` is granted or renewed, ``note_lease`` is called (it persists the
bound the next start's grace relies on) and may refuse by raising.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Any

__all__ = [
    "AlreadyEnqueued",
    "Client",
    "Counts",
    "Holder",
    "KeyState",
    "LimitMismatch",
    "LockTable",
    "MaxLocks",
    "MaxWaiters",
    "TableError",
    "Waiter",
]


class TableError(Exception):
    """A request the table refuses; the subclass names the reply."""


class MaxLocks(TableError):
    """The key is new and the table already holds ``max_locks`` keys, or the connection
    already holds (or waits to be granted) ``max_locks_per_connection`` locks and slots."""


class MaxWaiters(TableError):
    """The key's queue already holds ``max_waiters`` waiters, or the connection already has
    ``max_waits_per_connection`` queued acquires and pending two-phase enqueues."""


class LimitMismatch(TableError):
    """The request's limit (1 for a lock) differs from the limit of the busy key."""

    def __init__(self, key: str, limit: int) -> None:
        super().__init__(key, limit)
        self.key = key
        self.limit = limit
        """The key's limit, which the refused request did not match."""


class AlreadyEnqueued(TableError):
    """The connection already has a pending two-phase enqueue on this key."""


class Client:
    """One connection's view in the table: what it holds, waits for and has enqueued."""

    __slots__ = ("enqueued", "held", "id", "n_held", "waiting")

    def __init__(self, client_id: int) -> None:
        self.id = client_id
        self.held: list[Holder] = []
        """Its holders in grant order; released ones are dropped lazily (at the back at once,
        elsewhere when they outnumber the live ones): a list costs a fifth of a dict."""
        self.n_held = 0
        """Locks and slots it holds now."""
        self.waiting: set[Waiter] = set()
        self.enqueued: dict[str, Waiter] = {}  # key -> its pending two-phase enqueue


class Holder:
    """A granted lock or semaphore slot."""

    __slots__ = ("client", "expires_at", "lease_ttl", "live", "state", "token")

    def __init__(
        self, token: str, state: KeyState, client: Client, lease_ttl: int, expires_at: float
    ) -> None:
        self.token = token
        self.state = state
        self.client = client
        self.lease_ttl = lease_ttl
        self.expires_at = expires_at
        self.live = True


class Waiter:
    """A queued acquire. ``holder`` is set once it is granted; ``active`` while queued."""

    __slots__ = ("active", "client", "enqueued", "holder", "lease_ttl", "state", "wake")

    def __init__(self, client: Client, state: KeyState, lease_ttl: int) -> None:
        self.client = client
        self.state = state
        self.lease_ttl = lease_ttl
        self.active = True
        self.holder: Holder | None = None
        self.wake: Callable[[Waiter], None] | None = None
        self.enqueued = False


class KeyState:
    """One key: its holders, FIFO queue (``()`` while nobody waits) and limit (1 for a lock).
    ``is_sem``: the key was last fixed by a semaphore request (its kind in ``stats`` and the
    metrics).

    A key of limit 1 (every lock) keeps its holder in ``one``, with no dict: a dict costs more
    than the rest of a held key. A key of a larger limit keeps ``many`` (token -> holder).
    The limit changes only while the key is idle, when both are empty. ``earliest`` is the
    earliest lease expiry of its holders (``inf`` when none). ``last_used`` is read only while
    the key is idle (how long it has been, for ``stats``, ``gc`` and making room), and is set
    at every change that leaves it idle; while it has holders it holds a lease expiry, not a
    float of its own (24 bytes per held key)."""

    __slots__ = (
        "earliest",
        "is_sem",
        "key",
        "last_used",
        "limit",
        "many",
        "n_held",
        "n_waiting",
        "one",
        "queue",
    )

    def __init__(self, key: str, is_sem: bool, limit: int, now: float) -> None:
        self.key = key
        self.is_sem = is_sem
        self.limit = limit
        self.one: Holder | None = None
        self.many: dict[str, Holder] | None = None
        self.n_held = 0
        # A deque from the first waiter until the last one leaves, the empty tuple otherwise:
        # an empty deque costs ~760 bytes, more than the rest of a held key.
        self.queue: deque[Waiter] | tuple[()] = ()
        self.n_waiting = 0
        self.earliest = math.inf
        self.last_used = now

    @property
    def holders(self) -> dict[str, Holder]:
        """Token -> holder, a copy (for reading: stats, tests)."""
        one = self.one
        if one is not None:
            return {one.token: one}
        return dict(self.many) if self.many else {}

    @property
    def idle(self) -> bool:
        return self.n_held == 0 and self.n_waiting == 0


_COMPACT_MIN = 64
_CLIENT_COMPACT_MIN = 8
"""Released holders a connection's list may keep beyond twice its live ones (small: each keeps
a released holder and its token alive)."""


class Counts:
    """Running totals since start-up, each a pair indexed by kind: ``[lock, semaphore]``
    (``counts.grants[state.is_sem]``). Plain integers, read by the metrics exporter."""

    __slots__ = ("expiries", "grants", "lost_by_disconnect", "releases", "timeouts")

    def __init__(self) -> None:
        self.grants = [0, 0]
        """Locks and slots granted (at once or after waiting)."""
        self.releases = [0, 0]
        """Explicit releases by a holder's token."""
        self.expiries = [0, 0]
        """Leases that ran out without a renew."""
        self.lost_by_disconnect = [0, 0]
        """Holds released because their connection closed (auto-release on disconnect)."""
        self.timeouts = [0, 0]
        """Acquires that gave up: try-once refusals and waits that timed out."""


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
        grace_s: float = 0.0,
        note_lease: Callable[[int], int] | None = None,
        lease_noted: int = 0,
    ) -> None:
        self.clock = clock
        self.new_token = new_token
        self.max_locks = max_locks
        self.max_waiters = max_waiters
        self.max_locks_per_connection = max_locks_per_connection
        """Most locks and slots one client may hold, counting its queued waits (each may be
        granted): so it never holds more at once. 0: no cap."""
        self.max_waits_per_connection = max_waits_per_connection
        """Most queued acquires plus pending two-phase enqueues of one client. 0: no cap."""
        self.auto_release_on_disconnect = auto_release_on_disconnect
        self.keys: dict[str, KeyState] = {}
        """Every key, locks and semaphores alike: one resource per key."""
        self._idle_log: deque[tuple[KeyState, float]] = deque()
        """Keys that became idle, oldest first, each with its ``last_used`` then. An entry is
        current while its key is still in the table, idle, and unused since; the others are
        dropped as they are met. So pruning (`gc`) and making room for a new key when the
        table is full cost the keys pruned plus the entries dropped, never a scan of the
        table: every entry is appended once and dropped once."""
        self._expiries: dict[int, tuple[deque[float], deque[Holder]]] = {}
        """The lease expiry index: for each lease length, the expiry times and the holders of
        the leases of that length (two deques in step; a tuple per entry would cost four times
        as much), in the order they were granted or renewed. The clock never goes back, so each
        is in expiry order and a sweep pops only its due entries. An entry
        is current while its holder is live and still expires at that time; released and
        renewed holders leave stale entries, dropped when met or by compaction (see
        ``_index``)."""
        self._n_indexed = 0
        self._index_cap = _COMPACT_MIN
        self._wakes: list[Waiter] = []
        self._next_client_id = 0
        self.counts = Counts()
        self.in_grace = grace_s > 0
        """Within the restart grace: nothing is granted (see ``grace_remaining``)."""
        self.grace_until = clock() + grace_s if grace_s > 0 else -math.inf
        self.note_lease = note_lease
        self.lease_noted = lease_noted
        """Leases up to this long need no ``note_lease`` call."""

    # ------------------------------------------------------------------ restart grace
    def grace_remaining(self) -> float:
        """Seconds of restart grace left (0 once over); ends the grace when it is due."""
        if not self.in_grace:
            return 0.0
        now = self.clock()
        if self._in_grace(now):
            return self.grace_until - now
        self._flush()
        return 0.0

    def _in_grace(self, now: float) -> bool:
        """Whether the grace still holds at ``now``; at its end, grant the waiters queued
        during it (their wakes are left for the caller to flush)."""
        if not self.in_grace:
            return False
        if now < self.grace_until:
            return True
        self.in_grace = False
        for state in list(self.keys.values()):
            if state.n_waiting:
                self._fill(state, now)
        return False

    def _note(self, lease_ttl: int) -> None:
        if lease_ttl > self.lease_noted:
            self.lease_noted = (
                self.note_lease(lease_ttl) if self.note_lease is not None else lease_ttl
            )

    # ------------------------------------------------------------------ clients
    def open_client(self) -> Client:
        self._next_client_id += 1
        return Client(self._next_client_id)

    def disconnect(self, client: Client) -> None:
        """Drop the client's waits; release what it holds when auto-release is on."""
        now = self.clock()
        for waiter in list(client.waiting):
            self._unqueue(waiter, now)
        client.waiting.clear()
        client.enqueued.clear()
        if self.auto_release_on_disconnect:
            lost = self.counts.lost_by_disconnect
            for holder in [h for h in client.held if h.live]:
                lost[holder.state.is_sem] += 1
                self._drop_holder(holder, now)
                self._fill(holder.state, now)
        self._flush()

    # ------------------------------------------------------------------ acquire
    def acquire(
        self, client: Client, key: str, lease_ttl: int, limit: int | None, *, queue: bool
    ) -> Holder | Waiter | None:
        """Grant at once (a ``Holder``), queue (a ``Waiter``, if ``queue``), or ``None``.

        ``limit`` is ``None`` for a lock, the semaphore's limit otherwise. Raises
        ``LimitMismatch`` when the key is busy with another limit (a lock's is 1).
        """
        now = self.clock()
        try:
            if self.in_grace:
                self._in_grace(now)  # at its end, the waiters queued during it go first
            state = self._state_for(key, limit, now)
            if state.n_held < state.limit and state.n_waiting == 0 and not self.in_grace:
                if self.max_locks_per_connection:
                    self._check_client_locks(client, key, state)
                return self._grant(state, client, lease_ttl, now)
            if not queue:
                self.counts.timeouts[state.is_sem] += 1
                return None
            if self.max_waits_per_connection:
                self._check_client_waits(client, key, state)
            if self.max_locks_per_connection:
                self._check_client_locks(client, key, state)
            return self._queue(state, client, lease_ttl)
        finally:
            if self._wakes:
                self._flush()

    def enqueue(self, client: Client, key: str, lease_ttl: int, limit: int | None) -> Waiter:
        """Two-phase step 1: a waiter, already granted (``holder`` set) or queued."""
        try:
            return self._enqueue(client, key, lease_ttl, limit)
        finally:
            if self._wakes:
                self._flush()

    def _enqueue(self, client: Client, key: str, lease_ttl: int, limit: int | None) -> Waiter:
        previous = client.enqueued.get(key)
        now = self.clock()
        if previous is not None:
            if previous.holder is not None:
                self._check(previous.state, now)
            if previous.holder is None or previous.holder.live:
                raise AlreadyEnqueued(key)
            del client.enqueued[key]
        if self.in_grace:
            self._in_grace(now)
        if self.max_waits_per_connection:
            self._check_client_waits(client, key, None)
        if self.max_locks_per_connection:
            self._check_client_locks(client, key, None)
        state = self._state_for(key, limit, now)
        if state.n_held < state.limit and state.n_waiting == 0 and not self.in_grace:
            waiter = Waiter(client, state, lease_ttl)
            waiter.active = False
            waiter.holder = self._grant(state, client, lease_ttl, now)
        else:
            waiter = self._queue(state, client, lease_ttl)
        waiter.enqueued = True
        client.enqueued[key] = waiter
        return waiter

    def find_enqueued(self, client: Client, key: str) -> Waiter | None:
        """Two-phase step 2: the client's pending enqueue on ``key`` (leases checked first),
        made by ``e`` or ``se`` alike."""
        waiter = client.enqueued.get(key)
        if waiter is not None and waiter.holder is not None:
            self._check(waiter.state, self.clock())
            self._flush()
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
            self.counts.timeouts[waiter.state.is_sem] += 1
            now = self.clock()
            self._unqueue(waiter, now)
            waiter.client.waiting.discard(waiter)
            self.forget_enqueued(waiter)
            self._flush()

    # ------------------------------------------------------------------ renew / release
    def release(self, key: str, token: str) -> bool:
        """Release the slot ``token`` holds on ``key`` (granted by a lock or a semaphore
        request alike); ``False`` if it holds none."""
        state = self.keys.get(key)
        if state is None:
            return False
        now = self.clock()
        if now >= state.earliest:
            self._check(state, now)
        holder = state.one
        if holder is None or holder.token != token:
            holder = state.many.get(token) if state.many else None
        if holder is None:
            if self._wakes:
                self._flush()
            return False
        self.counts.releases[state.is_sem] += 1
        self._drop_holder(holder, now)
        if state.queue:
            self._fill(state, now)
        if self._wakes:
            self._flush()
        return True

    def renew(self, key: str, token: str, lease_ttl: int) -> int | None:
        """Extend the lease to now + ``lease_ttl``; ``None`` if ``token`` does not hold ``key``."""
        state = self.keys.get(key)
        if state is None:
            return None
        now = self.clock()
        if now >= state.earliest:
            self._check(state, now)
            self._flush()
        holder = state.one
        if holder is None or holder.token != token:
            holder = state.many.get(token) if state.many else None
        if holder is None:
            return None
        if lease_ttl > self.lease_noted:
            self._note(lease_ttl)
        expires_at = now + lease_ttl
        holder.expires_at = expires_at
        holder.lease_ttl = lease_ttl
        if state.one is not None:
            state.earliest = expires_at
        elif expires_at < state.earliest:
            state.earliest = expires_at  # a shorter lease may come first
        state.last_used = expires_at  # not read while held (see KeyState)
        self._index(holder, expires_at, lease_ttl)
        return lease_ttl

    @property
    def held(self) -> int:
        """Locks and semaphore slots held right now (from the running totals: no scan)."""
        counts = self.counts
        return (
            sum(counts.grants)
            - sum(counts.releases)
            - sum(counts.expiries)
            - sum(counts.lost_by_disconnect)
        )

    def drop_queued(self) -> int:
        """Take every waiter out of every queue (a server that drains grants nothing more);
        returns how many. Waiters blocked in a request are the connections' to answer."""
        now = self.clock()
        dropped = 0
        for state in list(self.keys.values()):
            queue = state.queue
            if isinstance(queue, tuple):
                continue
            for waiter in list(queue):
                if waiter.active:
                    waiter.active = False
                    state.n_waiting -= 1
                    waiter.client.waiting.discard(waiter)
                    self.forget_enqueued(waiter)
                    dropped += 1
            state.queue = ()
            state.last_used = now
            self._note_idle(state)
        return dropped

    # ------------------------------------------------------------------ maintenance
    def expire(self) -> int:
        """Expire every lease that has run out; returns how many. The cost is the entries of
        the expiry index that are due (one per lease expired, plus the stale ones met) and one
        step per distinct lease length in use: never a scan of the table."""
        now = self.clock()
        expired = 0
        if self.in_grace:
            self._in_grace(now)
        expiries = self._expiries
        for lease_ttl in list(expiries):
            while True:
                # Fetched anew at each step: the grants an expiry makes may compact the index.
                entries = expiries.get(lease_ttl)
                if entries is None:
                    break
                times, holders = entries
                if not times:
                    del expiries[lease_ttl]
                    break
                if times[0] > now:
                    break
                times.popleft()
                holder = holders.popleft()
                self._n_indexed -= 1
                if holder.live and holder.expires_at <= now:
                    expired += self._check(holder.state, now)
        self._flush()
        return expired

    @property
    def expiry_entries(self) -> int:
        """Entries in the expiry index, stale ones included (at most about twice the leases
        held, plus a constant: see ``_index``)."""
        return self._n_indexed

    def gc(self, max_idle_s: float) -> int:
        """Forget keys idle (no holder, no waiter) for at least ``max_idle_s``; the cost is
        the keys forgotten, not the size of the table (see ``_idle_log``)."""
        now = self.clock()
        log = self._idle_log
        pruned = 0
        while log:
            state, stamp = log[0]
            if not self._idle_since(state, stamp):
                log.popleft()
            elif now - stamp >= max_idle_s:
                log.popleft()
                del self.keys[state.key]
                pruned += 1
            else:
                break  # the rest became idle later
        return pruned

    def occupancy(self, is_sem: bool) -> tuple[int, int, int]:
        """``(keys, holders, waiters)`` of one kind right now (leases are not swept here)."""
        keys = holders = waiters = 0
        for state in self.keys.values():
            if state.is_sem is is_sem:
                keys += 1
                holders += state.n_held
                waiters += state.n_waiting
        return keys, holders, waiters

    def stats(self, connections: int) -> dict[str, Any]:
        """The ``stats`` reply, in dflockd's shape."""
        now = self.clock()
        self.expire()
        locks: list[dict[str, Any]] = []
        idle_locks: list[dict[str, Any]] = []
        sems: list[dict[str, Any]] = []
        idle_sems: list[dict[str, Any]] = []
        for key, state in self.keys.items():
            if state.is_sem:
                if state.idle:
                    idle_sems.append({"key": key, "idle_s": round(now - state.last_used, 3)})
                else:
                    sems.append(
                        {
                            "key": key,
                            "limit": state.limit,
                            "holders": state.n_held,
                            "waiters": state.n_waiting,
                        }
                    )
            elif state.n_held:
                holder = state.one
                if holder is None:  # a lock is of limit 1: one holder
                    holder = next(iter(state.holders.values()))
                locks.append(
                    {
                        "key": key,
                        "owner_conn_id": holder.client.id,
                        "lease_expires_in_s": round(max(0.0, holder.expires_at - now), 3),
                        "waiters": state.n_waiting,
                    }
                )
            elif state.n_waiting == 0:
                idle_locks.append({"key": key, "idle_s": round(now - state.last_used, 3)})
        return {
            "connections": connections,
            "locks": locks,
            "semaphores": sems,
            "idle_locks": idle_locks,
            "idle_semaphores": idle_sems,
            "grace_remaining_s": round(max(0.0, self.grace_until - now), 3)
            if self.in_grace
            else 0.0,
        }

    # ------------------------------------------------------------------ internals
    def _check_client_locks(self, client: Client, key: str, state: KeyState | None) -> None:
        """Refuse (``MaxLocks``) a client whose holds plus queued waits (each may be granted)
        reach its cap. ``state``: the key about to be granted or queued on (if a refusal
        leaves it idle, it is logged so, to be pruned)."""
        if client.n_held + len(client.waiting) >= self.max_locks_per_connection:
            if state is not None:
                self._note_idle(state)
            raise MaxLocks(key)

    def _check_client_waits(self, client: Client, key: str, state: KeyState | None) -> None:
        """Refuse (``MaxWaiters``) a client whose queued acquires plus pending two-phase
        enqueues reach its cap. A queued enqueue is in both ``waiting`` and ``enqueued``: the
        exact count (at most the cap's worth of entries) is taken only near the cap.
        ``state``: as for ``_check_client_locks``."""
        cap = self.max_waits_per_connection
        waiting, enqueued = client.waiting, client.enqueued
        if len(waiting) + len(enqueued) < cap:
            return
        if len(waiting) + sum(1 for w in enqueued.values() if not w.active) < cap:
            return
        if state is not None:
            self._note_idle(state)
        raise MaxWaiters(key)

    def _idle_since(self, state: KeyState, stamp: float) -> bool:
        """Whether an ``_idle_log`` entry is current."""
        return state.last_used == stamp and state.idle and self.keys.get(state.key) is state

    def _note_idle(self, state: KeyState) -> None:
        """Log ``state`` if it is idle now (it may be busy again at once: the entry is then
        dropped when met)."""
        if state.n_waiting or state.n_held:
            return
        log = self._idle_log
        log.append((state, state.last_used))
        if len(log) > 2 * len(self.keys) + _COMPACT_MIN:
            # Mostly dropped entries: keep the current ones (amortised over the appends).
            self._idle_log = deque(e for e in log if self._idle_since(*e))

    def _make_room(self) -> bool:
        """Forget the longest-idle key; False if no key is idle."""
        log = self._idle_log
        while log:
            state, stamp = log.popleft()
            if self._idle_since(state, stamp):
                del self.keys[state.key]
                return True
        return False

    def _state_for(self, key: str, limit: int | None, now: float) -> KeyState:
        """The key's state for an acquire with ``limit`` (``None``: a lock, limit 1): made
        if new, its limit and kind fixed anew if idle, refused if busy with another limit."""
        is_sem = limit is not None
        wanted = 1 if limit is None else limit
        states = self.keys
        state = states.get(key)
        if state is None:
            # Idle keys hold nothing: make room before refusing.
            if len(states) >= self.max_locks and not self._make_room():
                raise MaxLocks(key)
            state = states[key] = KeyState(key, is_sem, wanted, now)
            return state  # granted or queued on at once (see _grant for when it cannot be)
        if now >= state.earliest:
            self._check(state, now)
        state.last_used = now
        if state.idle:
            if wanted != state.limit:
                state.limit = wanted
                state.many = None  # empty: a key of limit 1 holds its holder in `one`
            state.is_sem = is_sem
        elif wanted != state.limit:
            raise LimitMismatch(key, state.limit)
        return state

    def _queue(self, state: KeyState, client: Client, lease_ttl: int) -> Waiter:
        if self.max_waiters and state.n_waiting >= self.max_waiters:
            self._note_idle(state)  # a new key (in the restart grace) left idle: prune it
            raise MaxWaiters(state.key)
        waiter = Waiter(client, state, lease_ttl)
        queue = state.queue
        if isinstance(queue, tuple):
            queue = state.queue = deque()
        queue.append(waiter)
        state.n_waiting += 1
        client.waiting.add(waiter)
        return waiter

    def _grant(self, state: KeyState, client: Client, lease_ttl: int, now: float) -> Holder:
        try:
            if lease_ttl > self.lease_noted:
                self._note(lease_ttl)  # before the token: a failed write grants nothing
            token = self.new_token()
        except BaseException:
            self._note_idle(state)  # a new key left idle must still be pruned
            raise
        self.counts.grants[state.is_sem] += 1
        expires_at = now + lease_ttl
        holder = Holder(token, state, client, lease_ttl, expires_at)
        if state.limit == 1:
            state.one = holder
            state.earliest = expires_at
        else:
            many = state.many
            if many is None:
                many = state.many = {}
            many[token] = holder
            state.earliest = min(state.earliest, expires_at)
        state.n_held += 1
        state.last_used = expires_at  # not read while held (see KeyState)
        client.held.append(holder)
        client.n_held += 1
        entries = self._expiries.get(lease_ttl)  # _index, inlined: the hot path
        if entries is None:
            entries = self._expiries[lease_ttl] = (deque(), deque())
        entries[0].append(expires_at)
        entries[1].append(holder)
        self._n_indexed += 1
        if self._n_indexed > self._index_cap:
            self._compact_index()
        return holder

    def _index(self, holder: Holder, expires_at: float, lease_ttl: int) -> None:
        """Add the holder's new expiry to the index. When stale entries (released or renewed
        holders) outnumber the rest, keep only the current ones: the cost is amortised over
        the entries added since the last time, never a scan per request."""
        entries = self._expiries.get(lease_ttl)
        if entries is None:
            entries = self._expiries[lease_ttl] = (deque(), deque())
        entries[0].append(expires_at)
        entries[1].append(holder)
        self._n_indexed += 1
        if self._n_indexed > self._index_cap:
            self._compact_index()

    def _compact_index(self) -> None:
        kept = 0
        for lease_ttl, (times, holders) in list(self._expiries.items()):
            kept_times: deque[float] = deque()
            kept_holders: deque[Holder] = deque()
            for expires_at, holder in zip(times, holders, strict=True):
                if holder.live and holder.expires_at == expires_at:
                    kept_times.append(expires_at)
                    kept_holders.append(holder)
            if kept_times:
                self._expiries[lease_ttl] = (kept_times, kept_holders)
                kept += len(kept_times)
            else:
                del self._expiries[lease_ttl]
        self._n_indexed = kept
        self._index_cap = 2 * kept + _COMPACT_MIN

    def _unqueue(self, waiter: Waiter, now: float) -> None:
        if not waiter.active:
            return
        waiter.active = False
        state = waiter.state
        state.n_waiting -= 1
        state.last_used = now
        queue = state.queue
        if len(queue) > _COMPACT_MIN and len(queue) > 2 * state.n_waiting:
            state.queue = deque(w for w in queue if w.active)
        self._fill(state, now)
        self._note_idle(state)

    def _drop_holder(self, holder: Holder, now: float) -> None:
        holder.live = False
        state = holder.state
        if state.one is holder:
            state.one = None
        else:
            assert state.many is not None
            del state.many[holder.token]
        state.n_held -= 1
        client = holder.client
        client.n_held -= 1
        held = client.held
        while held and not held[-1].live:
            held.pop()
        if len(held) > 2 * client.n_held + _CLIENT_COMPACT_MIN:
            client.held = [h for h in held if h.live]
        entries = self._expiries.get(holder.lease_ttl)
        if entries is not None and entries[1] and not entries[1][-1].live:
            # Stale entries at the back (the latest grants, released): dropped at once, so
            # short holds leave nothing behind in the index.
            times, holders = entries
            while holders and not holders[-1].live:
                holders.pop()
                times.pop()
                self._n_indexed -= 1
        state.last_used = now
        if not state.n_held:
            state.earliest = math.inf
            self._note_idle(state)

    def _check(self, state: KeyState, now: float) -> int:
        """Expire the key's run-out leases and hand their slots on; returns how many."""
        if now < state.earliest:
            return 0
        one = state.one
        if one is not None:
            gone = [one] if one.expires_at <= now else []
        else:
            gone = [h for h in state.many.values() if h.expires_at <= now] if state.many else []
        if gone:
            self.counts.expiries[state.is_sem] += len(gone)
        for holder in gone:
            self._drop_holder(holder, now)
        one = state.one
        if one is not None:
            state.earliest = one.expires_at
        else:
            many = state.many
            state.earliest = (
                min((h.expires_at for h in many.values()), default=math.inf) if many else math.inf
            )
        self._fill(state, now)
        return len(gone)

    def _fill(self, state: KeyState, now: float) -> None:
        """Grant queued waiters, in FIFO order, while the key has free slots."""
        queue = state.queue
        if isinstance(queue, tuple) or self.in_grace:
            return
        while state.n_waiting and state.n_held < state.limit:
            waiter = queue[0]
            if not waiter.active:
                queue.popleft()
                continue
            # Grant first: if no token can be issued the waiter stays at the head of the queue.
            waiter.holder = self._grant(state, waiter.client, waiter.lease_ttl, now)
            queue.popleft()
            waiter.active = False
            state.n_waiting -= 1
            waiter.client.waiting.discard(waiter)
            if waiter.wake is not None:
                self._wakes.append(waiter)
        if not state.n_waiting:
            state.queue = ()  # only given-up waiters left, if any: drop them with the deque

    def _flush(self) -> None:
        while self._wakes:
            wakes = self._wakes
            self._wakes = []
            for waiter in wakes:
                if waiter.wake is not None:
                    waiter.wake(waiter)
