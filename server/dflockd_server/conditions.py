"""What the server cannot do now, said for an operator: the ``degraded`` list of ``stats``.

Each such state (journal read-only, restart grace, draining, fenced, shards moving, clock off)
is a ``Condition``: a name a script can test, whether it stops grants (``error``) or some for a
while (``warning``), and what it means and what to do. ``net.Server.stats`` passes in what it
knows; nothing here reads a clock or a file."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Final

ERROR: Final = "error"  # nothing new granted until it is over (a script checking it should fail)
WARNING: Final = "warning"  # some keys cannot be granted for a while; the server goes on by itself


@dataclass(frozen=True, slots=True)
class Condition:
    """One degraded state; ``title``: a few words ("Read-only")."""

    name: str
    severity: str
    title: str
    message: str

    def as_json(self) -> dict[str, str]:
        return asdict(self)


def read_only(failure: str, directory: str, advice: str, *, renewals: bool) -> Condition:
    """The lease journal under ``directory`` cannot be written (``failure``: the OS's words);
    ``renewals``: whether renewals are still answered (else refused, as keep-alives)."""
    renewing = (
        "renewals and releases go on"
        if renewals
        else "releases go on, but renewals and keep-alives are refused (error): their holders "
        "are told their locks are lost"
    )
    return Condition(
        "journal_read_only",
        ERROR,
        "Read-only",
        f"the lease journal under {directory} cannot be written ({failure}). "
        f"Nothing new is granted (acquires are answered error_read_only); every lock held "
        f"stays held, {renewing}. {advice}",
    )


def grace(seconds_left: float, reason: str, until: float) -> Condition:
    """``until``: when it ends (Unix time)."""
    why = f" ({reason})" if reason else ""
    return Condition(
        "restart_grace",
        WARNING,
        "Restart grace",
        f"{seconds_left:.1f} s left (until {time.strftime('%H:%M:%S', time.gmtime(until))} "
        f"UTC); no key is granted until every lease the "
        f"previous run may have granted has ended{why}; acquires wait meanwhile.",
    )


def draining() -> Condition:
    return Condition(
        "draining",
        ERROR,
        "Draining",
        "the server is shutting down; new requests are answered error_draining "
        "while the locks held are released or its shutdown timeout runs out.",
    )


def clock_off(offset_s: float, peer: str, ticket_life_s: int) -> Condition:
    """A cluster member's wall clock ``offset_s`` from ``peer``'s (positive: ahead)."""
    effect = (
        "every ask ticket arrives expired, so the free keys of a shard split to this member "
        "are refused until the split ends"
        if offset_s > 0
        else "ask tickets are admitted here longer than they should be"
    )
    return Condition(
        "clock_off",
        WARNING,
        "Clock off",
        f"this member's wall clock is {abs(offset_s):.0f} s "
        f"{'ahead of' if offset_s > 0 else 'behind'} member {peer}'s, more than the "
        f"{ticket_life_s} s an ask ticket lives: {effect}. Sync the members' clocks (NTP).",
    )


def cluster_conditions(
    fenced: bool, fenced_reason: str | None, shards: Mapping[str, int]
) -> list[Condition]:
    """A cluster member's: fenced, or shards moving (``shards``: the count per state)."""
    if fenced:
        why = f" ({fenced_reason})" if fenced_reason else ""
        return [
            Condition(
                "fenced",
                ERROR,
                "Fenced",
                f"this member cannot show its etcd lease alive{why}, so it grants "
                "nothing (acquires are answered error_unavailable) until it can; check that "
                "etcd is reachable from this host.",
            )
        ]
    moving_out = shards.get("moving_out", 0)
    coming_in = shards.get("taking_over", 0) + shards.get("failing_over", 0)
    if not moving_out and not coming_in:
        return []
    parts: list[str] = []
    if moving_out:
        parts.append(
            f"{moving_out} shard(s) moving out to another member, key by key (a split: a key "
            "still held here is served here until it is released, the others there)"
        )
    if coming_in:
        parts.append(f"{coming_in} shard(s) being taken over (hand-over or fail-over)")
    return [
        Condition(
            "shards_moving",
            WARNING,
            "Shards moving",
            "; ".join(parts) + ". Keys of these shards may be refused "
            "with error_unavailable for a moment; the moves finish by themselves.",
        )
    ]
