"""What one lock object knows of the grant it holds (no I/O here): its token and fence, the
lease and how long it surely runs, when to renew, and the bookkeeping of reattaching after the
held connection broke (reconnect and renew by token while the lease runs).

A `LockCore` has one `HeldGrant` (``core.grant``): the core decides, reads replies and logs;
the grant keeps the figures and does their arithmetic.
"""

from __future__ import annotations

import enum
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Final

from celery_dflock.client import _requests
from celery_dflock.client._servers import FEATURE_DURABLE, ServerInfo
from celery_dflock.client._session import SESSION_KEEPALIVES, SESSION_MARGIN_S, ClientSession
from celery_dflock.client._settings import (
    MAX_RENEW_INTERVAL_S,
    MIN_RENEW_INTERVAL_S,
    REPLY_GRACE_S,
    Endpoint,
)

CLOSED_BY_SERVER: Final = (
    "the server closed it: restarted, shutting down, a network cut or an idle timeout"
)
"""Why a held lock's connection that broke while idle went (before it reattaches)."""

REATTACH_FIRST_PAUSE_S: Final = 0.05
REATTACH_MAX_PAUSE_S: Final = 1.0
"""After a held lock's connection broke, each failed attempt to reattach (reconnect and renew
by token) is followed by a pause that doubles from the first to the most, while the lease
confirmed last still runs."""


KEPT_MARGIN_S: Final = 5.0
"""A lock whose session's keep-alives keep its lease looks at it again this long before the
lease they keep would end: in time to renew it itself should they stop unseen."""


_TOKEN_IN_TEXT: Final = re.compile(r"[0-9a-f]{16,}")


def redact(text: str) -> str:
    """``text`` with anything that looks like a token replaced (for logs and lost reasons)."""
    return _TOKEN_IN_TEXT.sub("<token>", text)


class LockState(enum.Enum):
    """Where a lock object stands, as far as this process knows."""

    IDLE = "idle"
    ENQUEUED = "enqueued"
    HELD = "held"


@dataclass(slots=True)
class RenewOutcome:
    """What a renewal attempt found: ``renewed``; or ``reattach`` (the connection is done for,
    the grant may still be held: renew it by token on a new connection); or ``lost_reason``
    (None: nothing to do)."""

    renewed: bool
    lost_reason: str | None = None
    reattach: bool = False


