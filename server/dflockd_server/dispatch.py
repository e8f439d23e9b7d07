"""The dispatch step: one parsed request -> the lock table -> its reply. No sockets, no loop.

``Session`` is one connection's side of the protocol. ``Session.handle`` answers a frame with
reply bytes, or with ``None`` and ``Session.action`` saying what the transport does instead:
``Wait`` (the acquire is queued: ``Session.granted`` when woken, ``Session.give_up`` when its
timer fires), ``Close`` (send a last reply and close), ``STATS`` (answer from the rationed
snapshots), ``AUTH_FAILED`` (answer and close after a delay) or ``RaiseBound`` (parked until
``leasebound`` has recorded a longer lease bound). Each command has one route
(``Session.route_table``): it parses with ``protocol.parse_<command>`` (a ``Malformed`` is
answered ``error``), acts on the table and answers with ``protocol``'s reply bytes.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Callable
from typing import Final, Protocol

from dflockd_server import constants as c, protocol as p
from dflockd_server.fence import FenceStateError
from dflockd_server.ownernotes import readable_note
from dflockd_server.table import (
    AlreadyEnqueued,
    Bound,
    Client,
    Holder,
    LimitMismatch,
    LockTable,
    MaxLocks,
    MaxWaiters,
    Waiter,
)

__all__ = ["AUTH_FAILED", "STATS", "Action", "Close", "Host", "RaiseBound", "Session", "Wait"]

log = logging.getLogger("dflockd_server")

_AUTH: Final = c.CMD_AUTH.encode()
_LOCK: Final = c.CMD_LOCK.encode()
_TAKE: Final = c.CMD_TAKE.encode()
_ENQUEUE: Final = c.CMD_ENQUEUE.encode()
_ASKING: Final = c.CMD_ASKING.encode()
_WHILE_DRAINING: Final = frozenset(
    command.encode()
    for command in (
        c.CMD_RELEASE,
        c.CMD_SEM_RELEASE,
        c.CMD_RENEW,
        c.CMD_SEM_RENEW,
        c.CMD_PING,
        c.CMD_HELLO,
        c.CMD_STATS,
        c.CMD_AUTH,
        c.CMD_SHARDS,
        c.CMD_NOTE,
        c.CMD_TAKE,
        c.CMD_HAND_DOWN,
        c.CMD_FORCE_RELEASE,
    )
)
"""What a draining server still answers: holders renew (``ht`` and ``hd`` too) and release
(``fr`` too) until done; acquires and waits get ``error_draining``."""
_REFUSALS: Final = (MaxLocks, MaxWaiters, LimitMismatch, AlreadyEnqueued, FenceStateError)


class Action:
    """What the transport does for a request not answered by a reply now."""

    __slots__ = ()


class Wait(Action):
    """The request blocks: answer when ``waiter`` is granted (``Session.granted``) or after
    ``timeout`` seconds (``Session.give_up``)."""

    __slots__ = ("timeout", "waiter")

    def __init__(self, waiter: Waiter, timeout: int) -> None:
        self.waiter = waiter
        self.timeout = timeout


class Close(Action):
    """Send ``reply`` (after the replies before it) and close the connection."""

    __slots__ = ("reply",)

    def __init__(self, reply: bytes) -> None:
        self.reply = reply


class RaiseBound(Action):
    """Handle ``frame`` again (after ``asking`` if it followed one) once ``lease`` is recorded."""

    __slots__ = ("asking", "frame", "lease")

    def __init__(self, lease: int, frame: p.Frame, asking: bool) -> None:
        self.lease = lease
        self.frame = frame
        self.asking = asking


STATS: Final = Action()
AUTH_FAILED: Final = Action()
_CLOSE_UNAUTHED: Final = Close(p.REPLY_ERROR_AUTH)

Reply = bytes | None
"""A route's answer: the reply bytes, or ``None`` (see ``Session.action``)."""


_Route = Callable[["Session", bytes, bytes, bytes], Reply]


