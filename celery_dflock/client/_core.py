"""The lock state machine shared by the sync and async clients (no I/O here).

`LockCore` builds each request of one lock or semaphore object and reads each reply. It has a
route (`KeyRoute`: where the key's requests go) and a grant record (`HeldGrant`: token, lease,
deadlines). The shells (`celery_dflock.client._async.lock` and its blocking twin) only move
bytes and run the renewal around it, so the two faces cannot drift.

A lease of None asks for the server's default: requests then name no lease, except ``hl`` /
``ht``, which take the default the server said in its ``hello``."""

from __future__ import annotations

import copy
import logging
import os
from types import MappingProxyType
from typing import Final

from celery_dflock.client import _by_token, _replies, _requests, wire
from celery_dflock.client._grant import HeldGrant, LockState, RenewOutcome, redact
from celery_dflock.client._refusals import refusal_error
from celery_dflock.client._replies import ErrorReply, Granted, Queued, Renewed, Reply
from celery_dflock.client._requests import (
    Command,
    checked_hold,
    checked_lock,
    checked_release,
    checked_renew,
    checked_sem_lock,
)
from celery_dflock.client._router import ClusterRouter, KeyRoute
from celery_dflock.client._servers import ServerInfo, check_lease, require_holds
from celery_dflock.client._session import ClientSession
from celery_dflock.client._settings import REPLY_GRACE_S, ClientSettings, Endpoint, whole_seconds
from celery_dflock.client.errors import DflockError, InvalidValueError, LockNotOwned

logger: Final = logging.getLogger("celery_dflock.client")


class EnqueueResult(str):
    """What ``enqueue()`` returns: ``"acquired"`` or ``"queued"``, a `str` (as dflockd's own
    clients return) true only when acquired, so ``if lock.enqueue():`` works too."""

    __slots__ = ()

    def __bool__(self) -> bool:
        return str.__eq__(self, "acquired")


ACQUIRED: Final = EnqueueResult("acquired")
QUEUED: Final = EnqueueResult("queued")
_ASK_AGAIN: Final = MappingProxyType({
    wire.STATUS_ERROR_DRAINING: "the server is shutting down",
    wire.STATUS_ERROR_UNAVAILABLE: "the cluster member cannot tell yet whether it serves the key "
    "(starting, or cut off from etcd)",
    wire.STATUS_ERROR_READ_ONLY: "the server cannot record the longer lease asked for (its disk "
    "under --state-dir is full or failing)",
})  # fmt: skip
"""The refusals of a renewal after which it reattaches and asks again (a restart may keep
the lease; a cluster member may not know its shards yet; a full disk refuses only a longer
lease), and what they mean."""


