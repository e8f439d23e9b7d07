"""Which keys a ``Server`` serves, and what its cluster node asks of it.

A ``net.Server`` has a ``KeyServing``: the current ``Ownership`` and its swap (``set_ownership``,
from any thread: a cluster node hands over each snapshot from its own), the checks the dispatch
asks (``key_check``, ``asked_check``, ``may_hold``, ``hold_check``, the ``shards`` reply), and
the rest of a cluster node's ``cluster.host.NodeHost`` (``fail_waiters``, ``holders_in``,
``key_present``, ``renewals_allowed``). ``make_ownership`` and ``make_cluster_node`` build a
server's ownership from its config."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, TypeVar

from dflockd_server import protocol as p
from dflockd_server.cluster.shardmap import SHARD_COUNT, shard_id
from dflockd_server.config import Config, ConfigError
from dflockd_server.connection import Connection
from dflockd_server.loops import run_on
from dflockd_server.ownership import SINGLE, Ownership, SingleOwnership, StaticOwnership
from dflockd_server.table import LockTable

if TYPE_CHECKING:
    from dflockd_server.cluster.host import NodeHost
    from dflockd_server.cluster.node import ClusterNode

__all__ = ["KeyServing", "make_cluster_node", "make_ownership"]

T = TypeVar("T")


def make_ownership(config: Config) -> Ownership:
    """The ownership of a server that is not a cluster member (single, or ``--members``)."""
    if config.members is not None:
        assert config.advertise is not None  # Config checks it
        return StaticOwnership(config.members, config.advertise)
    return SINGLE


def make_cluster_node(config: Config, server: NodeHost) -> ClusterNode:
    """The cluster member of a ``--cluster`` server (not started). The cluster's modules are
    imported here: a server that is no cluster member does not pay for them at start."""
    from dflockd_server.cluster.node import ClusterNode
    from dflockd_server.cluster.ops import EtcdAccess, etcd_client

    assert config.cluster is not None and config.advertise is not None  # Config checks it
    access = EtcdAccess(
        config.cluster_ca_file,
        config.cluster_cert,
        config.cluster_key,
        config.cluster_user,
        config.resolve_cluster_password(),
    )
    try:
        client, prefix = etcd_client(config.cluster, access, lease_ttl_s=config.cluster_lease_ttl_s)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return ClusterNode(
        client,
        prefix,
        config.advertise,
        server,
        max_lease_ttl_s=config.max_lease_ttl_s,
        lease_ttl_s=config.cluster_lease_ttl_s,
    )


class KeyServing:
    """Which keys the server serves, and the cluster node's calls (see the module's doc)."""

    def __init__(self, connections: set[Connection]) -> None:
        self.connections = connections
        self.ownership: Ownership = SINGLE  # swapped whole, never changed in place
        self.key_check: Callable[[str], bytes | None] | None = None
        """``ownership.check``, or None when every key is served (the acquire's fast path)."""
        self.asked_check: Callable[[str], bytes | None] = SINGLE.check_asked
        self.admit_ask: Callable[[str, str], bytes | None] = SINGLE.admit_ask
        self._may_hold: Callable[[str], bool] | None = None  # `ownership.may_hold` (None: always)
        self.hold_check: Callable[[str], bool] | None = None
        """``may_hold`` where the ownership may refuse a key it granted (a cluster member's),
        else None (single, static ``--members``): a keep-alive then asks nothing key by key."""
        self._renewals_allowed = True
        self.table: LockTable | None = None  # once the start has made it (`attach`)
        self._swap = threading.Lock()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_thread = 0

    def set_ownership(self, ownership: Ownership) -> None:
        """Serve by ``ownership`` from now on (any thread: the references are swapped; a
        request the swap overtakes is answered as if it had come just before)."""
        single = isinstance(ownership, SingleOwnership)
        with self._swap:
            self.ownership = ownership
            self.key_check = None if single else ownership.check
            self._may_hold = None if single else ownership.may_hold
            holds_all = single or isinstance(ownership, StaticOwnership)
            self.hold_check = None if holds_all else self.may_hold
            self.asked_check = ownership.check_asked
            self.admit_ask = ownership.admit_ask
            self._grant_checks()

    def attach(self, table: LockTable) -> None:
        """The server's lock table, which asks the current ownership before promoting a waiter."""
        with self._swap:
            self.table = table
            self._grant_checks()

    def _grant_checks(self) -> None:
        # Under ``_swap``: the table keeps the later of two racing swaps' checks.
        if self.table is not None:
            grants = self.table.grants
            grants.grant_check = self.key_check
            grants.asked_check = None if self.key_check is None else self.ownership.check_asked

    def may_hold(self, key: str) -> bool:
        """Whether a grant on ``key`` may be renewed, taken over or handed down now:
        ``renewals_allowed`` and the ownership's ``may_hold`` (asked each time: a cluster
        member's turns False by itself)."""
        may_hold = self._may_hold
        return self._renewals_allowed and (may_hold is None or may_hold(key))

    def shards_reply(self) -> bytes:
        return p.reply_json(self.ownership.describe())

    def renewals_allowed(self, allowed: bool) -> None:
        """Serve ``n``/``sn`` (True), or answer ``error`` (False: a fenced member). Thread safe."""
        self._renewals_allowed = allowed

    def fail_waiters(self, shard_ids: Collection[int], reply: bytes) -> int:
        """Answer every queued acquire on a key of ``shard_ids`` with ``reply`` and drop the
        pending two-phase enqueues there; how many. Thread safe (runs on the loop)."""
        wanted = frozenset(shard_ids)
        return self._on_loop(lambda: self._fail_waiters(wanted, reply))

    def _fail_waiters(self, wanted: frozenset[int], reply: bytes) -> int:
        failed = 0
        for conn in list(self.connections):
            if (waiter := conn.waiter) is not None and shard_id(waiter.state.key) in wanted:
                conn.answer_wait(reply)
                failed += 1
            if (session := conn.session) is not None:
                for key in list(session.client.enqueued):
                    if shard_id(key) in wanted and session.fail_enqueued(key, reply):
                        failed += 1
        return failed

    def holders_in(self, shard_ids: Collection[int]) -> set[int]:
        """Which of ``shard_ids`` have a key held now. Thread safe (runs on the loop)."""
        wanted = frozenset(shard_ids)
        return self._on_loop(lambda: self.held_shards() & wanted)

    def held_shards(self) -> set[int]:
        """The shards with a key held or queued now (on the loop). Before the table is made and
        during a restart grace, every shard counts as held: nothing is handed over blind."""
        if (table := self.table) is None or table.grace_remaining() > 0:
            return set(range(SHARD_COUNT))
        return {shard_id(key) for key in table.busy_keys()}

    def key_present(self, key: str) -> bool | None:
        """Whether the table holds or queues anything on ``key`` (on the loop); None when it
        cannot tell (no table yet, or a restart grace)."""
        table = self.table
        return None if table is None or table.grace_remaining() > 0 else table.is_busy(key)

    def _on_loop(self, fn: Callable[[], T]) -> T:
        """``fn()`` on the loop thread, waiting for its result."""
        if (loop := self.loop) is None or threading.get_ident() == self.loop_thread:
            return fn()
        return run_on(loop, fn)
