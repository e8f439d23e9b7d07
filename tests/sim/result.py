"""What one simulated run found (``Result``): its violations, its trace, its replay command."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Result"]


@dataclass
class Result:
    seed: int
    mutation: str | None
    violations: list[str] = field(default_factory=list[str])
    digest: str = ""
    trace: list[str] = field(default_factory=list[str])
    grants: int = 0
    holds: int = 0
    events: int = 0
    seen: dict[str, int] = field(default_factory=dict[str, int])
    """How often each kind of fault and recovery happened (``Loop.count``)."""
    checked: str = ""
    """The history checker's summary (its counts, first line)."""
    cluster: bool = False
    """A run of a cluster (``cluster.ClusterRun``), not of one server."""

    @property
    def ok(self) -> bool:
        return not self.violations

    def report(self) -> str:
        # (a cluster's mutation runs a cluster by itself)
        switch = f" --mutation {self.mutation}" if self.mutation else ""
        if self.cluster and not self.mutation:
            switch = " --cluster"
        lines = [
            f"seed {self.seed}: {len(self.violations)} violation(s) "
            f"({self.grants} grants, {self.holds} attempts, {self.events} events)",
            f"  history checker: {self.checked}",
            *(f"  {v}" for v in self.violations[:10]),
            "last events of the trace:",
            *(f"  {line}" for line in self.trace[-40:]),
            f"replay: uv run --no-sync python -m tests.sim --seed {self.seed}{switch} --trace",
        ]
        return "\n".join(lines)
