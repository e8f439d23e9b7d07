"""What one lock object knows of the grant it holds (no I/O here): token and fence, how long the
lease surely runs, when to renew, and reattaching after the held connection broke. A `LockCore`
decides and logs; its `HeldGrant` keeps the figures and does their arithmetic."""

from __future__ import annotations

import enum
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Final

from celery_dflock.client import _requests, wire
from celery_dflock.client._servers import ServerInfo
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


def closed_while_idle(seen: str) -> str:
    """Why a held connection found unusable while idle was dropped: `CLOSED_BY_SERVER`, and
    what the check saw (`AsyncConnection.idle_breakage`), which tells a close from the rest."""
    return f"{CLOSED_BY_SERVER}; seen: {seen}"


REATTACH_FIRST_PAUSE_S: Final = 0.05
REATTACH_MAX_PAUSE_S: Final = 1.0  # the pause after a failed reattach doubles up to this

KEPT_MARGIN_S: Final = 5.0
"""A lease kept by session keep-alives is looked at again this long before it would end (not
a renewal interval later: keep-alives further apart than the lease leave it to run out)."""


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
    """What a renewal attempt found: ``renewed``; or ``reattach`` (renew by token on a new
    connection); or ``lost_reason``."""

    renewed: bool
    lost_reason: str | None = None
    reattach: bool = False


