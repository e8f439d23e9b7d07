"""The lock table's records: a key's state, its holders and waiters, a connection's view, the
running totals, and the refusals. Plain data with ``__slots__``, changed by the table; no I/O,
no clock.
"""

from __future__ import annotations

import math
from collections.abc import Callable

__all__ = [
    "AS_RECORDED",
    "AT_LEASE_START",
    "CLIENT_COMPACT_MIN",
    "AlreadyEnqueued",
    "Bound",
    "Client",
    "ClientSession",
    "Counts",
    "Entry",
    "Holder",
    "KeyState",
    "LimitMismatch",
    "MaxLocks",
    "MaxWaiters",
    "TableError",
    "WaitQueue",
    "Waiter",
    "lock_state",
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


class Bound(TableError):
    """``ht``: the grant is bound to a live connection. ``note``: its owner note."""

    def __init__(self, key: str, note: str | None) -> None:
        super().__init__(key, note)
        self.key = key
        self.note = note


AS_RECORDED = -1.0
"""``Holder.covered`` of a grant whose record is its last: it covers ``expires_at +
lease_ttl`` (what the record says), until a renewal changes them."""

AT_LEASE_START = float("-inf")
"""``Holder.since`` of a grant whose lease has not moved since it was made: it was made at
``expires_at - lease_ttl`` (see ``Holder.held_since``)."""


CLIENT_COMPACT_MIN = 8
"""Released holders a connection's list (or ``on_close`` map) may keep beyond twice its live
ones (small: each keeps a released holder and its token alive)."""


class Client:
    """One connection's view in the table: what it holds, waits for and has enqueued.
    ``closed`` once its connection is gone; ``on_close``: grants taken over with ``ht`` and an
    ``<onclose>`` lease (holder -> that lease; released ones pruned as it grows), or ``None``."""

    __slots__ = (
        "closed",
        "enqueued",
        "held",
        "id",
        "kept_by",
        "n_held",
        "on_close",
        "session",
        "waiting",
    )

    def __init__(self, client_id: int) -> None:
        self.id = client_id
        self.held: list[Holder] = []
        """Its holders in grant order, released ones dropped lazily (at the back at once,
        elsewhere when they outnumber the live ones): a list costs a fifth of a dict."""
        self.n_held = 0
        """Locks and slots it holds now."""
        self.waiting: set[Waiter] = set()
        self.enqueued: dict[str, Waiter] = {}  # key -> its pending two-phase enqueue
        self.closed = False
        self.on_close: dict[Holder, int] | None = None
        self.session = False
        """It opted in to sessions (``hello _ session``): a close by its peer ends its grants
        ``session_ttl_s`` later, not at once."""
        self.kept_by: ClientSession | None = None
        """The client session it joined (``hello _ session <id> <ttl>``), which keeps its
        grants alive whatever becomes of the connection; ``None``: a connection of its own."""

    def detach_at_close(self, holder: Holder, lease_ttl: int) -> None:
        """At its close, detach ``holder`` with ``lease_ttl`` instead of releasing it."""
        leases = self.on_close
        if leases is None:
            leases = self.on_close = {}
        elif len(leases) > 2 * self.n_held + CLIENT_COMPACT_MIN:
            for gone in [h for h in leases if not h.live]:
                del leases[gone]
        leases[holder] = lease_ttl


class ClientSession:
    """A client's session (``hello _ session <id> <ttl>``): the connections that joined it
    (open, or closed while they hold something), and until when it lives (table clock) unless
    kept alive (``ping _ session <id>``). Its end ends every grant its connections hold."""

    __slots__ = ("clients", "expires_at", "id", "ttl")

    def __init__(self, session_id: str, ttl: int, expires_at: float) -> None:
        self.id = session_id
        self.ttl = ttl
        self.expires_at = expires_at
        self.clients: list[Client] = []


class Holder:
    """A granted lock or semaphore slot on ``key``. ``note``: its owner note (``hl``,
    ``note``), or ``None``. Its ``client`` is a connection's, or the table's ``detached`` one
    (a detached hold) or ``restored`` one (restored from the journal, until a connection
    renews it).

    A held lock that nobody waits for is its own entry in the table's key map: it keeps no
    ``KeyState`` (that would cost more than the rest of the held key) until an acquire has to
    wait for it. A released holder still in the key map (``live`` false) is the key's idle
    entry: its ``expires_at`` is then the time the key went idle (a state's ``last_used``),
    and its ``token`` is empty (an idle key keeps no token alive)."""

    __slots__ = (
        "client",
        "covered",
        "expires_at",
        "key",
        "lease_ttl",
        "live",
        "note",
        "since",
        "token",
    )

    def __init__(
        self,
        token: str,
        key: str,
        client: Client,
        lease_ttl: int,
        expires_at: float,
        *,
        since: float,
    ) -> None:
        self.token = token
        self.since = since
        """When the grant was made (table clock; restored: when restored), kept across a
        take-over or a detach, for ``stats`` and the status page; read with ``held_since``.
        ``AT_LEASE_START`` until its lease moves (``pin_since``), as most never do: a float of
        its own costs 24 bytes on the pure-Python build (a held lock 351 bytes by tracemalloc,
        not 318: past 2x Redis's memory per held lock)."""
        self.key = key
        self.client = client
        self.lease_ttl = lease_ttl
        self.expires_at = expires_at
        self.live = True
        self.note: str | None = None
        self.covered = 0.0
        """With a lease journal: the expiry (table clock) its records cover; a renewal up to
        it, with a lease no longer than ``lease_ttl``, writes nothing. ``AS_RECORDED`` (set by
        a grant's record, saving a float of its own): ``expires_at + lease_ttl``."""

    def held_since(self) -> float:
        """When the grant was made (table clock)."""
        since = self.since
        return self.expires_at - self.lease_ttl if since == AT_LEASE_START else since

    def pin_since(self) -> None:
        """Keep when the grant was made (``since``), before its lease moves."""
        self.since = self.held_since()


class Waiter:
    """A queued acquire. ``holder`` is set once it is granted; ``active`` while queued.
    ``note`` (``hl`` only) goes to its grant; ``detached`` makes the grant the table's
    ``detached`` client's."""

    __slots__ = (
        "active",
        "client",
        "detached",
        "enqueued",
        "holder",
        "lease_ttl",
        "note",
        "state",
        "wake",
    )

    def __init__(self, client: Client, state: KeyState, lease_ttl: int) -> None:
        self.client = client
        self.state = state
        self.lease_ttl = lease_ttl
        self.active = True
        self.holder: Holder | None = None
        self.wake: Callable[[Waiter], None] | None = None
        self.enqueued = False
        self.note: str | None = None
        self.detached = False


class WaitQueue:
    """A key's FIFO queue: its waiters in arrival order from ``head`` on (given-up ones skipped
    when met, dropped by a compaction). A list and an index, not a deque: a deque costs about
    760 bytes from its first waiter (this, about 150), and its calls are by name, compiled."""

    __slots__ = ("head", "items")

    def __init__(self) -> None:
        self.items: list[Waiter] = []
        self.head = 0


class KeyState:
    """One key: its holders, FIFO queue (``None`` while nobody waits) and limit (1 for a lock);
    a held lock nobody has waited for has none (its ``Holder`` is the key's entry).
    ``is_sem``: the key was last fixed by a semaphore request (its kind in ``stats`` and the
    metrics).

    A key of limit 1 keeps its holder in ``one``, with no dict (a dict costs more than the rest
    of a held key); a larger limit keeps ``many`` (token -> holder). The limit changes only
    while the key is idle, both empty. ``earliest``: its holders' earliest lease expiry
    (``inf`` when none). ``last_used`` is read only while the key is idle (for ``stats``,
    ``gc`` and making room) and set at every change that leaves it idle; while held, it holds
    a lease expiry rather than a float of its own (24 bytes per held key)."""

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
        self.queue: WaitQueue | None = None  # from the first waiter until the last one leaves
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


def lock_state(holder: Holder) -> KeyState:
    """A state made around the lock ``holder`` holds, which keeps none (see ``Holder``)."""
    state = KeyState(holder.key, False, 1, holder.expires_at)  # last_used: not read while held
    state.one = holder
    state.n_held = 1
    state.earliest = holder.expires_at
    return state


class Counts:
    """Running totals since start-up, each ``[lock, semaphore]`` (``grants[state.is_sem]``),
    read by the metrics exporter."""

    __slots__ = (
        "expiries",
        "forced",
        "grants",
        "lost_by_disconnect",
        "releases",
        "restored",
        "timeouts",
    )

    def __init__(self) -> None:
        self.restored = [0, 0]
        """Grants restored from the lease journal at start-up."""
        self.grants = [0, 0]
        """Locks and slots granted (at once or after waiting)."""
        self.releases = [0, 0]
        """Explicit releases by a holder's token."""
        self.forced = [0, 0]
        """Grants freed by an operator's force release (``fr``), whoever held them."""
        self.expiries = [0, 0]
        """Leases that ran out without a renew (a session connection's, closed by its peer,
        at its session time's end too)."""
        self.lost_by_disconnect = [0, 0]
        """Holds released because their plain connection was closed by its peer (auto-release
        on disconnect); a close the server makes itself releases none."""
        self.timeouts = [0, 0]
        """Acquires that gave up: try-once refusals and waits that timed out."""


Entry = KeyState | Holder
"""A value of the table's key map: the key's state, or, for a held lock nobody waits for (or
such a lock released since, the key idle), its holder alone."""
