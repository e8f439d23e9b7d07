"""The lock state machine shared by the sync and async clients (no I/O here).

`LockCore` builds each request of one lock or semaphore object and interprets each reply,
moving the lock from state to state. It stands on `HeldGrant` (`celery_dflock.client._grant`:
what is known of the grant held, its lease, loss and reattaching), which stands on `KeyRoute`
(`celery_dflock.client._router`: where the key's requests go, and how an acquire follows a
cluster's redirects). The shells (`celery_dflock.client._async.lock` and the blocking twin
generated from it) only move bytes and run the renewal thread / task around it, so the two
faces cannot drift apart.
"""

from __future__ import annotations

import logging
import math
import os
import time
from typing import Final

from celery_dflock.client import _by_token, protocol, wire
from celery_dflock.client._grant import HeldGrant, LockState
from celery_dflock.client._refusals import refusal_error
from celery_dflock.client._requests import checked_hold, checked_lock, checked_release
from celery_dflock.client._router import ClusterRouter, KeyRoute
from celery_dflock.client._servers import (
    FEATURE_DURABLE,
    FEATURE_HOLDS,
    ServerInfo,
    require_holds,
)
from celery_dflock.client._settings import ClientSettings, whole_seconds
from celery_dflock.client.errors import DflockError, InvalidValueError, LockNotOwned, ProtocolError
from celery_dflock.client.protocol import (
    Command,
    ErrorReply,
    Granted,
    Moved,
    Queued,
    Renewed,
    Reply,
    TimedOut,
)

logger: Final = logging.getLogger("celery_dflock.client")

Request = _by_token.Request
"""(command, bytes, reply timeout)."""


class EnqueueResult(str):
    """What ``enqueue()`` returns: ``"acquired"`` (held now) or ``"queued"`` (call ``wait()``).

    A `str`, as dflockd's own clients and the Go client return, that is also true only when
    acquired, so ``if lock.enqueue() == "acquired":`` and ``if lock.enqueue():`` both read
    naturally (code written for the earlier ``True``/``False`` keeps working).
    """

    __slots__ = ()

    def __bool__(self) -> bool:
        return str.__eq__(self, "acquired")


ACQUIRED: Final = EnqueueResult("acquired")
QUEUED: Final = EnqueueResult("queued")


