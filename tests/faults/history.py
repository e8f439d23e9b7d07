"""A checker for lock histories: pure functions over the holds that clients recorded.

Each client records, per acquire attempt, a `Hold`: when it asked (``requested_t``), when its
enqueue was acknowledged (two-phase ``e``: ``enqueued_t``), when the grant reached it
(``granted_t``), the fence, the lease, what it learnt from renewals and the release, and how
the hold ended. Times are ``time.monotonic()`` values, one clock for every process on a Linux
host. `check_history` then verifies, without trusting any client's opinion of its own lease:

(a) **No double grant**: no two holds of a key overlap while both were *provably* valid on the
    server (see `Hold.valid_until`). A client paused past its lease still believes it holds the
    lock when it resumes; that is not a double grant, it is what fencing is for.
(b) **Fences follow grant order**: when one grant certainly came before another (its reply was
    in before the other was even asked for), its fence is smaller; per key and across all keys,
    also across server restarts. No fence is handed out twice.
(c) **FIFO**: of two waiters that both got the lock, the one whose enqueue was acknowledged
    before the other sent its request was granted first. Waiters that timed out, errored or
    were cut off never got a grant and so are not compared.

Every rule compares only events whose order is certain from the clients' side, so a slow reply,
a stalled proxy or a stopped process can hide a violation but never invent one.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Iterable, Sequence

OUTCOMES = frozenset({"released", "lost", "killed", "timeout", "error"})
"""How an attempt ended: ``released`` (the server confirmed the release), ``lost`` (granted,
but the release was refused or never confirmed), ``killed`` (the client died holding it),
``timeout`` (never granted: the wait ran out), ``error`` (never granted: the request failed)."""


@dataclasses.dataclass(frozen=True)
class Hold:
    """One acquire attempt of one client, as that client saw it."""

    key: str
    client: str
    requested_t: float
    """When the first request of the attempt (``l``, or ``e`` for two-phase) was sent."""
    lease_s: float
    outcome: str
    fence: int | None = None
    """The grant's fence (None: never granted)."""
    granted_t: float | None = None
    """When the grant reached the client (None: never granted)."""
    enqueued_t: float | None = None
    """When the server's answer to ``e`` (``queued`` or ``acquired``) reached the client."""
    released_t: float | None = None
    """When the release request was sent (None: never sent)."""
    release_ok: bool = False
    """The server answered ``ok`` to the release: the hold was valid until it got there."""
    renewed_t: tuple[float, ...] = ()
    """Send times of the renewals the server accepted."""
    holding_until: float | None = None
    """For a hold whose end was never recorded (``killed``): until when the client certainly
    had not sent a release yet. Its grant's arrival at least; the end of a long hold it had
    announced, if any. A client killed right after its release was answered, before it could
    record it, leaves a hold that looks killed but was released: nothing proves it valid past
    this moment."""
    reported_lost: bool = False
    """The client was told that it lost the lock (its lost event was set by the end)."""
    told_t: float | None = None
    """When the client was told it lost the lock (its ``on_lost`` ran), if it was."""

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {self.outcome!r} (one of {sorted(OUTCOMES)})")
        if (self.fence is None) != (self.granted_t is None):
            raise ValueError("a hold has both a fence and a grant time, or neither")

    @property
    def granted(self) -> bool:
        return self.granted_t is not None

    def valid_until(self, cut_t: float = math.inf) -> float:
        """Until when the server certainly still counted this hold as valid.

        The server granted at some moment between ``requested_t`` and ``granted_t``, so the
        lease ran at least until ``requested_t + lease_s``; an accepted renewal sent at ``s``
        proves it until ``s + lease_s``; an accepted release sent at ``r`` proves it until
        ``r``. A release or a cut connection (``cut_t``) ends it in any case; a server crash
        does not (see `Cut`).
        A hold whose end was never recorded is proven only until ``holding_until``.
        """
        proven = self.requested_t + self.lease_s
        for sent in self.renewed_t:
            proven = max(proven, sent + self.lease_s)
        if self.outcome == "killed":
            holding = self.holding_until if self.holding_until is not None else self.granted_t
            if holding is not None:
                proven = min(proven, holding)
        if self.released_t is not None:
            if self.release_ok:
                proven = max(proven, self.released_t)
            proven = min(proven, self.released_t)
        return min(proven, cut_t)


