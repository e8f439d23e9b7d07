# pyright: reportMissingTypeStubs=false
"""A lock server that cannot be reached is a busy key, not a failure (issue 49).

A run whose lock server is down, restarting, draining or handing over (`ServerUnavailable`,
`ServerDraining`, a wait cut by the server's restart) neither fails nor runs unlocked:

1. It waits, reconnecting with a short backoff, for as long as its ``lock_timeout`` wait in
   the key's queue would have lasted (`OutageWait`): a FIFO waiter cut by a restart joins the
   queue of the restarted server again at once, and takes the key the moment it frees.
2. When that wait is over (``lock_timeout=0``, the default of ``"skip"`` and ``"raise"``,
   ends it at once), the message is sent again with a countdown (`retry_outage`), under every
   ``on_locked`` policy: ``"skip"`` and ``"raise"`` are about a key another run holds, and an
   unreachable server says nothing of that; skipping would drop a run that may be the only
   one. An outage retry uses neither ``lock_max_retries`` nor Celery's ``max_retries``: it
   has its own budget, `OUTAGE_BUDGET_S` from when the outage was first met, carried in the
   `OUTAGE_HEADER` of the message.
3. Once the budget is spent, the run fails with a `ServerUnavailable` that says which server
   was unreachable, for how long, and what to do.

A run called directly or eagerly has no message to send again: it waits as in 1, then fails.
The worker's main process counts the outage retries it receives (`OutageCounter`;
``celery dflock status`` shows them) and logs when its servers answer again.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, cast

from celery_dflock._celery import get_task_logger
from celery_dflock._request import OUTAGE_HEADER, header, lock_retries, resend, run_name
from celery_dflock.client.errors import ServerUnavailable
from celery_dflock.config import LockOptions

__all__ = [
    "OUTAGE_BUDGET_S",
    "OUTAGE_HEADER",
    "OutageCounter",
    "OutageWait",
    "outage_countdown",
    "outage_of",
    "parse_outage",
    "retry_outage",
]

logger: Any = get_task_logger("celery_dflock.task")
"""For messages logged while the task runs (Celery prefixes them with ``name[id]``)."""

OUTAGE_BUDGET_S: Final = 600.0
"""How long a run's lock server may stay unreachable (from when the run first met the
outage, across the messages it is sent again as) before the run fails: ten minutes, far
beyond a restart or a hand-over, short enough that a wrong ``dflock_servers`` is reported."""

OUTAGE_FIRST_COUNTDOWN_S: Final = 1.0
OUTAGE_MAX_COUNTDOWN_S: Final = 30.0
"""An outage retry is sent again in 1 s, doubling up to 30 s (with jitter: a restarted
server is not met by every waiting run at the same instant)."""

RECONNECT_FIRST_PAUSE_S: Final = 0.1
RECONNECT_MAX_PAUSE_S: Final = 1.0
"""Within its ``lock_timeout``, a run tries its server again after 0.1 s, doubling up to 1 s
(a restarted server is found within a second of it listening)."""


@dataclass
class OutageWait:
    """A run's wait for its lock server, within its ``lock_timeout`` (monotonic clock)."""

    deadline: float
    """When the run's ``lock_timeout`` wait (from the run's start) is over."""
    started: float = field(default_factory=time.monotonic)
    attempts: int = 0
    address: str = "?"
    last_error: str = ""

    def next_pause(self, exc: ServerUnavailable, address: str) -> float | None:
        """The server could not be reached (``exc``): seconds to pause before trying again,
        or None when the run's wait is over (then it is sent again, `retry_outage`)."""
        self.address, self.last_error = address, str(exc)
        pause = min(RECONNECT_FIRST_PAUSE_S * 2 ** min(self.attempts, 16), RECONNECT_MAX_PAUSE_S)
        self.attempts += 1
        if time.monotonic() + pause >= self.deadline:
            return None
        return pause

    def left(self) -> float:
        """Seconds of the run's wait still to come (never below 0)."""
        return max(0.0, self.deadline - time.monotonic())

    def waited(self) -> float:
        return time.monotonic() - self.started