class HeldGrant:
    """One lock object's grant, as far as this process knows (`reset` empties it)."""

    # Class-level defaults until a grant sets its own: a new one costs an empty object.
    clock: Callable[[], float] = time.monotonic  # tests/sim sets a simulated one
    token: str | None = None
    fencing: bool = False  # the server that granted `token` issues fencing tokens
    lease: int = 0
    pid: int | None = None
    # time.monotonic() until which the lease surely runs, and by which it surely ends
    lease_deadline: float = 0.0
    lease_latest_end: float = 0.0
    enqueued_at: float | None = None  # when the `e` that queued us was sent
    # On a session connection: its session time, and until when the grant surely stays held
    # (from the send time of the last request answered on it). inf: no session.
    session_ttl: int | None = None
    session_deadline: float = math.inf
    # On a server with client sessions: the grant's session. Its keep-alives sent after the
    # grant was last confirmed on the same server `run` renewed the lease too (`lease_end`).
    session: ClientSession | None = None
    confirmed_at: float = math.inf
    run: str | None = None
    kept_end: float = 0.0
    kept_at: float = -math.inf
    # A journaling server found not running (`server_down`) frees nothing before the lease
    # ends: only then is the lock lost.
    durable: bool = False
    server_down: bool = False
    reattach_failures: int = 0
    broken: str | None = None
    # Collected by a `w` (its lease counted from the `e`, over on this side already) and not
    # confirmed since: a reattach may find it held until `lease_latest_end` (`reattach_left`).
    collected: bool = False

    @property
    def fence(self) -> int | None:
        return _requests.fence_of(self.token) if self.token is not None and self.fencing else None

    def foreign_process(self) -> bool:
        """We are a fork child of the process that acquired it."""
        return self.pid is not None and self.pid != os.getpid()

    def lease_end(self) -> float:
        """Until when the lease surely runs: from the last grant or renewal's send time, or a
        later keep-alive of its session on the same server run, answered while the lease
        surely ran (a late one does not bring back a lease that ran out)."""
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

    def kept_alive(self, now: float | None = None) -> bool:
        """The session's keep-alives go on and keep the lease for more than `KEPT_MARGIN_S`:
        the lock need not renew, and looks again after `kept_for`."""
        session = self.session
        if session is None or session.keeper is None or session.ended:  # no keep-alive runs
            return False
        return self.kept_for(now) >= MIN_RENEW_INTERVAL_S

    def kept_for(self, now: float | None = None) -> float:
        """When to look again at a lease keep-alives keep: its end less ``KEPT_MARGIN_S``."""
        self.lease_end()  # looks at the last keep-alive answered
        kept_end = self.kept_end if self.kept_end else -math.inf  # -inf: none moved it
        return kept_end - (self.clock() if now is None else now) - KEPT_MARGIN_S

    def hold_deadline(self, lease_end: float | None = None) -> float:
        """Until when the grant is surely held: the lease's (``lease_end``, by default
        `lease_end`) or the session's end."""
        deadline = min(self.lease_end() if lease_end is None else lease_end, self.session_deadline)
        session = self.session
        if session is not None:
            deadline = min(deadline, session.deadline())
        return deadline

    def lease_left(self, now: float | None = None) -> float:
        """Seconds the grant surely stays held (the lease's end alone once `server_down`)."""
        return self._left(self.lease_end(), now)

    def reattach_left(self, now: float | None = None) -> float:
        """Seconds a reattach may still find the grant held: `lease_left`; for a grant collected
        by `w` and not confirmed since, counted to the latest end its lease can have (its
        reply's time plus the lease), as that grant's first renewal is awaited until then
        (`renew_reply_timeout`). Held surely or not (`hold_deadline`) is not changed by it."""
        left = self.lease_left(now)
        return max(left, self._left(self.lease_latest_end, now)) if self.collected else left

    def _left(self, lease_end: float, now: float | None) -> float:
        """Seconds to ``lease_end``, or to the session's end before it unless the server is
        not running (then the lease alone counts: it ends no session meanwhile)."""
        session = self.session
        down = self.server_down or (session is not None and session.server_down)
        deadline = lease_end if down else self.hold_deadline(lease_end)
        return deadline - (self.clock() if now is None else now)

    def session_ended(self) -> str | None:
        """Why the grant's client session is over; None when it may live, there is none, or
        the server is not running (it ends nothing)."""
        session = self.session
        if session is None or self.server_down or session.server_down or session.live():
            return None
        return f"its session with the lock server ended ({session.ended}), and the grant with it"

    def granted(  # noqa: PLR0917 - as the server's reply is read
        self,
        token: str,
        lease: int,
        started: float,
        sent_at: float,
        server: ServerInfo | None,
        session: ClientSession | None = None,
    ) -> None:
        """The server granted ``token``, its ``lease`` running from ``started`` at the earliest."""
        self.token = token
        self.fencing = server is not None and server.fences
        self.lease = lease
        self.pid = os.getpid()
        self.enqueued_at = None
        self.session = session
        self.session_ttl = None if session is not None or server is None else server.session_ttl_s
        self.session_deadline = math.inf
        self.durable = server is not None and server.supports(wire.FEATURE_DURABLE)
        self.renewed(lease, sent_at)  # the rest is as after a renewal, but the lease's start
        self.lease_deadline = started + lease
        self.collected = started < sent_at

    def renewed(
        self, seconds_remaining: int, sent_at: float, session: ClientSession | None = None
    ) -> None:
        """A renewal sent at ``sent_at`` was answered (``session``: a reattach binds to it)."""
        if session is not None:
            self.session = session
        session = self.session
        self.confirmed_at = self.clock()
        # What the server renews it for from now on, its keep-alives too: a restart with a
        # lower default lease shortens a lease that names none.
        self.lease = seconds_remaining
        self.run = None if session is None else session.run
        self.kept_end, self.kept_at = 0.0, -math.inf
        self.lease_deadline = sent_at + seconds_remaining
        self.lease_latest_end = self.clock() + seconds_remaining
        self.answered(sent_at)
        self.server_down = False
        self.broken = None
        self.reattach_failures = 0
        self.collected = False

    def left_session(self, server: ServerInfo | None, sent_at: float) -> None:
        """After `renewed`: that renewal, sent at ``sent_at``, was answered on a connection in
        no client session (its server restarted without them): the grant is that connection's,
        as if granted on it; its old session's end ends nothing of it."""
        self.session = None
        self.run = None
        self.session_ttl = None if server is None else server.session_ttl_s
        self.answered(sent_at)

    def answered(self, sent_at: float) -> None:
        if self.session_ttl is not None:
            self.session_deadline = sent_at + self.session_ttl - SESSION_MARGIN_S

    def refused(self) -> None:
        """A reconnection was refused: nobody listens at the server's address."""
        if self.durable:
            self.server_down = True

    def reset(self) -> None:
        """Nothing held; the last `lease` is kept for a caller that asks afterwards. (Each
        attribute set, not the instance's dict emptied: that slows every later read of it.)"""
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
        self.collected = False

    def renew_interval(self, renew_ratio: float) -> float:
        """``lease * renew_ratio``, bounded, and on a session connection a third of its time."""
        interval = self.lease * renew_ratio
        if self.session_ttl is not None:
            interval = min(interval, self.session_ttl / SESSION_KEEPALIVES)
        return max(MIN_RENEW_INTERVAL_S, min(interval, MAX_RENEW_INTERVAL_S))

    def first_renewal_in(self, renew_ratio: float) -> float:
        """Seconds to the first renewal (a grant collected by ``w`` may have started earlier)."""
        interval = self.renew_interval(renew_ratio)
        now = self.clock()
        if self.session_deadline - now < 2 * interval:
            return 0.0  # a grant that waited: confirm it at once
        return max(0.0, min(interval, self.lease_deadline - now - (self.lease - interval)))

    def renew_reply_timeout(self) -> float:
        """Wait for a renewal's answer until the lease surely ran out, or on a session
        connection until its deadline unless that had passed already."""
        now = self.clock()
        end = max(self.lease_latest_end, self.lease_end())
        if self.session_deadline > now:
            end = min(end, self.session_deadline)
        return max(MIN_RENEW_INTERVAL_S, min(REPLY_GRACE_S, end - now))

    def reattach_endpoint(self, endpoint: Endpoint, now: float | None = None) -> Endpoint:
        """``endpoint``, its connect timeout cut to the time a reattach has left."""
        left = max(MIN_RENEW_INTERVAL_S, self.reattach_left(now))
        if left >= endpoint.connect_timeout_s:
            return endpoint
        return replace(endpoint, connect_timeout_s=left)

    def reattach_pause(self, detail: str, now: float | None = None) -> float | None:
        """A reattach failed (``detail``): seconds to pause before the next, never past the
        lease; None once the lease ran out (`reattach_left`)."""
        self.broken = detail
        left = self.reattach_left(now)
        if left <= 0:
            return None
        pause = min(REATTACH_FIRST_PAUSE_S * 2**self.reattach_failures, REATTACH_MAX_PAUSE_S)
        self.reattach_failures += 1
        return min(pause, left)