class LockCore:
    """State and decisions of one lock or semaphore object. ``settings``, ``acquire_timeout_s`` and
    ``lease_ttl_s`` (None: the settings') come checked; ``key`` and ``note`` are checked here."""

    def __init__(
        self,
        key: str,
        settings: ClientSettings,
        *,
        limit: int | None = None,
        acquire_timeout_s: int | None = None,
        lease_ttl_s: int | None = None,
        router: ClusterRouter | None = None,
        note: str | None = None,
    ) -> None:
        if acquire_timeout_s is None:
            acquire_timeout_s = settings.acquire_timeout_s
        self.routing = KeyRoute(key, limit, settings, acquire_timeout_s, router)
        self.grant = HeldGrant()
        self.state = LockState.IDLE
        self.lost = False  # kept until the next grant
        self.holder: str | None = None  # the note of a busy key's holder
        self.busy = False  # the last acquire ended with ``timeout``
        self.grace: str | None = None  # why: the server's restart grace
        self.lease_ttl_s = settings.lease_ttl_s if lease_ttl_s is None else lease_ttl_s
        self.note = None if note is None else _requests.validate_note(note)

    def __copy__(self) -> LockCore:
        """A core with its own grant and route, for a release finished in the background."""
        twin = object.__new__(LockCore)
        twin.__dict__.update(self.__dict__)
        twin.routing = copy.copy(self.routing)
        twin.grant = copy.copy(self.grant)
        return twin

    @property
    def key(self) -> str:
        return self.routing.key

    @property
    def endpoint(self) -> Endpoint:
        return self.routing.endpoint

    @property
    def what(self) -> str:
        """``lock 'key'`` or ``semaphore 'key' (limit N)``, for messages."""
        return self.routing.what

    def describe(self) -> str:
        lost = ", lost" if self.lost else ""
        return f"key={self.key!r}, server={self.endpoint.address!r}, state={self.state.value}{lost}"

    def locked(self) -> bool:
        return self.state is LockState.HELD and not self.grant.foreign_process()

    def owned(self) -> bool:
        """`locked`, not lost, and the grant surely still held (`HeldGrant.hold_deadline`)."""
        return self.locked() and not self.lost and self.grant.clock() < self.grant.hold_deadline()

    def next_look_in(self) -> float:
        """Seconds to the renewal's next look at the grant: shortly before the lease its
        session's keep-alives keep would end (`HeldGrant.kept_for`), else a renewal interval."""
        grant = self.grant
        return grant.kept_for() if grant.kept_alive() else self.renew_interval()

    def renew_interval(self) -> float:
        return self.grant.renew_interval(self.routing.settings.renew_ratio)

    def first_renewal_in(self) -> float:
        return self.grant.first_renewal_in(self.routing.settings.renew_ratio)

    def begin_acquire(self) -> None:
        self.holder = None
        self.busy = False
        self.grace = None
        self.routing.begin_acquire()

    def require_idle(self) -> None:
        if self.state is LockState.HELD and self.lost:
            raise DflockError(f"{self.what} was lost; call release() before acquiring it again")
        if self.state is LockState.HELD:
            raise DflockError(f"{self.what} is already held by this object; release() it first")
        if self.state is LockState.ENQUEUED:
            raise DflockError(
                f"{self.what} is enqueued on this object; call wait() or release() first"
            )

    def check_lease(self, server: ServerInfo | None, lease: int | None) -> None:
        """Refuse a lease above the longest ``server`` grants (when its ``hello`` says it)."""
        limit = None if server is None else server.max_lease_ttl_s
        if lease is not None and limit is not None and lease > limit:  # (no message to make)
            check_lease(server, self.endpoint.address, self.what, lease)

    def acquire_request(self, server: ServerInfo | None = None) -> _by_token.Request:
        """``l`` / ``sl``; a lock with a `note` sends ``hl ... c <note>`` to a server with holds."""
        self.require_idle()
        routing = self.routing
        timeout = routing.wait_seconds()
        lease = self.lease_ttl_s
        self.check_lease(server, lease)
        limit = routing.limit
        if limit is not None:
            data = checked_sem_lock(routing.key, timeout, limit, lease)
            return Command.SEM_LOCK, data, timeout + REPLY_GRACE_S
        note = self.note
        if note is not None and server is not None and server.supports(wire.FEATURE_HOLDS):
            hold_lease = lease if lease is not None else server.default_lease_ttl_s
            if hold_lease is not None:  # (else a server that does not say it: `l`, no note)
                data = checked_hold(routing.key, timeout, hold_lease, note, detached=False)
                return Command.HOLD, data, timeout + REPLY_GRACE_S
        return Command.LOCK, checked_lock(routing.key, timeout, lease), timeout + REPLY_GRACE_S

    def enqueue_request(self, server: ServerInfo | None = None) -> _by_token.Request:
        self.require_idle()
        self.check_lease(server, self.lease_ttl_s)
        data = _requests.checked_enqueue(self.key, self.routing.limit, self.lease_ttl_s)
        command = Command.ENQUEUE if self.routing.limit is None else Command.SEM_ENQUEUE
        return command, data, REPLY_GRACE_S

    def wait_request(self, timeout_s: float | None) -> _by_token.Request:
        """``w`` / ``sw`` (the lock must be enqueued)."""
        if self.state is not LockState.ENQUEUED:
            raise LockNotOwned(f"{self.what} is not enqueued: call enqueue() before wait()")
        timeout = (
            self.routing.acquire_timeout_s
            if timeout_s is None
            else whole_seconds("timeout_s", timeout_s, minimum=0)
        )
        command = Command.WAIT if self.routing.limit is None else Command.SEM_WAIT
        return command, _requests.checked_wait(command, self.key, timeout), timeout + REPLY_GRACE_S

    def _held_token(self) -> str:
        if self.state is not LockState.HELD or self.grant.token is None:
            raise LockNotOwned(f"{self.what} is not held by this object: acquire() it first")
        return self.grant.token

    def renew_request(self) -> _by_token.Request:
        token = self._held_token()
        command = Command.RENEW if self.routing.limit is None else Command.SEM_RENEW
        data = checked_renew(command, self.key, token, self.lease_ttl_s)
        return command, data, self.grant.renew_reply_timeout()

    def release_request(self) -> _by_token.Request:
        token = self._held_token()  # a token a grant reply matched: no second check
        if self.routing.limit is None:
            return Command.RELEASE, checked_release(self.routing.key, token), REPLY_GRACE_S
        return Command.SEM_RELEASE, _requests.checked_sem_release(self.key, token), REPLY_GRACE_S

    def hold_request(
        self, server: ServerInfo | None, note: str, *, detached: bool = True
    ) -> _by_token.Request:
        """``hl ... d <note>`` (not ``detached``: ``hl ... c <note>``); ``note`` comes checked."""
        self.require_idle()
        lease = self.hold_lease(require_holds(server, self.endpoint.address, self.what))
        timeout = self.routing.wait_seconds()
        data = checked_hold(self.key, timeout, lease, note, detached=detached)
        return Command.HOLD, data, timeout + REPLY_GRACE_S

    def hold_lease(self, server: ServerInfo) -> int:
        """The lease ``hl`` and ``ht`` name: the lock's, else the server's default."""
        lease = self.lease_ttl_s
        if lease is not None:
            self.check_lease(server, lease)
            return lease
        if server.default_lease_ttl_s is not None:
            return server.default_lease_ttl_s
        raise InvalidValueError(
            f"{self.what}: a hold names its lease, and server {self.endpoint.address} "
            f"({server.describe()}) does not say its default lease in its hello: give the "
            "lock a lease (lease_ttl_s=, or the option that sets it)"
        )

    def take_over_note(self, note: str | None) -> str:
        """The note ``ht`` carries for `adopt`: ``note``, else this lock's `note`."""
        if note is not None:
            return _requests.validate_note(note)
        if self.note is not None:
            return self.note
        raise InvalidValueError(
            f"adopting a hold of {self.what} needs an owner note: pass note= to adopt() or "
            "make the lock with note="
        )

    def take_over_request(
        self, server: ServerInfo | None, token: str, note: str, on_close_lease: int | None
    ) -> _by_token.Request:
        """``ht <token> <lease> <onclose> <note>``: take over a detached grant (``token`` and
        ``note`` come checked)."""
        self.require_idle()
        lease = self.hold_lease(require_holds(server, self.endpoint.address, self.what))
        self.check_lease(server, on_close_lease)
        data = _requests.checked_take(self.key, token, lease, on_close_lease, note)
        return Command.TAKE, data, REPLY_GRACE_S

    def hand_off_request(self, lease_ttl: int, server: ServerInfo | None) -> _by_token.Request:
        """``hd <token> <lease_ttl>``; a server without holds gets ``n <token> <lease_ttl>``."""
        token = self._held_token()
        if server is None or not server.supports(wire.FEATURE_HOLDS):
            return _by_token.renew_request(
                server, self.endpoint.address, self.key, token, lease_ttl
            )
        self.check_lease(server, lease_ttl)
        data = _requests.checked_hand_down(self.key, token, lease_ttl)  # checked by hand_off()
        return Command.HAND_DOWN, data, REPLY_GRACE_S

    def on_grant_reply(
        self,
        command: Command,
        reply: Reply,
        sent_at: float,
        server: ServerInfo | None,
        session: ClientSession | None = None,
    ) -> bool:
        """Read the reply to an acquire, enqueue, wait or hold: True held, False not (``queued``
        leaves it ENQUEUED). Raises for refusals."""
        if isinstance(reply, Granted):
            started = sent_at
            enqueued_at = self.grant.enqueued_at
            if command in (Command.WAIT, Command.SEM_WAIT) and enqueued_at is not None:
                # A queued grant's lease may have started long before this `w`: count it from
                # the enqueue, the earliest it can be.
                started = enqueued_at
            self.state = LockState.HELD
            self.lost = False
            self.grant.granted(reply.token, reply.lease, started, sent_at, server, session)
            return True
        if isinstance(reply, Queued):
            self.state = LockState.ENQUEUED
            self.grant.pid = os.getpid()
            self.grant.enqueued_at = sent_at
            return False
        self.reset()
        if isinstance(reply, _replies.TimedOut):
            self.busy = True
            self.holder = reply.holder
            if server is not None and (left := server.grace_until - self.routing.clock()) > 0:
                self.grace = (
                    f"{self.what} was not granted: server {self.endpoint.address} is in its "
                    f"restart grace, granting no key for {left:.0f} s more (celery dflock status)"
                )
            return False
        if isinstance(reply, _replies.Moved):
            logger.warning(
                "%s: its shard moved to %s while it was queued on %s; not acquired (acquire "
                "again: the cluster routes it there)",
                self.what,
                reply.address,
                self.endpoint.address,
            )
            return False
        if isinstance(reply, ErrorReply) and reply.code == wire.STATUS_ERROR_LEASE_EXPIRED:
            logger.warning(
                "%s on %s was granted while queued, but its lease ran out before wait() "
                "collected it; call wait() sooner after enqueue() or use a longer lease",
                self.what,
                self.endpoint.address,
            )
            return False
        raise self.error_for(command, reply)

    def on_take_over_reply(
        self,
        token: str,
        reply: Reply,
        sent_at: float,
        server: ServerInfo | None,
        session: ClientSession | None = None,
    ) -> bool:
        """Read the reply to `take_over_request`: True when held now, False when ``token`` no
        longer holds the key or is bound elsewhere (`holder` names it)."""
        self.holder = None
        self.busy = False
        if isinstance(reply, Renewed) and reply.seconds_remaining > 0:
            granted = Granted(token, reply.seconds_remaining)
            return self.on_grant_reply(Command.LOCK, granted, sent_at, server, session)
        if isinstance(reply, _replies.Bound):
            self.busy = True
            self.holder = reply.holder
            return False
        if isinstance(reply, ErrorReply) and reply.code == wire.STATUS_ERROR:
            return False
        raise self.error_for(Command.TAKE, reply)

    def on_release_reply(self, reply: Reply, *, retried: bool = False) -> bool:
        """Read the reply to ``r``/``sr``: True if this release freed the lock.

        A refusal marks the lock lost, kept HELD so the caller can notify before it `reset`s.
        ``retried`` (an earlier attempt may have freed it): a refusal proves no loss."""
        if isinstance(reply, _replies.Ok):
            self.reset()
            return True
        code = reply.code if isinstance(reply, ErrorReply) else repr(reply)
        if retried:
            logger.info(
                "dflock %s: the server no longer held it when the release was sent again "
                "(reply %r); the first release, whose answer was lost with its connection, "
                "may have freed it",
                self.what,
                code,
            )
            self.reset()
            return False
        self.mark_lost(
            "the server no longer held it when it was released (the lease had run out or it "
            f"was released elsewhere; reply {code!r})"
        )
        return False

    def error_for(self, command: Command, reply: Reply) -> DflockError:
        return refusal_error(
            command,
            reply,
            what=self.what,
            endpoint=self.endpoint,
            limit=self.routing.limit,
            lease_ttl_s=self.lease_ttl_s,
        )

    def on_renew_reply(
        self, reply: Reply, sent_at: float, session: ClientSession | None = None
    ) -> RenewOutcome:
        """Read the reply to ``n``/``sn``: ``error_draining`` and ``error_unavailable``
        reattach (a restart may keep the lease; a cluster member may not know its shards yet);
        ``error``, or the grant's session over meanwhile: lost."""
        grant = self.grant
        ended = grant.session_ended()
        if ended is not None:
            return RenewOutcome(renewed=False, lost_reason=ended)
        if isinstance(reply, Renewed):
            if grant.broken is not None:
                logger.info(
                    "dflock %s reattached to the lock server at %s (its connection had "
                    "closed: %s); still held",
                    self.what,
                    self.endpoint.address,
                    redact(grant.broken),
                )
            grant.renewed(reply.seconds_remaining, sent_at, session)
            return RenewOutcome(renewed=True)
        code = reply.code if isinstance(reply, ErrorReply) else repr(reply)
        if (why := _ASK_AGAIN.get(code)) is not None:
            return RenewOutcome(renewed=False, lost_reason=why, reattach=True)
        if code == wire.STATUS_ERROR and grant.broken is not None:
            why = (
                f"its connection closed ({grant.broken}), and the server refused the renewal "
                "by token on a new connection (it released the lock with the connection, or "
                "restarted without it, or the lease had expired)"
            )
        elif code == wire.STATUS_ERROR:
            why = (
                "the server refused the renewal (the lease had expired, or was released: "
                "by its token, or by an operator's force release)"
            )
        else:
            why = f"the server answered {code!r} to the renewal"
        return RenewOutcome(renewed=False, lost_reason=why)

    def connection_broke(self, detail: str) -> None:
        """The held lock's connection closed or failed (``detail``): the server may still hold
        the grant, so the lock reattaches rather than count it lost."""
        grant = self.grant
        if grant.broken is None:
            grant.reattach_failures = 0
            logger.info(
                "dflock %s: its connection to %s closed (%s); reattaching by token while the "
                "lease runs (%.1f s left)",
                self.what,
                self.endpoint.address,
                redact(detail),
                max(0.0, grant.reattach_left()),
            )
        grant.broken = detail

    def reattach_endpoint(self, now: float | None = None) -> Endpoint:
        return self.grant.reattach_endpoint(self.endpoint, now)

    def mark_unreachable(self) -> bool:
        """`mark_lost`: the lease ran out before the server could be reached again."""
        return self.mark_lost(
            f"its connection to the lock server at {self.endpoint.address} closed "
            f"({self.grant.broken or 'unknown cause'}), and the server could not be reached "
            "again before the lease ran out"
        )

    @staticmethod
    def draining(reply: Reply) -> bool:
        """``error_draining``: a request about a held grant is sent again on a new connection."""
        return isinstance(reply, ErrorReply) and reply.code == wire.STATUS_ERROR_DRAINING

    def mark_lost(self, reason: str) -> bool:
        """True the first time (the caller then notifies)."""
        if self.lost or self.state is not LockState.HELD:
            return False
        self.lost = True
        logger.warning(
            "dflock %s on %s was lost: %s", self.what, self.endpoint.address, redact(reason)
        )
        return True

    def reset(self) -> None:
        self.state = LockState.IDLE
        self.grant.reset()