@dataclasses.dataclass(frozen=True)
class Cut:
    """The server lost a client's holds: its connections were cut (the client was killed, a
    proxy dropped or reset them) or, with ``client=None``, the server itself died.

    A server's death ends no hold by itself: the restarted server grants nothing until every
    lease it may have granted has run out (its restart grace), so a hold stays proven valid
    for its lease, as if the server were still up. A grant by the restarted server inside
    that lease is a double grant. Such cuts are kept for the report and ignored by rule (a).

    ``t`` is taken just *before* the fault is injected and ``done_t`` once it has been (the
    fault may hit any connection opened up to then), so the server noticed at ``t`` or later:
    a hold requested by ``done_t`` is not proven valid after ``t``."""

    t: float
    client: str | None = None
    done_t: float | None = None

    @property
    def end(self) -> float:
        return self.t if self.done_t is None else self.done_t


@dataclasses.dataclass(frozen=True)
class Violation:
    kind: str
    """``double_grant``, ``duplicate_fence``, ``fence_order`` or ``fifo``."""
    key: str
    first: Hold
    second: Hold
    detail: str


@dataclasses.dataclass
class CheckResult:
    holds: int
    """Granted holds checked."""
    attempts: int
    """Every attempt, granted or not."""
    double_grants: list[Violation] = dataclasses.field(default_factory=list[Violation])
    fence_violations: list[Violation] = dataclasses.field(default_factory=list[Violation])
    fifo_violations: list[Violation] = dataclasses.field(default_factory=list[Violation])
    ordered_pairs: int = 0
    """Pairs of grants whose order was certain, each checked for rule (b)."""
    fifo_pairs: int = 0
    """Pairs of waiters whose queue order was certain, each checked for rule (c)."""
    proven: int = 0
    """Holds with a non-empty proven-valid window (the ones rule (a) can compare)."""

    @property
    def violations(self) -> list[Violation]:
        return [*self.double_grants, *self.fence_violations, *self.fifo_violations]

    @property
    def ok(self) -> bool:
        return not self.violations

    def summary(self) -> str:
        lines = [
            f"{self.holds} holds ({self.proven} proven valid for a while) of {self.attempts} "
            "attempts: "
            f"{len(self.double_grants)} double grants, {len(self.fence_violations)} fence "
            f"violations ({self.ordered_pairs} ordered pairs), {len(self.fifo_violations)} FIFO "
            f"violations ({self.fifo_pairs} queue-ordered pairs)"
        ]
        lines += [f"  {v.kind} on {v.key!r}: {v.detail}" for v in self.violations[:20]]
        return "\n".join(lines)


def _cut_times(holds: Sequence[Hold], cuts: Iterable[Cut]) -> dict[int, float]:
    """For each hold (by index), the first cut at or after its grant that ends it."""
    cut_list = sorted(cuts, key=lambda c: c.t)
    ends: dict[int, float] = {}
    for index, hold in enumerate(holds):
        # A cut may end a hold whose grant had not reached the client yet: any hold asked
        # for before the fault was fully injected is a candidate.
        for cut in cut_list:
            if cut.end >= hold.requested_t and cut.client == hold.client:
                ends[index] = cut.t
                break
    return ends


def proven_windows(holds: Sequence[Hold], cuts: Iterable[Cut] = ()) -> list[tuple[float, float]]:
    """``(granted_t, valid_until)`` of each granted hold (empty when the end is not after the
    start: nothing proves the hold was still valid when its grant arrived)."""
    granted = [h for h in holds if h.granted]
    ends = _cut_times(granted, cuts)
    windows: list[tuple[float, float]] = []
    for index, hold in enumerate(granted):
        assert hold.granted_t is not None
        windows.append((hold.granted_t, hold.valid_until(ends.get(index, math.inf))))
    return windows


def check_double_grants(holds: Sequence[Hold], cuts: Iterable[Cut] = ()) -> list[Violation]:
    """Rule (a): per key, holds whose proven-valid windows overlap."""
    granted = [h for h in holds if h.granted]
    windows = proven_windows(granted, cuts)
    by_key: dict[str, list[int]] = {}
    for index, hold in enumerate(granted):
        by_key.setdefault(hold.key, []).append(index)
    found: list[Violation] = []
    for key, indexes in by_key.items():
        indexes.sort(key=lambda i: windows[i][0])
        reach = -math.inf  # furthest proven end so far, and whose it is
        reacher = -1
        for i in indexes:
            start, end = windows[i]
            if end <= start:
                continue
            if start < reach:
                first, second = granted[reacher], granted[i]
                found.append(
                    Violation(
                        "double_grant",
                        key,
                        first,
                        second,
                        f"{second.client} (fence {second.fence}) was granted at {start:.3f} "
                        f"while {first.client} (fence {first.fence}) was provably valid "
                        f"until {reach:.3f}",
                    )
                )
            if end > reach:
                reach, reacher = end, i
    return found