class Host(Protocol):
    """What a session reads of its server."""

    @property
    def draining(self) -> bool: ...

    @property
    def secret(self) -> bytes | None: ...

    @property
    def hello_reply(self) -> bytes: ...

    @property
    def key_check(self) -> Callable[[str], bytes | None] | None:
        """The ownership's ``check`` (None: every key is served); read per acquire."""
        ...

    @property
    def asked_check(self) -> Callable[[str], bytes | None]:
        """``key_check`` for an acquire that follows an admitted ``asking``."""
        ...

    @property
    def admit_ask(self) -> Callable[[str, str], bytes | None]:
        """``asking <key> <ticket>``: None when admitted, else the reply."""
        ...

    def may_hold(self, key: str) -> bool:
        """False while a grant on ``key`` may not be renewed, taken over or handed down here."""
        ...

    @property
    def hold_check(self) -> Callable[[str], bool] | None:
        """``may_hold`` where it may refuse a key granted here, else None (single, static)."""
        ...

    def shards_reply(self) -> bytes: ...

    def over_ip_share(self, session: Session) -> bool:
        """Whether ``session``'s address holds its ``--max-locks-per-ip``."""
        ...


class Session:
    """One connection's side of the protocol (see the module's doc)."""

    __slots__ = (
        "action",
        "asked",
        "asking",
        "authed",
        "client",
        "default_lease",
        "eof",
        "grants",
        "host",
        "ip",
        "locks_per_ip",
        "max_lease",
        "moved",
        "peer",
        "table",
    )

    def __init__(
        self, host: Host, table: LockTable, default_lease: int, max_lease: int, peer: str
    ) -> None:
        self.host = host
        self.table = table
        self.grants = table.grants  # read as plain attributes on the hot path
        self.client: Client = table.open_client()
        self.default_lease = default_lease
        self.max_lease = max_lease
        self.peer = peer
        self.ip = ""  # the client's address and --max-locks-per-ip, set by the connection
        self.locks_per_ip = c.NO_CAP
        self.authed = host.secret is None
        self.eof = False  # the client sent EOF: acquires are tried once
        self.action: Action | None = None
        """What to do for the request ``handle`` last answered with ``None``."""
        self.asking = False
        """The previous request was an admitted ``asking`` for the key ``asked``."""
        self.asked = ""
        self.moved: dict[str, bytes] | None = None
        """Key -> the reply to the ``w`` / ``sw`` of an enqueue dropped as its shard moved."""

    def handle(self, frame: p.Frame) -> Reply:
        cmd, key, arg = frame
        if not self.authed and cmd != _AUTH:
            log.debug("connection %s: request before auth, closing", self.peer)
            return self._later(_CLOSE_UNAUTHED)
        if self.host.draining and cmd not in _WHILE_DRAINING:
            return p.REPLY_ERROR_DRAINING  # nothing new is granted; releases still work
        route = _ROUTES.get(cmd)
        if route is None:
            self.asking = False
            return self._malformed(p.unknown_command(cmd))
        try:
            reply = route(self, cmd, key, arg)
        except p.Malformed as bad:  # a route's parser: nothing was done
            reply = self._malformed(bad)
        if self.asking and cmd != _ASKING:
            self.asking = self.table.grants.asking = False  # one request only, whatever it was
        return reply

    @staticmethod
    def route_table() -> dict[bytes, _Route]:  # in the class: routes are protected
        return {
            command.encode(): route
            for commands, route in (
                ((c.CMD_LOCK, c.CMD_SEM_LOCK), Session._acquire),
                ((c.CMD_HOLD,), Session._hold),
                ((c.CMD_RELEASE, c.CMD_SEM_RELEASE), Session._release),
                ((c.CMD_RENEW, c.CMD_SEM_RENEW), Session._renew),
                ((c.CMD_ENQUEUE, c.CMD_SEM_ENQUEUE), Session._enqueue),
                ((c.CMD_WAIT, c.CMD_SEM_WAIT), Session._wait),
                ((c.CMD_PING,), Session._ping),
                ((c.CMD_HELLO,), Session._hello),
                ((c.CMD_STATS,), Session._stats),
                ((c.CMD_AUTH,), Session._auth),
                ((c.CMD_SHARDS,), Session._shards),
                ((c.CMD_NOTE,), Session._note),
                ((c.CMD_TAKE, c.CMD_HAND_DOWN), Session._rebind),
                ((c.CMD_ASKING,), Session._asking),
                ((c.CMD_FORCE_RELEASE,), Session._force_release),
            )
            for command in commands
        }

    def _acquire(self, cmd: bytes, key: bytes, arg: bytes) -> Reply:
        limit: int | None = None
        if cmd == _LOCK:
            name, timeout, lease = p.parse_lock(key, arg)
        else:
            name, timeout, limit, lease = p.parse_sem_lock(key, arg)
        if lease is not None and lease > self.max_lease:
            return self._too_long(lease)
        if self.host.key_check is not None and (refused := self._check(name)) is not None:
            return refused
        if len(self.table.grants.keys) >= self.locks_per_ip and self.host.over_ip_share(self):
            return p.REPLY_ERROR_MAX_LOCKS
        table = self.table
        if (journal := self.grants.journal) is not None and not journal.writable:
            return p.REPLY_ERROR_READ_ONLY  # no grant the journal cannot hold
        ttl = lease or self.default_lease
        if ttl > self.grants.lease_noted and self.grants.note_lease is not None:
            return self._later(RaiseBound(ttl, (cmd, key, arg), self.asking))
        table.grants.asking = self.asking
        try:
            got = table.acquire(self.client, name, ttl, limit, queue=timeout > 0 and not self.eof)
        except _REFUSALS as exc:
            return _refusal(exc, p.REPLY_ERROR_READ_ONLY)
        if got is None:
            return p.REPLY_TIMEOUT
        if type(got) is Holder:
            return p.reply_granted(got.token, got.lease_ttl)
        assert isinstance(got, Waiter)
        return self._later(Wait(got, timeout))

    def _hold(self, cmd: bytes, key: bytes, arg: bytes) -> Reply:
        """``hl``: a lock acquire with an owner note, bound to the connection or detached."""
        name, timeout, lease, detached, note = p.parse_hold(key, arg)
        if lease > self.max_lease:
            return self._too_long(lease)
        if self.host.key_check is not None and (refused := self._check(name)) is not None:
            return refused
        if len(self.table.grants.keys) >= self.locks_per_ip and self.host.over_ip_share(self):
            return p.REPLY_ERROR_MAX_LOCKS
        table = self.table
        if (journal := self.grants.journal) is not None and not journal.writable:
            return p.REPLY_ERROR_READ_ONLY  # no grant the journal cannot hold
        if lease > self.grants.lease_noted and self.grants.note_lease is not None:
            return self._later(RaiseBound(lease, (cmd, key, arg), self.asking))
        table.grants.asking = self.asking
        queue = timeout > 0 and not self.eof
        try:
            got = table.acquire(self.client, name, lease, None, note, detached, queue=queue)
        except _REFUSALS as exc:
            return _refusal(exc, p.REPLY_ERROR_READ_ONLY)
        if got is None:
            return p.reply_held_by(table.holder_note(name))
        if type(got) is Holder:
            return p.reply_granted(got.token, got.lease_ttl)
        assert isinstance(got, Waiter)
        return self._later(Wait(got, timeout))

    def _note(self, cmd: bytes, key: bytes, arg: bytes) -> Reply:
        name, token, note = p.parse_note(key, arg)
        if self._unwritable():
            return p.REPLY_ERROR_READ_ONLY
        return p.REPLY_OK if self.table.set_note(name, token, note) else p.REPLY_ERROR

    def _rebind(self, cmd: bytes, key: bytes, arg: bytes) -> Reply:
        """``ht``: take a detached grant over; ``hd``: detach a grant from its connection. As
        ``n``: no ownership check, answered while draining, and where this member may not hold
        the key now, answered as ``_unconfirmed`` answers ``n``."""
        on_close: int | None = None
        note = ""
        if cmd == _TAKE:
            name, token, lease, on_close, note = p.parse_take(key, arg)
        else:
            name, token, lease = p.parse_hand_down(key, arg)
        longest = max(lease, on_close or 0)  # the close's lease too: a disconnect must not fail
        if longest > self.max_lease:
            return self._too_long(longest)
        if not self.host.may_hold(name):
            return self._unconfirmed(name, token)
        if self._unwritable():
            return p.REPLY_ERROR_READ_ONLY  # a rebinding the journal cannot hold
        if longest > self.grants.lease_noted and self.grants.note_lease is not None:
            return self._later(RaiseBound(longest, (cmd, key, arg), self.asking))
        try:
            if cmd != _TAKE:
                return p.REPLY_OK if self.table.hand_down(name, token, lease) else p.REPLY_ERROR
            taken = self.table.take(self.client, name, token, lease, note=note, on_close=on_close)
        except Bound as exc:
            return p.reply_bound(exc.note)
        except _REFUSALS as exc:
            return _refusal(exc)
        return p.REPLY_ERROR if taken is None else p.reply_number(taken.lease_ttl)

    def _release(self, cmd: bytes, key: bytes, arg: bytes) -> Reply:
        name, token = p.parse_release(cmd, key, arg)
        return p.REPLY_OK if self.table.release(name, token) else p.REPLY_ERROR

    def _force_release(self, cmd: bytes, key: bytes, arg: bytes) -> Reply:
        """``fr``: an operator frees every grant on a key (routed as an acquire is; logged)."""
        name, note = p.parse_force_release(key, arg)
        if self.host.key_check is not None and (refused := self._check(name)) is not None:
            return refused
        freed = self.table.force_release(name)
        for holder in freed:
            # A session's holder sends no renewal while keep-alives keep it: the close of the
            # grant's connection (no other grant of the session ends with it) makes it renew by
            # token now, and learn. A connection with a wait, or this one, is left open.
            on = holder.client
            if on.kept_by is not None and on.close and on is not self.client and not on.waiting:
                on.close()
        log.warning(
            "force release of %r by %s (%s): %d grant(s) freed%s",
            name,
            self.peer,
            note or "no note",
            len(freed),
            "".join(f", held by {readable_note(h.note)}" for h in freed),
        )
        return p.reply_number(len(freed))

    def _renew(self, cmd: bytes, key: bytes, arg: bytes) -> Reply:
        name, token, lease = p.parse_renew(cmd, key, arg)
        if lease is not None and lease > self.max_lease:
            return self._too_long(lease)
        if not self.host.may_hold(name):
            return self._unconfirmed(name, token)
        journal = self.grants.journal
        if journal is not None and not journal.writable and not journal.mark_removed:
            # Answered unrecorded only once the journal's complete mark is gone: else a
            # restart could restore a shorter lease than the holder was told.
            return p.REPLY_ERROR
        ttl = lease or self.default_lease
        if ttl > self.grants.lease_noted and self.grants.note_lease is not None:
            return self._later(RaiseBound(ttl, (cmd, key, arg), self.asking))
        try:
            remaining = self.table.renew(name, token, ttl, self.client)
        except _REFUSALS as exc:
            return _refusal(exc)
        return p.REPLY_ERROR if remaining is None else p.reply_number(remaining)

    def _unconfirmed(self, name: str, token: str) -> Reply:
        """A renewal (or ``ht``, ``hd``) this cluster member may not confirm now:
        ``error_unavailable`` while it cannot tell whether it serves ``name`` (``_cannot_tell``)
        and ``token`` holds it here (the holder asks again while its lease runs), else
        ``error``: the holder sees the loss."""
        if self._cannot_tell(name) and self.table.holds(name, token):
            return p.REPLY_ERROR_UNAVAILABLE
        return p.REPLY_ERROR

    def _cannot_tell(self, key: str) -> bool:
        """Whether this cluster member cannot tell yet whether it serves ``key`` (its fencing
        counter not raised for the shard since it started, or etcd lost)."""
        check = self.host.key_check
        return check is not None and check(key) == p.REPLY_ERROR_UNAVAILABLE

    def _enqueue(self, cmd: bytes, key: bytes, arg: bytes) -> Reply:
        limit: int | None = None
        if cmd == _ENQUEUE:
            name, lease = p.parse_enqueue(key, arg)
        else:
            name, limit, lease = p.parse_sem_enqueue(key, arg)
        if lease is not None and lease > self.max_lease:
            return self._too_long(lease)
        if (refused := self._check(name)) is not None:
            return refused
        if self._unwritable():
            return p.REPLY_ERROR_READ_ONLY  # no grant the journal cannot hold
        if len(self.table.grants.keys) >= self.locks_per_ip and self.host.over_ip_share(self):
            return p.REPLY_ERROR_MAX_LOCKS
        ttl = lease or self.default_lease
        if ttl > self.grants.lease_noted and self.grants.note_lease is not None:
            return self._later(RaiseBound(ttl, (cmd, key, arg), self.asking))
        if self.moved:
            self.moved.pop(name, None)  # a new enqueue: the old one's news is stale
        self.table.grants.asking = self.asking
        try:
            waiter = self.table.enqueue(self.client, name, ttl, limit)
        except _REFUSALS as exc:
            return _refusal(exc, p.REPLY_ERROR_READ_ONLY)
        holder = waiter.holder
        if holder is None:
            return p.REPLY_QUEUED
        return p.reply_acquired(holder.token, holder.lease_ttl)

    def _wait(self, cmd: bytes, key: bytes, arg: bytes) -> Reply:
        name, timeout = p.parse_wait(cmd, key, arg)
        table = self.table
        waiter = table.find_enqueued(self.client, name)
        if waiter is None:
            moved = self.moved.pop(name, None) if self.moved else None
            return p.REPLY_ERROR_NOT_ENQUEUED if moved is None else moved
        if (holder := waiter.holder) is not None:
            table.forget_enqueued(waiter)
            if not holder.live:
                return p.REPLY_ERROR_LEASE_EXPIRED
            return p.reply_granted(holder.token, holder.lease_ttl)
        if timeout == 0 or self.eof:
            table.cancel_wait(waiter)
            return p.REPLY_TIMEOUT
        return self._later(Wait(waiter, timeout))

    def _asking(self, cmd: bytes, key: bytes, arg: bytes) -> Reply:
        """``asking <key> <ticket>``: the next request, an acquire of ``key``, follows an
        ``error_ask`` (docs/protocol.md, *Key-level moves*); admitted with a valid ticket in
        cluster mode only (``cluster.asktickets``)."""
        self.asking = False
        if self.host.key_check is not None:
            name, ticket = p.parse_asking(key, arg)
            if (refused := self.host.admit_ask(name, ticket)) is not None:
                return refused
            self.asked = name
        self.asking = True
        return p.REPLY_OK

    def _check(self, key: str) -> bytes | None:
        """The ownership's refusal of an acquire of ``key``, or None."""
        check = self.host.key_check
        if check is None:
            return None
        if self.asking:
            if key == self.asked:
                return self.host.asked_check(key)
            self.asking = False  # admitted for another key: this one is checked as any
        return check(key)

    def _unwritable(self) -> bool:
        journal = self.grants.journal
        return journal is not None and not journal.writable

    def _ping(self, cmd: bytes, key: bytes, arg: bytes) -> Reply:
        """``ping``; ``ping _ session <id>`` keeps the client session ``<id>`` alive."""
        p.check_text(key, arg)
        session_id = p.parse_keepalive(arg)
        if session_id is None:
            return p.REPLY_OK
        journal = self.grants.journal
        if journal is not None and not journal.writable and not journal.mark_removed:
            return p.REPLY_ERROR  # it renews the session's grants: refused as renewals are
        # ... and as `_renew` does, only where they may be held (not while fenced).
        hold_check = self.host.hold_check
        if self.table.keep_alive(session_id, hold_check):
            return p.REPLY_OK
        if hold_check is None:
            return p.REPLY_ERROR
        # Refused for keys this member may not renew now, answered as `_unconfirmed` answers
        # renewals: `error_unavailable` when it cannot tell for every one of them, else `error`.
        refused = [key for key in self.table.session_keys(session_id) if not hold_check(key)]
        if refused and all(map(self._cannot_tell, refused)):
            return p.REPLY_ERROR_UNAVAILABLE
        return p.REPLY_ERROR

    def _hello(self, cmd: bytes, key: bytes, arg: bytes) -> Reply:
        """``hello``; with sessions on, ``hello _ session`` makes this a session connection and
        ``hello _ session <id> <ttl>`` joins (``ttl`` 0: ends) the client session ``<id>``."""
        p.check_text(key, arg)
        table = self.table
        if table.session_ttl_s:
            if (named := p.parse_client_session(arg)) is not None:
                session_id, ttl = named
                if ttl:
                    table.join_session(self.client, session_id, min(ttl, self.max_lease))
                else:
                    table.end_session(session_id)
            elif p.parse_hello(arg):
                self.client.session = True
        return self.host.hello_reply

    def _shards(self, cmd: bytes, key: bytes, arg: bytes) -> Reply:
        p.check_text(key, arg)
        return self.host.shards_reply()

    def _stats(self, cmd: bytes, key: bytes, arg: bytes) -> Reply:
        p.check_text(key, arg)
        return self._later(STATS)

    def _auth(self, cmd: bytes, key: bytes, arg: bytes) -> Reply:
        secret = p.parse_auth(arg)
        expected = self.host.secret
        if expected is None:
            return p.REPLY_ERROR
        if hmac.compare_digest(secret, expected):
            self.authed = True
            return p.REPLY_OK
        log.debug("connection %s: wrong auth secret", self.peer)
        self.authed = False
        return self._later(AUTH_FAILED)

    def granted(self, waiter: Waiter) -> bytes:
        holder = waiter.holder
        assert holder is not None
        self.table.forget_enqueued(waiter)
        waiter.wake = None
        return p.reply_granted(holder.token, holder.lease_ttl)

    def timed_out(self, waiter: Waiter) -> bytes:
        """The reply to the wait for ``waiter`` that ran out of time. Call before ``give_up``."""
        if waiter.note is None:
            return p.REPLY_TIMEOUT
        return p.reply_held_by(self.table.holder_note(waiter.state.key))

    def give_up(self, waiter: Waiter) -> None:
        """The wait for ``waiter`` is answered otherwise: leave the queue."""
        waiter.wake = None
        self.table.cancel_wait(waiter)

    def fail_enqueued(self, key: str, reply: bytes) -> bool:
        """Drop this connection's pending enqueue on ``key`` (its shard moves away), the ``w``
        for it answered ``reply``. True when there was one."""
        waiter = self.client.enqueued.get(key)
        if waiter is None or waiter.holder is not None:
            return False
        self.table.cancel_wait(waiter)
        if self.moved is None:
            self.moved = {}
        self.moved[key] = reply
        return True

    def close(self, *, by_peer: bool = True) -> None:
        """The connection is gone (``by_peer``: closed by its peer): ``LockTable.disconnect``."""
        self.table.disconnect(self.client, by_peer=by_peer)

    def _later(self, action: Action) -> None:
        self.action = action

    def _malformed(self, exc: p.Malformed) -> bytes:
        log.debug("connection %s: malformed request: %s", self.peer, exc)
        return p.REPLY_ERROR

    def _too_long(self, lease: int) -> bytes:
        log.debug(
            "connection %s: lease %d s above max_lease_ttl_s (%d s): error",
            self.peer,
            lease,
            self.max_lease,
        )
        return p.REPLY_ERROR


def _refusal(exc: Exception, cannot_record: bytes = p.REPLY_ERROR) -> bytes:
    """The reply to a request the table refused; ``cannot_record`` for a ``FenceStateError``."""
    if isinstance(exc, MaxLocks):
        return p.REPLY_ERROR_MAX_LOCKS
    if isinstance(exc, MaxWaiters):
        return p.REPLY_ERROR_MAX_WAITERS
    if isinstance(exc, LimitMismatch):
        return p.REPLY_ERROR_LIMIT_MISMATCH
    if isinstance(exc, AlreadyEnqueued):
        return p.REPLY_ERROR_ALREADY_ENQUEUED
    log.error("cannot issue a token: %s", exc)
    return cannot_record


_ROUTES: Final[dict[bytes, _Route]] = Session.route_table()
