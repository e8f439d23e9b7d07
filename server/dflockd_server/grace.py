"""Restart grace: after a start, grant nothing until every lease an earlier server on this
address may have granted has surely ended (when a start waits: docs/server.md, "Restart grace").

The bound is the longest lease the previous run granted or renewed (``longest_lease_s``), which
each run records (the state dir's ``grace``, or ``<fence_state_file>.grace``) before any longer
lease is granted (``LeaseRecord``): a ``kill -9`` leaves a bound the next start can trust. It
applies after a graceful stop too: the lease is the only bound a client honours.

A grace outlives a start stopped during it: the record holds when it ends (``grace_until``: this
boot's id and a time on its monotonic clock), and a start on the same boot waits out what is
left, whatever else it decides."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from dflockd_server.config import Config
from dflockd_server.fence import FenceStateError, StateUnwritable, write_atomically
from dflockd_server.replay import boot_id
from dflockd_server.settings import names


def grace_path(fence_state_file: str) -> str:
    return fence_state_file + ".grace"


def read_longest_lease(path: str) -> int | None:
    """The longest lease recorded at ``path`` by the previous run (``None``: no record)."""
    try:
        with open(path, encoding="ascii") as fh:
            text = fh.read()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise FenceStateError(f"cannot read restart grace record {path!r}: {exc}") from exc
    try:
        value = json.loads(text)["longest_lease_s"]
    except (ValueError, TypeError, KeyError):
        value = None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise FenceStateError(
            f"restart grace record {path!r} does not hold a longest_lease_s (found "
            f"{text[:60]!r}); fix or remove it (removing it means a grace of "
            f"{names('max_lease_ttl_s')} at the next start)"
        )
    return value


def write_longest_lease(path: str, longest: int, grace_until_ms: int | None = None) -> None:
    """Persist ``longest`` atomically, with the end of this start's grace on this boot's
    monotonic clock (``grace_until_ms``) when it has one."""
    record: dict[str, object] = {"longest_lease_s": longest}
    if grace_until_ms is not None:
        record["grace_until"] = {"boot": boot_id(), "monotonic_ms": grace_until_ms}
    write_atomically(path, json.dumps(record) + "\n", prefix=".grace-", what="restart grace record")


def grace_left(path: str) -> float:
    """Seconds left of the grace of a start on this boot recorded at ``path`` (0: none, or a
    record that cannot be read: ``read_longest_lease`` says why)."""
    try:
        with open(path, encoding="ascii") as fh:
            until = json.load(fh)["grace_until"]
        boot, until_ms = until["boot"], until["monotonic_ms"]
    except (OSError, ValueError, TypeError, KeyError):
        return 0.0
    if boot != boot_id() or boot == "-" or not isinstance(until_ms, int):
        return 0.0
    return max(0.0, (until_ms - time.monotonic_ns() // 1_000_000) / 1000.0)


@dataclass(frozen=True, slots=True)
class GraceDecision:
    seconds: float  # how long after the start no key is granted (0: none)
    why: str  # why, in the user's terms, for the start-up log


def decide_grace(
    config: Config, previous_longest: int | None, fence_file_existed: bool
) -> GraceDecision:
    """The grace of a start, from the settings and what the previous run recorded."""
    if config.restart_grace_s is not None:
        return GraceDecision(config.restart_grace_s, "set by restart_grace_s")
    if config.port == 0:
        return GraceDecision(
            0.0, "port 0: no client can hold a lease from an earlier server at this address"
        )
    if config.fence_state_file is None:
        return GraceDecision(
            float(config.max_lease_ttl_s),
            "no state directory (--state-dir none): how long the previous server's leases run "
            "is unknown, so every start waits max_lease_ttl_s (give --state-dir a directory on "
            "a persistent volume: a restart then keeps the leases held and waits for none)",
        )
    if previous_longest is not None:
        if previous_longest == 0:
            return GraceDecision(0.0, "the previous run granted no lease")
        return GraceDecision(
            float(previous_longest),
            f"the previous run granted leases of up to {previous_longest} s",
        )
    if not fence_file_existed:
        return GraceDecision(0.0, "first start with this fence_state_file")
    return GraceDecision(
        float(config.max_lease_ttl_s),
        "no restart grace record beside the fence_state_file (written by an older version or "
        "removed): waiting max_lease_ttl_s",
    )


class LeaseRecord:
    """Keeps ``longest_lease_s`` on disk at or above every lease this run grants or renews
    (and the grace it started with).

    ``note(lease)``, before a lease longer than ``longest`` is granted, raises the record
    (doubling, capped at ``max_lease_ttl_s``) and returns the new bound; a failed write raises
    ``StateUnwritable``. ``publish`` (a cluster member's) stores each bound, after the file."""

    __slots__ = ("_cap", "_grace_until_ms", "_path", "_publish", "longest")

    def __init__(
        self,
        path: str | None,
        initial: float,
        cap: int,
        publish: Callable[[int], None] | None = None,
        *,
        grace_s: float = 0.0,
    ) -> None:
        """When the record cannot be written, it keeps the bound the file holds and writes the
        next one before a longer lease. ``grace_s``: this start's grace."""
        self._path = path
        self._cap = cap
        self._publish = publish
        self._grace_until_ms = (
            time.monotonic_ns() // 1_000_000 + math.ceil(grace_s * 1000) if grace_s > 0 else None
        )
        self.longest = math.ceil(initial) if initial > 0 else 0  # may exceed a lowered cap
        if path is not None:
            try:
                write_longest_lease(path, self.longest, self._grace_until_ms)
            except FenceStateError:
                try:
                    self.longest = min(self.longest, read_longest_lease(path) or 0)
                except FenceStateError:
                    self.longest = 0
        if publish is not None:
            publish(self.longest)

    def note(self, lease_ttl: int) -> int:
        if lease_ttl <= self.longest:
            return self.longest
        longest = max(lease_ttl, min(self._cap, 2 * self.longest))
        if self._path is not None:
            try:
                write_longest_lease(self._path, longest, self._grace_until_ms)
            except FenceStateError as exc:
                raise StateUnwritable(str(exc)) from exc
        if self._publish is not None:
            self._publish(longest)
        self.longest = longest
        return longest
