# pyright: reportMissingTypeStubs=false
"""A lock server that cannot be reached is a busy key, not a failure: a run whose server is
down, restarting, draining or handing over neither fails nor runs unlocked (what users see:
[A lock-server outage](../locked-tasks.md#a-lock-server-outage)).

In a worker, the first time its message meets the outage, a run reconnects for at most
`OUTAGE_RECONNECT_S` (`OutageWait`); then its message is sent again with a countdown
(`retry_outage`) under every ``on_locked`` policy, within `OUTAGE_BUDGET_S` from when the
outage was first met (`OUTAGE_HEADER`), and fails with `ServerUnavailable` after it. Waiting
out an outage in the slot would hold every slot for its whole ``lock_timeout`` and slow a warm
shutdown; a message waiting for its countdown in the broker costs no slot: only a restart
already over is worth the short reconnect. A run called directly or eagerly has no message to
send again: it reconnects within its whole ``lock_timeout``. The worker's main process counts
the outage retries it receives (`OutageCounter`).
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

from celery_dflock._celery import task_logger as logger
from celery_dflock._request import OUTAGE_HEADER, Message, backoff, header, mapping_of, resend
from celery_dflock.client.errors import ServerDraining, ServerReadOnly, ServerUnavailable
from celery_dflock.config import LockOptions

OUTAGE_BUDGET_S: Final = 600.0
"""How long a run's lock server may stay unreachable before the run fails: far beyond a
restart, short enough that a wrong ``dflock_servers`` is reported."""
OUTAGE_FIRST_COUNTDOWN_S: Final = 1.0
OUTAGE_MAX_COUNTDOWN_S: Final = 30.0
RECONNECT_FIRST_PAUSE_S: Final = 0.1
RECONNECT_MAX_PAUSE_S: Final = 1.0
OUTAGE_RECONNECT_S: Final = 2.0  # how long a run in a worker reconnects inside its pool slot


def server_state(exc: ServerUnavailable) -> str:
    """What ``exc`` says of the lock server, for a log line after "the lock server at X"."""
    if isinstance(exc, ServerReadOnly):
        return (
            "is read-only: its disk is full or failing (it cannot write its lease journal "
            "under its --state-dir), so it grants nothing new until it can; locks held stay held"
        )
    if isinstance(exc, ServerDraining):
        return "is shutting down (draining: it refuses new requests)"
    return "is unreachable"


@dataclass
class OutageWait:
    """A run's reconnecting to its unreachable lock server (monotonic clock)."""

    deadline: float
    started: float = field(default_factory=time.monotonic)
    attempts: int = 0
    address: str = "?"
    last_error: str = ""
    state: str = "is unreachable"

    @classmethod
    def for_run(cls, request: Any, started: float, wait_s: float) -> OutageWait:
        """The wait of a run that began at ``started`` with a ``lock_timeout`` of ``wait_s``."""
        deadline = started + wait_s
        if not (request.called_directly or request.is_eager):
            grace = OUTAGE_RECONNECT_S if outage_of(request) is None else 0.0
            deadline = min(deadline, time.monotonic() + grace)
        return cls(deadline=deadline, started=started)

    def next_pause(self, exc: ServerUnavailable, address: str) -> float | None:
        """Seconds to pause before trying again, or None when the run's wait is over."""
        self.address, self.last_error, self.state = address, str(exc), server_state(exc)
        pause = backoff(RECONNECT_FIRST_PAUSE_S, self.attempts, RECONNECT_MAX_PAUSE_S)
        self.attempts += 1
        return None if time.monotonic() + pause >= self.deadline else pause


class OutageState(NamedTuple):
    """What `OUTAGE_HEADER` says: since when the run has met the outage, and its retries."""

    since: float
    retries: int


def outage_of(request: Any) -> OutageState | None:
    """The `OUTAGE_HEADER` of ``request`` (None: not sent again for an outage)."""
    return parse_outage(header(request, OUTAGE_HEADER))


def parse_outage(raw: object) -> OutageState | None:
    """An `OUTAGE_HEADER` value read (None: absent or not one, or its ``since`` no time)."""
    if (data := mapping_of(raw)) is None:  # (no header: every run not waiting out an outage)
        return None
    since, retries = data.get("since"), data.get("retries")
    if not isinstance(since, int | float) or isinstance(since, bool) or not math.isfinite(since):
        return None  # (a NaN since would never spend the budget)
    count = retries if isinstance(retries, int) and not isinstance(retries, bool) else 0
    return OutageState(float(since), max(0, count))


def retry_outage(
    message: Message, key: str, options: LockOptions, wait: OutageWait, exc: ServerUnavailable
) -> BaseException:
    """The run's wait for its unreachable server is over: the exception to raise (a resend's
    `Retry` within `OUTAGE_BUDGET_S`, else `ServerUnavailable`)."""
    now = time.time()
    since, retries = outage_of(message.request) or (now - (time.monotonic() - wait.started), 0)
    down_s = max(0.0, now - since)
    direct = bool(message.request.called_directly or message.request.is_eager)
    if direct or down_s >= OUTAGE_BUDGET_S:
        why = (
            "it ran in-process (called directly or eagerly), so there is no message to send again"
            if direct
            else f"{retries} outage retries spent the {OUTAGE_BUDGET_S:.0f} s a run waits "
            f"for an unreachable lock server"
        )
        error = ServerUnavailable(
            f"{message.label} did not run: the lock server at {wait.address} (for key {key!r}) "
            f"could not grant it for {down_s:.0f} s (it {wait.state}) and {why}. Start the "
            f"lock server (`dflockd`) or set dflock_servers to where it runs, or free its "
            f"disk; check it with `celery dflock status`. The last error: {wait.last_error}"
        )
        error.__cause__ = exc
        return error
    countdown = backoff(OUTAGE_FIRST_COUNTDOWN_S, retries, OUTAGE_MAX_COUNTDOWN_S, jitter=True)
    logger.warning(
        "dflock: %s: the lock server at %s %s; sent again in %.1fs (outage retry %d, "
        "%.0f s so far; on_locked=%r applies to a busy key, not to an outage)",
        message.label,
        wait.address,
        wait.state,
        countdown,
        retries + 1,
        down_s,
        options.on_locked,
    )
    extra = {OUTAGE_HEADER: {"since": since, "retries": retries + 1}}
    return resend(message, countdown=countdown, retries=message.retries, busy=exc, extra=extra)


class OutageCounter:
    """The outage retries a worker's main process received (`OUTAGE_HEADER`), and when the
    last came; ``celery dflock status`` reads it through a remote-control command."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self.retries = 0
        self.last_at: float | None = None
        self.longest_s = 0.0

    def count(self, state: OutageState) -> None:
        with self._guard:
            self.retries += 1
            now = self.last_at = time.time()
            self.longest_s = max(self.longest_s, now - state.since)

    def as_json(self) -> dict[str, object]:
        with self._guard:
            return {
                "outage_retries": self.retries,
                "last_outage_retry_at": self.last_at,
                "longest_outage_s": round(self.longest_s, 1),
            }