def _ordered_violations(
    earlier: Sequence[tuple[float, Hold]],
    later: Sequence[Hold],
    kind: str,
    scope: str,
) -> tuple[list[Violation], int]:
    """Each hold in ``later`` must have a larger fence than every hold in ``earlier`` whose
    time is before its ``requested_t``. Returns the violations and the pairs checked."""
    earlier_sorted = sorted(earlier, key=lambda pair: pair[0])
    times = [t for t, _ in earlier_sorted]
    found: list[Violation] = []
    pairs = 0
    best: Hold | None = None  # the largest fence among the earlier holds seen so far
    position = 0
    for hold in sorted(later, key=lambda h: h.requested_t):
        assert hold.fence is not None
        cutoff = bisect.bisect_left(times, hold.requested_t)
        while position < cutoff:
            candidate = earlier_sorted[position][1]
            assert candidate.fence is not None
            if best is None or best.fence is None or candidate.fence > best.fence:
                best = candidate
            position += 1
        pairs += cutoff
        if best is not None and best.fence is not None and best.fence >= hold.fence:
            found.append(
                Violation(
                    kind,
                    hold.key if scope == "key" else f"{best.key}|{hold.key}",
                    best,
                    hold,
                    f"{best.client} got fence {best.fence} before {hold.client} asked "
                    f"(at {hold.requested_t:.3f}), yet {hold.client} got fence {hold.fence} "
                    f"({scope} order)",
                )
            )
    return found, pairs


def check_fences(holds: Sequence[Hold], *, one_server: bool = True) -> tuple[list[Violation], int]:
    """Rule (b): unique fences, increasing in certain grant order per key and, with
    ``one_server``, globally.

    Several servers (a lock cluster) each count fences of their own: they promise uniqueness
    and grant order per key (a key's new server starts above the fences of its old one), not
    across keys that different servers hold. Returns the violations and the number of ordered
    pairs checked (globally with ``one_server``, else per key)."""
    granted = [h for h in holds if h.granted]
    found: list[Violation] = []
    by_fence: dict[tuple[int, str], Hold] = {}
    for hold in granted:
        assert hold.fence is not None
        scope = (hold.fence, "" if one_server else hold.key)
        other = by_fence.get(scope)
        if other is not None:
            found.append(
                Violation(
                    "duplicate_fence",
                    hold.key,
                    other,
                    hold,
                    f"fence {hold.fence} granted to {other.client} on {other.key!r} and to "
                    f"{hold.client} on {hold.key!r}",
                )
            )
        by_fence[scope] = hold
    by_key: dict[str, list[Hold]] = {}
    for hold in granted:
        by_key.setdefault(hold.key, []).append(hold)
    key_pairs = 0
    for same_key in by_key.values():
        earlier = [(h.granted_t, h) for h in same_key if h.granted_t is not None]
        key_found, pairs = _ordered_violations(earlier, same_key, "fence_order", "key")
        found.extend(key_found)
        key_pairs += pairs
    if not one_server:
        return found, key_pairs
    earlier = [(h.granted_t, h) for h in granted if h.granted_t is not None]
    global_found, pairs = _ordered_violations(earlier, granted, "fence_order", "global")
    # A pair on one key is reported once, by the per-key pass.
    found.extend(v for v in global_found if v.first.key != v.second.key)
    return found, pairs


def check_fifo(holds: Sequence[Hold]) -> tuple[list[Violation], int]:
    """Rule (c): per key, a granted waiter whose enqueue was acknowledged before another
    granted waiter sent its request has the smaller fence (fences follow grant order).

    Returns the violations and the number of queue-ordered pairs checked."""
    granted = [h for h in holds if h.granted]
    by_key: dict[str, list[Hold]] = {}
    for hold in granted:
        by_key.setdefault(hold.key, []).append(hold)
    found: list[Violation] = []
    pairs = 0
    for same_key in by_key.values():
        queued = [(h.enqueued_t, h) for h in same_key if h.enqueued_t is not None]
        key_found, key_pairs = _ordered_violations(queued, same_key, "fifo", "key")
        found.extend(key_found)
        pairs += key_pairs
    return found, pairs


def check_history(
    holds: Sequence[Hold], cuts: Iterable[Cut] = (), *, one_server: bool = True
) -> CheckResult:
    """All three rules over every attempt of a run (``one_server``: see `check_fences`)."""
    cut_list = list(cuts)
    fence_violations, ordered = check_fences(holds, one_server=one_server)
    fifo_violations, fifo_pairs = check_fifo(holds)
    windows = proven_windows(holds, cut_list)
    return CheckResult(
        proven=sum(1 for start, end in windows if end > start),
        holds=sum(1 for h in holds if h.granted),
        attempts=len(holds),
        double_grants=check_double_grants(holds, cut_list),
        fence_violations=fence_violations,
        fifo_violations=fifo_violations,
        ordered_pairs=ordered,
        fifo_pairs=fifo_pairs,
    )
