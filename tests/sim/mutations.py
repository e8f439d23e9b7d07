"""Historical defects, each put back behind a test-only switch of the simulator.

Each switch is the simulator's own: a subclass of a product class that the simulated server
uses instead (``server.Mutations``), or a setting of the simulator's own parts. The product code
has no switch: a run without a mutation runs the product's classes as they are. Each is found
by the simulator within a few seeds (tests/sim/test_mutations.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dflockd_server.keys import Client, Holder
from dflockd_server.shares import AddressShares
from dflockd_server.table import LockTable

if TYPE_CHECKING:
    from tests.sim.server import Mutations, ServerConfig

__all__ = ["MUTATIONS", "Mutation"]


@dataclass(frozen=True)
class Mutation:
    name: str
    defect: str
    """The defect it puts back, in a line."""
    switch: Callable[[Mutations], None]
    """Turns the defect on (the server's parts the simulator uses)."""
    scenario: Callable[[ServerConfig], None] | None = None
    """The server's settings the defect shows under (kept in a control run, without it)."""
    faults: tuple[str, ...] | None = None
    """The faults of its runs (None: every fault): a defect some fault hides is shown with
    the others only."""


class _CloseFreesSessionAtOnce(LockTable):
    """A close by the peer frees a session connection's grants at once (its client, which
    counts on its session's time, still believes it holds them)."""

    def disconnect(self, client: Client, *, by_peer: bool = True) -> None:
        kept = client.kept_by
        if by_peer and kept is not None:
            kept.clients.remove(client)
            client.kept_by = None
        client.session = False
        super().disconnect(client, by_peer=by_peer)


class _DetachedNotCapped(AddressShares):
    """A detached hold does not count against its address's ``--max-locks-per-ip``."""

    def granted(self, holder: Holder, taker: Client) -> None:
        if holder.client is taker:
            super().granted(holder, taker)


def _close_frees_session(m: Mutations) -> None:
    m.table = _CloseFreesSessionAtOnce


def _read_timeout_frees(m: Mutations) -> None:
    m.read_timeout_by_peer = True


def _without_sessions(config: ServerConfig) -> None:
    # Only a connection no client session keeps is closed for being idle: a server without
    # sessions (``--session-ttl 0``), whose clients pause (a reset or a partition there frees
    # a connection's grants at once by design: see docs/protocol.md).
    config.session_ttl = 0
    config.read_timeout = 8.0


def _detached_not_capped(m: Mutations) -> None:
    m.shares = _DetachedNotCapped


def _capped(config: ServerConfig) -> None:
    config.locks_per_ip = 2


def _fence_reseeded(m: Mutations) -> None:
    m.fence_from_wall_clock = True


MUTATIONS: dict[str, Mutation] = {
    m.name: m
    for m in (
        Mutation(
            "close-frees-session",
            "a close by the peer frees a session's grants at once while its client believes",
            _close_frees_session,
        ),
        Mutation(
            "read-timeout-frees",
            "the server's read timeout frees the grants of the connection it closes",
            _read_timeout_frees,
            _without_sessions,
            ("pause", "quiet"),
        ),
        Mutation(
            "detached-not-capped",
            "detached grants are not counted by --max-locks-per-ip",
            _detached_not_capped,
            _capped,
        ),
        Mutation(
            "fence-from-wall-clock",
            "a restarted server's fence counter is seeded from the wall clock alone (its "
            "stored ceiling ignored), after a reboot that stepped the clock back",
            _fence_reseeded,
        ),
    )
}
