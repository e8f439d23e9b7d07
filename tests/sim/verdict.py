"""The verdict of one simulated run (``Verdict``), a single server's or a cluster's: the
invariants checked as the run goes and the history checker's at its end.

- At each grant: the key's fence is above every fence of the key before (whichever server
  granted it), and no client still believes it holds the key.
- Every tenth of a second (the run's ``audit``): no client believes in a grant its server no
  longer holds; the run says which server a client holds from and whether it holds the grant.
  A grant being confirmed (its session ended while it waited) is not believed yet: its
  acquire has not returned.
- At the end: the holds and the cuts (``tests.faults.history``) judged by ``check_history``,
  a client still holding counted as killed then.
"""

from __future__ import annotations

from collections.abc import Iterator

from celery_dflock.client._grant import LockState
from dflockd_server.fence import fence_of
from tests.faults.history import Cut, Hold, check_history
from tests.sim.client import SimClient
from tests.sim.loop import Loop
from tests.sim.result import Result

__all__ = ["Verdict"]


class Verdict:
    """What one run found, and the checks that find it. ``clients``: the run's clients (the
    list the run fills)."""

    def __init__(self, loop: Loop, clients: list[SimClient]) -> None:
        self.loop = loop
        self.clients = clients
        self.violations: list[str] = []
        self.holds: list[Hold] = []
        """Every attempt's hold, as its client ended it (the clients append)."""
        self.cuts: list[Cut] = []
        """The run's cuts: a server's (None) or a client's connections cut."""
        self.grants = 0
        self.last_fence: dict[str, int] = {}
        self.told: set[tuple[str, str]] = set()
        """(client, token) of the beliefs `lost_belief` reported (once each)."""

    def violation(self, text: str) -> None:
        self.loop.note(f"VIOLATION {text}")
        self.violations.append(f"at {self.loop.now:.3f}: {text}")

    def granted(self, key: str, token: str, by: str | None = None) -> None:
        """A grant of ``key`` leaves a server (``by``: the cluster member's name): its fence is
        above every fence of the key before, and no client still believes it holds the key."""
        self.grants += 1
        fence = fence_of(token)
        last = self.last_fence.get(key)
        member = "" if by is None else f" by {by}"
        if last is not None and fence <= last:
            self.violation(
                f"fence of {key!r} went from {last} to {fence}"
                + ("" if by is None else f" (granted{member})")
            )
        self.last_fence[key] = max(fence, last or 0)
        for client in self.clients:
            core = client.core
            if (
                client.proc.alive
                and core is not None
                and core.key == key
                and core.state is LockState.HELD
                and core.grant.token != token
                and core.owned()
                and not (
                    client.attempt is not None
                    and (client.attempt.released_t is not None or client.attempt.confirming)
                )
            ):
                source = "" if by is None else f" from {core.endpoint.address}"
                self.violation(
                    f"{key!r} granted{member} (fence {fence}) while {client.name} still "
                    f"believes it holds it{source} (fence {fence_of(core.grant.token or '0')}, "
                    f"{core.grant.hold_deadline() - client.clock():.2f} s left to it)"
                )

    def believers(self) -> Iterator[SimClient]:
        """The live clients that believe they hold a grant (not released, not reported)."""
        for client in self.clients:
            core = client.core
            attempt = client.attempt
            if (
                client.proc.alive
                and core is not None
                and core.state is LockState.HELD
                and core.grant.token is not None
                and attempt is not None
                and attempt.released_t is None
                and not attempt.confirming
                and (client.name, core.grant.token) not in self.told
                and core.owned()
            ):
                yield client

    def lost_belief(self, client: SimClient, server: str) -> None:
        """``client`` believes in a grant that ``server`` no longer holds (reported once)."""
        core = client.core
        assert core is not None and core.grant.token is not None
        self.told.add((client.name, core.grant.token))
        self.violation(
            f"{client.name} believes it holds {core.key!r} (fence {fence_of(core.grant.token)}, "
            f"{core.grant.hold_deadline() - client.clock():.2f} s left to it) but {server} no "
            "longer holds that grant"
        )

    def result(self, mutation: str | None, *, cluster: bool) -> Result:
        """The run is over: the clients still holding count as killed now, the history
        checker judges the whole (a cluster's fences are ordered per key only: two members'
        counters order no two keys), and the run's ``Result``."""
        loop = self.loop
        for client in self.clients:
            attempt = client.attempt
            if attempt is not None and client.proc.alive and attempt.granted_t is not None:
                self.holds.append(attempt.hold(client.name, "killed", holding_until=loop.now))
        checked = check_history(self.holds, self.cuts, one_server=not cluster)
        for v in checked.violations:
            self.violation(f"history: {v.kind} on {v.key!r}: {v.detail}")
        return Result(
            seed=loop.seed,
            mutation=mutation,
            violations=self.violations,
            digest=loop.digest(),
            trace=list(loop.lines),
            grants=self.grants,
            holds=len(self.holds),
            events=loop.events,
            checked=checked.summary().split("\n")[0],
            seen=dict(loop.seen),
            cluster=cluster,
        )
