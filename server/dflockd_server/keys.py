"""The lock table's records: a key's state, its holders and waiters, a connection's view, the
running totals, and the refusals. Plain data, changed by the table."""

from __future__ import annotations

import math
from collections.abc import Callable


class TableError(Exception):
    """A request the table refuses; the subclass names the reply."""


class MaxLocks(TableError):
    """``max_locks`` keys, or ``max_locks_per_connection`` held and queued, reached."""


class MaxWaiters(TableError):
    """``max_waiters`` on the key, or ``max_waits_per_connection``, reached."""


class LimitMismatch(TableError):
    """The request's limit (1 for a lock) differs from the limit of the busy key."""

    def __init__(self, key: str, limit: int) -> None:
        super().__init__(key, limit)
        self.key = key
        self.limit = limit  # the key's limit


class AlreadyEnqueued(TableError):
    """The connection already has a pending two-phase enqueue on this key."""


class Bound(TableError):
    """``ht``: the grant is bound to a live connection. ``note``: its owner note."""

    def __init__(self, key: str, note: str | None) -> None:
        super().__init__(key, note)
        self.key = key
        self.note = note


AT_LEASE_START = float("-inf")
"""``Holder.since`` of a grant whose lease has not moved: made at ``expires_at - lease_ttl``."""
CLIENT_COMPACT_MIN = 8
"""Ended holders a connection's list (or ``on_close`` map) may keep beyond twice its live ones."""


class Client:
    """One connection's view in the table: what it holds, waits for and has enqueued.
    ``on_close``: grants taken over with ``ht`` and an ``<onclose>`` lease (holder -> lease)."""

    __slots__ = ("close", "closed", "enqueued", "held", "id", "kept_by", "n_held", "on_close",
                 "session", "waiting")  # fmt: skip

    def __init__(self, client_id: int) -> None:
        self.id = client_id
        self.held: list[Holder] = []
        """Its holders in grant order, ended ones dropped lazily (a list: a fifth of a dict)."""
        self.n_held = 0
        self.waiting: set[Waiter] = set()
        self.enqueued: dict[str, Waiter] = {}  # key -> its pending two-phase enqueue
        self.closed = False
        self.on_close: dict[Holder, int] | None = None
        self.session = False  # hello _ session: a peer's close ends its grants session_ttl_s later
        self.kept_by: ClientSession | None = None
        """The client session it joined, which keeps its grants alive past its close."""
        self.close: Callable[[], None] | None = None
        """Closes its connection as the server's closes do (freeing nothing): how a force
        release tells a session's holder, whose keep-alives spare it renewals."""

    def let_go(self) -> None:
        """One of its grants ended (no longer ``live``): counted out, the ended ones at the end
        of ``held`` dropped, the whole list compacted when mostly ended."""
        self.n_held -= 1
        held = self.held
        while held and not held[-1].live:
            held.pop()
        if len(held) > 2 * self.n_held + CLIENT_COMPACT_MIN:
            self.held = [h for h in held if h.live]

    def detach_at_close(self, holder: Holder, lease_ttl: int) -> None:
        """At its close, detach ``holder`` with ``lease_ttl`` instead of releasing it."""
        if (leases := self.on_close) is None:
            leases = self.on_close = {}
        elif len(leases) > 2 * self.n_held + CLIENT_COMPACT_MIN:
            for gone in [h for h in leases if not h.live]:
                del leases[gone]
        leases[holder] = lease_ttl


class ClientSession:
    """A client's session (``hello _ session <id> <ttl>``): the connections that joined it, and
    until when it lives unless kept alive. Its end ends every grant its connections hold."""

    __slots__ = ("clients", "expires_at", "id", "ttl")

    def __init__(self, session_id: str, ttl: int, expires_at: float) -> None:
        self.id = session_id
        self.ttl = ttl
        self.expires_at = expires_at
        self.clients: list[Client] = []