@dataclass(frozen=True, slots=True)
class OutageState:
    """What `OUTAGE_HEADER` says: since when the run has met the outage, and its retries."""

    since: float
    retries: int


def outage_of(request: Any) -> OutageState | None:
    """The `OUTAGE_HEADER` of ``request`` (None: not sent again for an outage)."""
    return parse_outage(header(request, OUTAGE_HEADER))


def parse_outage(raw: object) -> OutageState | None:
    """An `OUTAGE_HEADER` value read (None: absent or not one)."""
    if not isinstance(raw, Mapping):
        return None
    data = cast("Mapping[str, object]", raw)
    since, retries = data.get("since"), data.get("retries")
    if not isinstance(since, int | float) or isinstance(since, bool):
        return None
    count = retries if isinstance(retries, int) and not isinstance(retries, bool) else 0
    return OutageState(float(since), max(0, count))


def outage_countdown(retries: int) -> float:
    """The countdown of outage retry number ``retries + 1`` (doubling, capped, jittered)."""
    countdown = min(OUTAGE_FIRST_COUNTDOWN_S * 2 ** min(retries, 16), OUTAGE_MAX_COUNTDOWN_S)
    return countdown / 2 + random.uniform(0, countdown / 2)


def retry_outage(
    task: Any,
    request: Any,
    key: str,
    options: LockOptions,
    call: tuple[tuple[Any, ...], dict[str, Any]],
    *,
    wait: OutageWait,
    exc: ServerUnavailable,
) -> BaseException:
    """The run's wait for its unreachable server is over: the exception to raise, a resend
    with `outage_countdown` (the `Retry` Celery expects) within `OUTAGE_BUDGET_S`, else a
    `ServerUnavailable` that says for how long the server was unreachable and what to do."""
    run = run_name(str(task.name), request.id)
    state = outage_of(request)
    now = time.time()
    since = state.since if state is not None else now - wait.waited()
    retries = state.retries if state is not None else 0
    down_s = max(0.0, now - since)
    direct = bool(request.called_directly or request.is_eager)
    if direct or down_s >= OUTAGE_BUDGET_S:
        why = (
            "it ran in-process (called directly or eagerly), so there is no message to send again"
            if direct
            else f"{retries} outage retries spent the {OUTAGE_BUDGET_S:.0f} s a run waits "
            f"for an unreachable lock server"
        )
        error = ServerUnavailable(
            f"{run} did not run: the lock server at {wait.address} (for key {key!r}) was "
            f"unreachable for {down_s:.0f} s and {why}. Start the lock server (`dflockd`) or "
            f"set dflock_servers to where it runs; check it with `celery dflock status`. "
            f"The last error: {wait.last_error}"
        )
        error.__cause__ = exc
        return error
    countdown = outage_countdown(retries)
    logger.warning(
        "dflock: %s: the lock server at %s is unreachable (%.0f s so far); sent again in "
        "%.1fs (outage retry %d; on_locked=%r applies to a busy key, not to an outage)",
        run,
        wait.address,
        down_s,
        countdown,
        retries + 1,
        options.on_locked,
    )
    return resend(
        task,
        request,
        call,
        countdown=countdown,
        retries=lock_retries(request),
        busy=exc,
        extra={OUTAGE_HEADER: {"since": since, "retries": retries + 1}},
    )


class OutageCounter:
    """What a worker's main process counts of outages: the messages it received that were
    sent again because their lock server was unreachable (`OUTAGE_HEADER`), and when the
    last one came. Read by ``celery dflock status`` through a remote-control command."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self.retries = 0
        self.last_at: float | None = None
        """Epoch seconds of the last outage retry received (None: none yet)."""
        self.longest_s = 0.0
        """The longest outage one of those runs had met, in seconds."""

    def count(self, state: OutageState) -> None:
        with self._guard:
            self.retries += 1
            now = time.time()
            self.last_at = now
            self.longest_s = max(self.longest_s, now - state.since)

    def as_json(self) -> dict[str, object]:
        with self._guard:
            return {
                "outage_retries": self.retries,
                "last_outage_retry_at": self.last_at,
                "longest_outage_s": round(self.longest_s, 1),
            }