class HeldGrant:
    """One lock object's grant, as far as this process knows: token, lease, deadlines,
    reattaching (`reset` empties it)."""

    # The class-level values (immutable) are each grant's until it sets its own: a new one
    # costs no more than an empty object.
    clock: Callable[[], float] = time.monotonic
    """The clock every figure here is on (tests/sim sets a simulated process's own)."""
    token: str | None = None
    fencing: bool = False  # the server that granted `token` issues fencing tokens
    lease: int = 0
    pid: int | None = None
    # time.monotonic() until which the lease surely runs, and by which it surely ends
    lease_deadline: float = 0.0
    lease_latest_end: float = 0.0
    enqueued_at: float | None = None  # when the `e` that queued us was sent
    # On a session connection (the server listed `session`): its session time, and until when
    # the grant surely stays held, from the send time of the last request answered on it (the
    # server cannot have seen the close before that request): docs/protocol.md, "Tokens,
    # leases and disconnects". inf: no session (the lease alone says).
    session_ttl: int | None = None
    session_deadline: float = math.inf
    # On a server that keeps client sessions (docs/protocol.md, "Client sessions"): the
    # session the grant belongs to; its deadline bounds the grant's (`session_ttl` is then
    # None). Its keep-alives sent after the grant was last confirmed (`confirmed_at`: granted
    # or renewed) on the same server `run` renewed the lease too (`lease_end`). `kept_end`:
    # the lease's end as keep-alives moved it, `kept_at`: the last keep-alive looked at.
    session: ClientSession | None = None
    confirmed_at: float = math.inf
    run: str | None = None
    kept_end: float = 0.0
    kept_at: float = -math.inf
    # The server keeps a lease journal (`durable`) and a reconnection was refused
    # (`server_down`): nothing frees the grant before its lease ends (a restart restores it),
    # so only the lease's end makes the lock lost (the session's still makes `owned` false).
    durable: bool = False
    server_down: bool = False
    # Reattaching: failed attempts so far, and why the connection went (None: it is fine).
    reattach_failures: int = 0
    broken: str | None = None

    # ---------------------------------------------------------------- views
    @property
    def fence(self) -> int | None:
        """The fencing counter of the current token; None without one, or when its server
        does not issue fencing tokens (it did not list ``fence`` in its ``hello``)."""
        if self.token is None or not self.fencing:
            return None
        return _requests.fence_of(self.token)

    def foreign_process(self) -> bool:
        """True when the lock was acquired by another process (we are a fork child)."""
        return self.pid is not None and self.pid != os.getpid()

    def lease_end(self) -> float:
        """Until when the lease surely runs: from the last grant or renewal's send time, or from
        a keep-alive of its client session sent after that on the same server run and answered
        while the lease surely ran (a late keep-alive does not bring back a lease that ran
        out). Each keep-alive is looked at once, the last answered when this is asked: they
        chain while this is asked at least once a lease, as the renewal does (`kept_alive`)."""
        end = max(self.lease_deadline, self.kept_end)
        session = self.session
        if session is None or self.run is None or session.run != self.run:
            return end
        sent = session.renewed_at
        if sent > self.kept_at and sent > self.confirmed_at:
            self.kept_at = sent
            if session.renewal_answered_at < end and sent + self.lease > end:
                end = self.kept_end = sent + self.lease
        return end

    def _kept_end(self) -> float:
        """The lease's end as keep-alives moved it (`lease_end`), or -inf where none did."""
        self.lease_end()  # looks at the last keep-alive answered
        return self.kept_end if self.kept_end else -math.inf

    def kept_alive(self, renew_ratio: float, now: float | None = None) -> bool:
        """Whether the session's keep-alives go on (`ClientSession.keeping`) and keep the lease
        as a renewal would (over ``1 - renew_ratio`` of it left): the lock need not renew."""
        session = self.session
        if session is None or not session.keeping():
            return False
        left = self._kept_end() - (self.clock() if now is None else now)
        return left > self.lease * (1 - renew_ratio)

    def kept_for(self, now: float | None = None) -> float:
        """Seconds until the lease as keep-alives keep it ends, less ``KEPT_MARGIN_S``: when
        the lock looks at it next while they keep it (which chains them: `lease_end`)."""
        left = self._kept_end() - (self.clock() if now is None else now)
        return left - KEPT_MARGIN_S

    def hold_deadline(self) -> float:
        """Until when the grant is surely held: the lease's end, or the session's deadline (a
        session connection's, or a client session's) if sooner."""
        deadline = min(self.lease_end(), self.session_deadline)
        session = self.session
        if session is not None:
            deadline = min(deadline, session.deadline())
        return deadline

    def lease_left(self, now: float | None = None) -> float:
        """Seconds the grant surely stays held (`hold_deadline`; only the lease's end once the
        server was found not running: `server_down`). Once out, a broken lock is lost."""
        session = self.session
        down = self.server_down or (session is not None and session.server_down)
        deadline = self.lease_end() if down else self.hold_deadline()
        return deadline - (self.clock() if now is None else now)

    def session_ended(self) -> str | None:
        """Why the grant's client session is over (the server may have ended the grant with
        it); None when it may live, there is none, or the server is not running (`server_down`:
        it ends nothing)."""
        session = self.session
        if session is None or self.server_down or session.server_down or session.live():
            return None
        return f"its session with the lock server ended ({session.ended}), and the grant with it"

    # ---------------------------------------------------------------- changes
    def granted(  # noqa: PLR0917 - as the server's reply is read
        self,
        token: str,
        lease: int,
        started: float,
        sent_at: float,
        server: ServerInfo | None,
        session: ClientSession | None = None,
    ) -> None:
        """The server granted ``token`` with a ``lease`` running from ``started`` at the
        earliest (``sent_at``, or for a queued grant when it was queued); ``server``: what it
        said to ``hello``; ``session``: the client session of the connection it came on."""
        self.token = token
        self.fencing = server is not None and server.fences
        self.lease = lease
        self.pid = os.getpid()
        self.lease_deadline = started + lease
        self.lease_latest_end = self.clock() + lease
        self.enqueued_at = None
        self.session = session
        self.confirmed_at = self.clock()
        self.run = None if session is None else session.run
        self.kept_end, self.kept_at = 0.0, -math.inf
        if session is not None or server is None:
            self.session_ttl = None
        else:
            self.session_ttl = server.session_ttl_s
        self.session_deadline = math.inf
        self.answered(sent_at)
        self.durable = server is not None and server.supports(FEATURE_DURABLE)
        self.server_down = False

    def renewed(
        self, seconds_remaining: int, sent_at: float, session: ClientSession | None = None
    ) -> None:
        """A renewal sent at ``sent_at`` was answered: the lease runs ``seconds_remaining`` more.
        ``session``: the client session of the connection it came on (a reattach binds the
        grant to it)."""
        if session is not None:
            self.session = session
        session = self.session
        self.confirmed_at = self.clock()
        self.run = None if session is None else session.run
        self.kept_end, self.kept_at = 0.0, -math.inf
        self.lease_deadline = sent_at + seconds_remaining
        self.lease_latest_end = self.clock() + seconds_remaining
        self.answered(sent_at)
        self.server_down = False
        self.broken = None
        self.reattach_failures = 0

    def answered(self, sent_at: float) -> None:
        """The server answered a request about the grant sent at ``sent_at`` (a session
        connection's deadline moves on)."""
        if self.session_ttl is not None:
            self.session_deadline = sent_at + self.session_ttl - SESSION_MARGIN_S

    def refused(self) -> None:
        """A reconnection was refused (nobody listens at the server's address): see
        `server_down`."""
        if self.durable:
            self.server_down = True

    def reset(self) -> None:
        """Nothing held (after a release, a timeout, a refusal or a fork); the last `lease`
        and whether its server fenced are kept, for a caller that asks afterwards."""
        self.token = None
        self.pid = None
        self.lease_deadline = 0.0
        self.lease_latest_end = 0.0
        self.enqueued_at = None
        self.broken = None
        self.reattach_failures = 0
        self.session_ttl = None
        self.session_deadline = math.inf
        self.session = None
        self.confirmed_at = math.inf
        self.run = None
        self.kept_end, self.kept_at = 0.0, -math.inf
        self.durable = False
        self.server_down = False

    # ---------------------------------------------------------------- timing
    def renew_interval(self, renew_ratio: float) -> float:
        """Seconds between renewals: ``lease * renew_ratio``, below the server's read timeout,
        and on a session connection at most a third of the session time."""
        interval = self.lease * renew_ratio
        if self.session_ttl is not None:
            interval = min(interval, self.session_ttl / SESSION_KEEPALIVES)
        return max(MIN_RENEW_INTERVAL_S, min(interval, MAX_RENEW_INTERVAL_S))

    def first_renewal_in(self, renew_ratio: float) -> float:
        """Seconds to the first renewal of a new grant: at the usual point of the lease as far
        as it is known (a grant collected by ``w`` may have started before the ``w``)."""
        interval = self.renew_interval(renew_ratio)
        now = self.clock()
        if self.session_deadline - now < 2 * interval:
            return 0.0  # a grant that waited: confirm it at once
        remaining = self.lease_deadline - now
        return max(0.0, min(interval, remaining - (self.lease - interval)))

    def renew_reply_timeout(self) -> float:
        """Wait for a renewal's answer until the lease surely ran out (``lease_latest_end``:
        after a late ``w`` the lease may run well past ``lease_deadline``), or on a session
        connection until its deadline, unless that had passed before the renewal was sent
        (then only its answer tells whether the grant is still held)."""
        now = self.clock()
        end = max(self.lease_latest_end, self.lease_end())
        if self.session_deadline > now:
            end = min(end, self.session_deadline)
        return max(MIN_RENEW_INTERVAL_S, min(REPLY_GRACE_S, end - now))

    # ---------------------------------------------------------------- reattaching
    def reattach_endpoint(self, endpoint: Endpoint, now: float | None = None) -> Endpoint:
        """Where to reconnect: ``endpoint`` (the lock's), its connect timeout cut to the lease
        left (a connection made after the lease ran out could not save the lock)."""
        left = max(MIN_RENEW_INTERVAL_S, self.lease_left(now))
        if left >= endpoint.connect_timeout_s:
            return endpoint
        return replace(endpoint, connect_timeout_s=left)

    def reattach_pause(self, detail: str, now: float | None = None) -> float | None:
        """An attempt to reach the server again failed (``detail``): seconds to pause before
        the next (as `REATTACH_MAX_PAUSE_S` says, never past the lease); None once the lease
        ran out (the caller marks the lock lost)."""
        self.broken = detail
        left = self.lease_left(now)
        if left <= 0:
            return None
        pause = min(REATTACH_FIRST_PAUSE_S * 2**self.reattach_failures, REATTACH_MAX_PAUSE_S)
        self.reattach_failures += 1
        return min(pause, left)
