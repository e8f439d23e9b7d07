"""The demo's record of what happened, and its text timeline and verdict.

Worker processes append one JSON line per event to a shared file (one ``O_APPEND`` write per
line, so lines never interleave), and the demo reads them back here.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from itertools import pairwise
from pathlib import Path

#: Event kinds a worker or beat writes to the demo's event file.
EVENT_KINDS = frozenset({"start", "end", "retry", "skip", "beat"})


@dataclass(frozen=True, slots=True)
class Event:
    """One line of the event file."""

    kind: str
    key: str
    t: float
    task_id: str = ""
    fence: int = 0
    worker: str = ""


@dataclass(frozen=True, slots=True)
class Run:
    """One task run that held its key's lock from ``start`` to ``end``."""

    key: str
    task_id: str
    fence: int
    start: float
    end: float
    worker: str


class Verdict:
    """What the demo concludes from its event file."""

    def __init__(self) -> None:
        self.runs: list[Run] = []
        self.overlaps: list[tuple[Run, Run]] = []
        self.fence_order_errors: list[tuple[Run, Run]] = []
        self.unfinished: list[str] = []
        self.retries = 0
        self.skips = 0
        self.beat_sends: dict[str, int] = {}

    def passed(self) -> bool:
        """No overlap, fences in grant order, every run finished, exactly one active beat."""
        return (
            bool(self.runs)
            and not self.overlaps
            and not self.fence_order_errors
            and not self.unfinished
            and len(self.beat_sends) == 1
        )


def record(path: Path, event: Event) -> None:
    """Append ``event`` to the event file at ``path`` atomically (one write, O_APPEND)."""
    line = json.dumps(asdict(event), separators=(",", ":"))
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode("utf-8"))
    finally:
        os.close(fd)


def read_events(path: Path) -> list[Event]:
    """Read every complete line of the event file (a missing file has no events)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    events: list[Event] = []
    for line in filter(str.strip, text.splitlines()):  # the blank ones skipped
        event = Event(**json.loads(line))  # as `record` wrote it
        if event.kind not in EVENT_KINDS:
            raise ValueError(f"unknown event kind {event.kind!r} in {path}")
        events.append(event)
    return events


def judge(events: Iterable[Event]) -> Verdict:
    """Pair starts with ends, then check every key for overlapping runs and fence order."""
    verdict = Verdict()
    starts: dict[tuple[str, str, int], Event] = {}
    for ev in sorted(events, key=lambda e: e.t):
        if ev.kind == "start":
            starts[(ev.key, ev.task_id, ev.fence)] = ev
        elif ev.kind == "end":
            if (begun := starts.pop((ev.key, ev.task_id, ev.fence), None)) is not None:
                verdict.runs.append(
                    Run(ev.key, ev.task_id, ev.fence, begun.t, ev.t, begun.worker or ev.worker)
                )
        elif ev.kind == "retry":
            verdict.retries += 1
        elif ev.kind == "skip":
            verdict.skips += 1
        else:
            verdict.beat_sends[ev.worker] = verdict.beat_sends.get(ev.worker, 0) + 1
    verdict.unfinished = sorted(f"{k}/{tid}" for (k, tid, _f) in starts)
    by_key: dict[str, list[Run]] = {}
    for run in verdict.runs:
        by_key.setdefault(run.key, []).append(run)
    for runs in by_key.values():
        for before, after in pairwise(sorted(runs, key=lambda r: r.start)):
            if after.start < before.end:
                verdict.overlaps.append((before, after))
            if after.fence <= before.fence:
                verdict.fence_order_errors.append((before, after))
    return verdict


def render(verdict: Verdict, width: int = 60) -> str:
    """A per-key text Gantt chart of the runs, then the verdict in words."""
    lines: list[str] = []
    runs = verdict.runs
    if runs:
        t0 = min(r.start for r in runs)
        span = max(max(r.end for r in runs) - t0, 1e-6)
        scale = (width - 1) / span
        label_w = max(len(r.key) for r in runs)
        lines.append(f"{'key':<{label_w}}  |{'time ->':<{width}}| run (worker, fence)")
        for run in sorted(runs, key=lambda r: (r.key, r.start)):
            a = round((run.start - t0) * scale)
            b = max(a + 1, round((run.end - t0) * scale))
            bar = " " * a + "#" * (b - a) + " " * (width - b)
            lines.append(
                f"{run.key:<{label_w}}  |{bar[:width]}| {run.end - run.start:4.1f}s "
                f"({run.worker}, fence ...{run.fence % 100000:05d})"
            )
        lines.append(f"{'':<{label_w}}   0s{'':<{width - 8}}{span:5.1f}s")
    lines += [
        "",
        f"runs: {len(runs)} on {len({r.key for r in runs})} keys; "
        f"retried on contention: {verdict.retries}; skipped on contention: {verdict.skips}",
    ]
    if verdict.beat_sends:
        senders = ", ".join(f"{name} sent {n}" for name, n in sorted(verdict.beat_sends.items()))
        lines.append(f"beat: {senders}")
    lines += [f"OVERLAP on {a.key}: {a.task_id} and {b.task_id}" for a, b in verdict.overlaps]
    for a, b in verdict.fence_order_errors:
        lines.append(f"FENCE ORDER broken on {a.key}: {a.fence} then {b.fence}")
    if verdict.unfinished:
        lines.append(f"UNFINISHED runs: {', '.join(verdict.unfinished)}")
    if len(verdict.beat_sends) > 1:
        lines.append("MORE THAN ONE BEAT was active")
    if not verdict.beat_sends:
        lines.append("NO BEAT sent the periodic task")
    if verdict.passed():
        lines.append(
            "verdict: PASS - no two runs of a key overlapped, fences rose in grant order, "
            "exactly one beat was active"
        )
    else:
        lines.append("verdict: FAIL")
    return "\n".join(lines)