class Holder:
    """A granted lock or semaphore slot on ``key``. Its ``client`` is a connection's, or the
    table's ``detached`` or ``restored`` one.

    A held lock that nobody waits for is its own entry in the table's key map, with no
    ``KeyState`` (that would cost more than the rest of the held key). A released holder still
    in the key map (``live`` false) is the key's idle entry: its ``expires_at`` is the time the
    key went idle, and its ``token`` is empty."""

    __slots__ = ("client", "covered", "expires_at", "key", "lease_ttl", "live", "note", "since",
                 "token")  # fmt: skip

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
        """When the grant was made, kept across a take-over; read with ``held_since``.
        ``AT_LEASE_START`` until its lease moves (``pin_since``): saves a float per grant."""
        self.key = key
        self.client = client
        self.lease_ttl = lease_ttl
        self.expires_at = expires_at
        self.live = True
        self.note: str | None = None
        self.covered = 0.0
        """With a lease journal: the expiry its records cover; a renewal up to it, with a lease
        no longer than ``lease_ttl``, writes nothing."""

    def held_since(self) -> float:
        since = self.since
        return self.expires_at - self.lease_ttl if since == AT_LEASE_START else since

    def pin_since(self) -> None:
        """Call before its lease moves."""
        self.since = self.held_since()


class Waiter:
    """A queued acquire: ``holder`` once granted; ``active`` while queued; ``note`` and
    ``detached`` (``hl`` only) go to its grant."""

    __slots__ = ("active", "client", "detached", "enqueued", "holder", "lease_ttl", "note", "state",
                 "wake")  # fmt: skip

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
    """A key's FIFO queue: its waiters from ``head`` on (given-up ones skipped when met). A list
    and an index, not a deque: a deque costs about 760 bytes from its first waiter."""

    __slots__ = ("head", "items")

    def __init__(self) -> None:
        self.items: list[Waiter] = []
        self.head = 0


class KeyState:
    """One key: its holders, FIFO queue (``None`` while nobody waits) and limit (1 for a lock).
    ``is_sem``: the key was last fixed by a semaphore request.

    A key of limit 1 keeps its holder in ``one``, with no dict; a larger limit keeps ``many``
    (token -> holder). The limit changes only while the key is idle. ``earliest``: its
    holders' earliest lease expiry. ``last_used`` is read only while the key is idle; while
    held, it holds a lease expiry rather than a float of its own."""

    __slots__ = ("earliest", "is_sem", "key", "last_used", "limit", "many", "n_held", "n_waiting",
                 "one", "queue")  # fmt: skip

    def __init__(self, key: str, is_sem: bool, limit: int, now: float) -> None:
        self.key = key
        self.is_sem = is_sem
        self.limit = limit
        self.one: Holder | None = None
        self.many: dict[str, Holder] | None = None
        self.n_held = 0
        self.queue: WaitQueue | None = None
        self.n_waiting = 0
        self.earliest = math.inf
        self.last_used = now

    def seat(self, holder: Holder) -> None:
        """Add the new grant ``holder`` to the key's holders (a free slot: the caller checked)."""
        expires_at = holder.expires_at
        if self.limit == 1:
            self.one = holder
            self.earliest = expires_at
        else:
            if (many := self.many) is None:
                many = self.many = {}
            many[holder.token] = holder
            self.earliest = min(self.earliest, expires_at)
        self.n_held += 1
        self.last_used = expires_at  # not read while held

    @property
    def holders(self) -> dict[str, Holder]:
        """Token -> holder, a copy (for reading: stats, tests)."""
        if (one := self.one) is not None:
            return {one.token: one}
        return dict(self.many) if self.many else {}

    @property
    def idle(self) -> bool:
        return self.n_held == 0 and self.n_waiting == 0


def lock_state(holder: Holder) -> KeyState:
    """A state made around the lock ``holder`` holds, which keeps none (see ``Holder``)."""
    state = KeyState(holder.key, False, 1, holder.expires_at)
    state.seat(holder)
    return state


class Counts:
    """Running totals since start-up, each ``[lock, semaphore]``, read by the metrics."""

    __slots__ = ("expiries", "forced", "grants", "lost_by_disconnect", "releases", "restored",
                 "timeouts")  # fmt: skip

    def __init__(self) -> None:
        self.restored = [0, 0]
        self.grants = [0, 0]
        self.releases = [0, 0]
        self.forced = [0, 0]  # freed by an operator's force release (`fr`)
        self.expiries = [0, 0]  # leases that ran out (a session's end shortens them)
        self.lost_by_disconnect = [0, 0]  # a plain connection's grants freed at its peer's close
        self.timeouts = [0, 0]  # try-once refusals and waits that timed out


Entry = KeyState | Holder  # a value of the table's key map (see `Holder`)