class LockCore(HeldGrant):
    """State and decisions of one lock or semaphore object; every method is I/O free.

    ``settings`` are taken as they are (checked once, where they were given); so are the
    lock's own ``acquire_timeout_s`` and ``lease_ttl_s`` (whole seconds, checked by whoever
    took them from the user). ``key`` and ``note`` are checked here."""

    def __init__(
        self,
        key: str,
        settings: ClientSettings,
        *,
        limit: int | None = None,
        acquire_timeout_s: int,
        lease_ttl_s: int | None,
        router: ClusterRouter | None = None,
        note: str | None = None,
    ) -> None:
        KeyRoute.__init__(self, key, limit, settings, acquire_timeout_s, router)
        self.lease_ttl_s = lease_ttl_s
        self.note = None if note is None else protocol.validate_note(note)
        """The owner note sent with each acquire (``hl ... c <note>``) to a server with holds."""

    def describe(self) -> str:
        """A repr body without the token."""
        return f"key={self.key!r}, server={self.endpoint.address!r}, state={self.state.value}" + (
            ", lost" if self.lost else ""
        )

    # ---------------------------------------------------------------- requests
    def _require_idle(self) -> None:
        if self.state is LockState.HELD and self.lost:
            raise DflockError(f"{self.what} was lost; call release() before acquiring it again")
        if self.state is LockState.HELD:
            raise DflockError(f"{self.what} is already held by this object; release() it first")
        if self.state is LockState.ENQUEUED:
            raise DflockError(
                f"{self.what} is enqueued on this object; call wait() or release() first"
            )

    def check_lease(self, server: ServerInfo | None, lease: int | None) -> None:
        """Refuse, before asking, a lease above the longest ``server`` grants (its ``hello``
        says so; a server that does not is asked as it is)."""
        limit = None if server is None else server.max_lease_ttl_s
        if lease is None or limit is None or lease <= limit:
            return
        raise InvalidValueError(
            f"{self.what}: the lease asked for ({lease} s) is above the longest lease server "
            f"{self.endpoint.address} grants ({limit} s, its --max-lease-ttl / "
            "DFLOCKD_MAX_LEASE_TTL_S). Ask for a shorter lease (lease_ttl_s=; in Celery the "
            "lock_ttl option or the dflock_lock_ttl setting, lock_pending_ttl for a key held "
            "from publish, dflock_beat_lease_ttl for beat): renewal keeps a lock held however "
            "long the work runs. Or start the server with a larger --max-lease-ttl"
        )

    def acquire_request(self, server: ServerInfo | None = None) -> Request:
        """``l`` / ``sl`` with the acquire timeout: (command, bytes, reply timeout). A lock
        with a `note` sends ``hl ... c <note>`` instead to a ``server`` that has holds."""
        self._require_idle()
        timeout = self.wait_seconds()
        if self.limit is None:
            if self.note is not None and server is not None and server.supports(FEATURE_HOLDS):
                lease = self.hold_lease()
                self.check_lease(server, lease)
                # (the key, the note, the timeout and the lease were checked when this object
                # was made: built without checking them again)
                data = checked_hold(self.key, timeout, lease, self.note, detached=False)
                return Command.HOLD, data, self.reply_timeout(timeout)
            self.check_lease(server, self.lease_ttl_s)
            data = checked_lock(self.key, timeout, self.lease_ttl_s)
            return Command.LOCK, data, self.reply_timeout(timeout)
        self.check_lease(server, self.lease_ttl_s)
        data = protocol.encode_sem_lock(self.key, timeout, self.limit, self.lease_ttl_s)
        return Command.SEM_LOCK, data, self.reply_timeout(timeout)

    def enqueue_request(self, server: ServerInfo | None = None) -> Request:
        """``e`` / ``se``."""
        self._require_idle()
        self.check_lease(server, self.lease_ttl_s)
        if self.limit is None:
            data = protocol.encode_enqueue(self.key, self.lease_ttl_s)
            return Command.ENQUEUE, data, self.reply_timeout()
        data = protocol.encode_sem_enqueue(self.key, self.limit, self.lease_ttl_s)
        return Command.SEM_ENQUEUE, data, self.reply_timeout()

    def wait_request(self, timeout_s: float | None) -> Request:
        """``w`` / ``sw`` (the lock must be enqueued)."""
        if self.state is not LockState.ENQUEUED:
            raise LockNotOwned(f"{self.what} is not enqueued: call enqueue() before wait()")
        timeout = (
            self.acquire_timeout_s
            if timeout_s is None
            else whole_seconds("timeout_s", timeout_s, minimum=0)
        )
        command = Command.WAIT if self.limit is None else Command.SEM_WAIT
        encode = protocol.encode_wait if self.limit is None else protocol.encode_sem_wait
        return command, encode(self.key, timeout), self.reply_timeout(timeout)

    def _held_token(self) -> str:
        if self.state is not LockState.HELD or self.token is None:
            raise LockNotOwned(f"{self.what} is not held by this object: acquire() it first")
        return self.token

    def renew_request(self) -> Request:
        """``n`` / ``sn`` for the held token."""
        token = self._held_token()
        if self.limit is None:
            data = protocol.encode_renew(self.key, token, self.lease_ttl_s)
            return Command.RENEW, data, self.renew_reply_timeout()
        data = protocol.encode_sem_renew(self.key, token, self.lease_ttl_s)
        return Command.SEM_RENEW, data, self.renew_reply_timeout()

    def release_request(self) -> Request:
        """``r`` / ``sr`` for the held token."""
        token = self._held_token()
        if self.limit is None:
            data = checked_release(self.key, token)  # a token a grant reply matched
            return Command.RELEASE, data, self.reply_timeout()
        data = protocol.encode_sem_release(self.key, token)
        return Command.SEM_RELEASE, data, self.reply_timeout()

    def hold_request(
        self, server: ServerInfo | None, note: str, *, detached: bool = True
    ) -> Request:
        """``hl ... d <note>``: a detached hold; not ``detached``: ``hl ... c <note>``, bound
        to the connection until `detach_token_request` (`HoldsUnsupported` unless ``server``
        has holds)."""
        self._require_idle()
        require_holds(server, self.endpoint.address, self.what)
        self.check_lease(server, self.hold_lease())
        timeout = self.wait_seconds()
        data = protocol.encode_hold(self.key, timeout, self.hold_lease(), note, detached=detached)
        return Command.HOLD, data, self.reply_timeout(timeout)

    def hold_lease(self) -> int:
        """The lease ``hl`` asks for (it always names one): the lock's, else the protocol's
        default."""
        return wire.DEFAULT_LEASE_TTL_S if self.lease_ttl_s is None else self.lease_ttl_s

    def take_over_note(self, note: str | None) -> str:
        """The note ``ht`` carries for `adopt`: ``note``, else this lock's `note`; a
        `ValueError` (an `InvalidValueError`) when neither is given (``ht`` always names one)."""
        if note is not None:
            return protocol.validate_note(note)
        if self.note is not None:
            return self.note
        raise InvalidValueError(
            f"adopting a hold of {self.what} needs an owner note: pass note= to adopt() or "
            "make the lock with note="
        )

    def take_over_request(
        self, server: ServerInfo | None, token: str, note: str, on_close_lease: int | None
    ) -> Request:
        """``ht <token> <lease> <onclose> <note>``: take over a detached grant made elsewhere,
        bound to this connection from now on (`HoldsUnsupported` unless ``server`` has
        holds)."""
        self._require_idle()
        require_holds(server, self.endpoint.address, self.what)
        self.check_lease(server, self.hold_lease())
        data = protocol.encode_take(self.key, token, self.hold_lease(), on_close_lease, note)
        return Command.TAKE, data, self.reply_timeout()

    def hand_off_request(self, lease_ttl: int, server: ServerInfo | None) -> Request:
        """``hd <token> <lease_ttl>`` for the held token: detach it from this connection before
        letting go of it. A ``server`` without holds gets ``n <token> <lease_ttl>`` (its grant
        stays bound to the connection, which goes back to the pool)."""
        token = self._held_token()
        if server is None or not server.supports(FEATURE_HOLDS):
            return _by_token.renew_request(self.key, token, lease_ttl)
        data = protocol.encode_hand_down(self.key, token, lease_ttl)
        return Command.HAND_DOWN, data, self.reply_timeout()

    # ---------------------------------------------------------------- replies
    def on_grant_reply(
        self, command: Command, reply: Reply, sent_at: float, server: ServerInfo | None
    ) -> bool:
        """Interpret the reply to ``l``/``sl``/``e``/``se``/``w``/``sw``; ``server`` is what the
        server said to ``hello`` (its tokens count as fences only if it lists ``fence``).

        True: held (the caller pins the connection and starts renewing). False: not held
        (``queued`` leaves the state ENQUEUED, the connection stays pinned). Raises for refusals.
        """
        if isinstance(reply, Granted):
            started = sent_at
            if command in (Command.WAIT, Command.SEM_WAIT) and self.enqueued_at is not None:
                # The server grants a queued lock when it is freed, and its lease runs from
                # then, possibly long before this `w` was sent; the reply still carries the
                # whole lease. The earliest that can be is when we enqueued.
                started = self.enqueued_at
            self.state = LockState.HELD
            self.token = reply.token
            self.fencing = server is not None and server.fences
            self.lease = reply.lease
            self.lost = False
            self.pid = os.getpid()
            self.lease_deadline = started + reply.lease
            self.lease_latest_end = time.monotonic() + reply.lease
            self.enqueued_at = None
            self.session_ttl = None if server is None else server.session_ttl_s
            self.session_deadline = math.inf
            self.answered(sent_at)
            self.durable = server is not None and server.supports(FEATURE_DURABLE)
            self.server_down = False
            return True
        if isinstance(reply, Queued):
            self.state = LockState.ENQUEUED
            self.pid = os.getpid()
            self.enqueued_at = sent_at
            return False
        self.reset()
        if isinstance(reply, TimedOut):
            self.busy = True
            self.holder = reply.holder
            return False
        if isinstance(reply, Moved):
            logger.warning(
                "%s: its shard moved to %s while it was queued on %s; not acquired (acquire "
                "again: the cluster routes it there)",
                self.what,
                reply.address,
                self.endpoint.address,
            )
            return False
        if isinstance(reply, ErrorReply):
            if reply.code == wire.STATUS_ERROR_LEASE_EXPIRED:
                logger.warning(
                    "%s on %s was granted while queued, but its lease ran out before wait() "
                    "collected it; call wait() sooner after enqueue() or use a longer lease",
                    self.what,
                    self.endpoint.address,
                )
                return False
            raise self.error_for(command, reply)
        raise ProtocolError(f"unexpected reply {reply!r} to {command.label}")

    def on_take_over_reply(
        self, token: str, reply: Reply, sent_at: float, server: ServerInfo | None
    ) -> bool:
        """Interpret the reply to `take_over_request`: True when held now (as after a grant),
        False when ``token`` no longer holds the key or another connection has it bound
        (`holder` then says that holder's note)."""
        self.holder = None
        self.busy = False
        if isinstance(reply, Renewed) and reply.seconds_remaining > 0:
            granted = Granted(token, reply.seconds_remaining)
            return self.on_grant_reply(Command.LOCK, granted, sent_at, server)
        if isinstance(reply, protocol.Bound):
            self.busy = True
            self.holder = reply.holder
            return False
        if isinstance(reply, ErrorReply) and reply.code == wire.STATUS_ERROR:
            return False
        if isinstance(reply, ErrorReply):
            raise self.error_for(Command.TAKE, reply)
        raise ProtocolError(f"unexpected reply {reply!r} to {Command.TAKE.label}")

    def on_release_reply(self, reply: Reply, *, retried: bool = False) -> bool:
        """Interpret the reply to ``r``/``sr``: True if this release freed the lock.

        A refusal means the server no longer held this grant: its lease ran out while this
        process still counted on it (paused, or its renewals did not get through), or it was
        released from elsewhere. The lock was lost while held: it is marked lost here and
        stays HELD, so the caller can notify (with the fence still known) before it `reset`s.
        A confirmed release resets at once. ``retried``: an earlier release of this grant was
        sent and its connection broke before the answer came; that release may have freed
        it, so a refusal is no proof of a loss (reset, not marked lost).
        """
        if isinstance(reply, protocol.Ok):
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

    def error_for(self, command: Command, reply: ErrorReply) -> DflockError:
        """The exception for a refusal, with a message that says what to do."""
        return refusal_error(
            command,
            reply,
            what=self.what,
            endpoint=self.endpoint,
            limit=self.limit,
            lease_ttl_s=self.lease_ttl_s,
        )
