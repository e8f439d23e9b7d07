"""The simulated etcd: one linearizable key-value store with revisions, leases and watches.

``SimEtcd`` is etcd as the cluster's members see it through ``EtcdClient``: every key has its
``create_revision``, ``mod_revision``, ``version`` and lease; a write (a put, a delete, a
transaction that writes) moves the store's revision on by one; a transaction compares
``CREATE``/``MOD``/``VERSION``/``VALUE``/``LEASE`` as etcd does (a ``VALUE`` comparison on a
missing key fails; the others compare it as zeros); a lease ends its TTL after its last
keep-alive *received*, deleting its keys; a watch of a prefix gets each change, in order, after
a network delay, in its member's process.

What the nemesis does to it: an **outage** (every call fails; etcd has no leader: no lease
expires meanwhile, and its new leader gives every lease a whole TTL again, as etcd's lessor
``Promote`` does); a **stall** (every call fails for a while, watches bring nothing, but its
leader still expires leases on time); a **partition** between one member and etcd (that
member's calls fail, its watch events wait until it heals). Now and then a call that writes is
applied but its answer is lost (the member sees an error for what etcd did).

``SimEtcdClient`` is the product's ``EtcdClient`` with its I/O replaced: its helpers
(``get``, ``get_prefix``, ``create_if_absent``, ``compare_and_set``) are the product's own,
built on the calls it overrides here.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from dflockd_server.cluster.etcd import (
    Compare,
    EtcdClient,
    EtcdError,
    Get,
    KeyValue,
    Lease,
    Op,
    Put,
    RangeResult,
    RangeStat,
    TxnResult,
    Watch,
    WatchEvent,
    prefix_end,
)
from tests.sim.loop import Loop, Timer
from tests.sim.process import Process

__all__ = ["SimEtcd", "SimEtcdClient", "SimWatch"]

ANSWER_LOST = 0.01
"""The chance that a call that writes is applied but its answer lost."""


@dataclass
class _Lease:
    id: int
    ttl: int
    expires: float
    keys: set[str] = field(default_factory=set[str])
    timer: Timer | None = None


class SimEtcd:
    """The store (see the module's doc)."""

    def __init__(self, loop: Loop) -> None:
        self.loop = loop
        self.revision = 1
        self.kvs: dict[str, KeyValue] = {}
        self.leases: dict[int, _Lease] = {}
        self.watches: list[SimWatch] = []
        self.down_until = 0.0
        """An outage until then (no leader: no lease expires)."""
        self.stalled_until = 0.0
        """A stall until then (calls fail, watches wait; leases expire)."""
        self.cut: set[str] = set()
        """Members cut off from etcd."""
        self._next_lease = 0x1000
        self._batch: list[WatchEvent] = []
        """The events of the write under way (a watch gets them at once, as one message)."""

    # ------------------------------------------------------------------ faults
    def reachable(self, member: str) -> bool:
        now = self.loop.now
        return now >= self.down_until and now >= self.stalled_until and member not in self.cut

    def outage(self, seconds: float) -> None:
        self.loop.note(f"etcd: outage for {seconds:.2f} s")
        self.down_until = max(self.down_until, self.loop.now + seconds)
        self.loop.at(self.down_until, self._back)

    def stall(self, seconds: float) -> None:
        self.loop.note(f"etcd: stalled for {seconds:.2f} s")
        self.stalled_until = max(self.stalled_until, self.loop.now + seconds)
        self.loop.at(self.stalled_until, self._flush_watches)

    def partition(self, member: str, seconds: float) -> None:
        if member in self.cut:
            return
        self.loop.note(f"etcd: {member} cut off for {seconds:.2f} s")
        self.cut.add(member)

        def heal() -> None:
            self.cut.discard(member)
            self.loop.note(f"etcd: {member} reaches etcd again")
            self._flush_watches()

        self.loop.later(seconds, heal)

    def _back(self) -> None:
        if self.loop.now < self.down_until:
            return
        self.loop.note("etcd: back (a new leader: every lease gets its whole TTL again)")
        for lease in list(self.leases.values()):
            self._renew(lease)
        self._flush_watches()

    # ------------------------------------------------------------------ leases
    def _renew(self, lease: _Lease) -> None:
        lease.expires = self.loop.now + lease.ttl
        if lease.timer is not None:
            lease.timer.cancel()
        lease.timer = self.loop.at(lease.expires, lambda: self._expire(lease))

    def _expire(self, lease: _Lease) -> None:
        if self.loop.now < self.down_until:
            return  # no leader: the new one renews it (``_back``)
        if self.leases.get(lease.id) is lease and self.loop.now >= lease.expires:
            self.loop.note(f"etcd: lease {lease.id:x} expired")
            self.loop.count("etcd lease expired")
            self.revoke(lease.id)

    def grant(self, ttl: int) -> Lease:
        self._next_lease += 1
        lease = _Lease(self._next_lease, ttl, 0.0)
        self.leases[lease.id] = lease
        self._renew(lease)
        return Lease(lease.id, ttl)

    def keepalive(self, lease_id: int) -> int:
        lease = self.leases.get(lease_id)
        if lease is None:
            return 0
        self._renew(lease)
        return lease.ttl

    def revoke(self, lease_id: int) -> None:
        lease = self.leases.pop(lease_id, None)
        if lease is None:
            return
        if lease.timer is not None:
            lease.timer.cancel()
        if lease.keys:
            self.revision += 1
            for key in sorted(lease.keys):
                self._delete_one(key)
            self._notify()

    # ------------------------------------------------------------------ keys
    def range(self, key: str, prefix: bool) -> list[KeyValue]:
        if not prefix:
            kv = self.kvs.get(key)
            return [] if kv is None else [kv]
        end = prefix_end(key)
        return [self.kvs[k] for k in sorted(self.kvs) if key <= k and (not end or k < end)]

    def _compare(self, c: Compare) -> bool:
        kv = self.kvs.get(c.key)
        if kv is None and c.target == "VALUE":
            return False
        have: int | str
        if c.target == "VALUE":
            assert kv is not None
            have = kv.value
        elif kv is None:
            have = 0
        else:
            have = {
                "CREATE": kv.create_revision,
                "MOD": kv.mod_revision,
                "VERSION": kv.version,
                "LEASE": kv.lease,
            }[c.target]
        want = c.value
        if isinstance(have, str) != isinstance(want, str):
            return False
        if c.result == "EQUAL":
            return have == want
        if c.result == "NOT_EQUAL":
            return have != want
        if c.result == "GREATER":
            return have > want  # pyright: ignore[reportOperatorIssue]
        return have < want  # pyright: ignore[reportOperatorIssue]

    def txn(
        self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op]
    ) -> TxnResult:
        ok = all(self._compare(c) for c in compare)
        ops = success if ok else failure
        writes = any(not isinstance(op, Get) for op in ops)
        for op in ops:
            if isinstance(op, Put) and op.lease and op.lease not in self.leases:
                raise EtcdError("etcdserver: requested lease not found")
        if writes:
            self.revision += 1
        ranges: list[list[KeyValue]] = []
        for op in ops:
            if isinstance(op, Get):
                ranges.append(self.range(op.key, op.prefix))
            elif isinstance(op, Put):
                self._put(op)
            else:
                for kv in self.range(op.key, op.prefix):
                    self._delete_one(kv.key)
        self._notify()
        return TxnResult(ok, self.revision, ranges)

    def _put(self, op: Put) -> None:
        old = self.kvs.get(op.key)
        if old is not None and old.lease and old.lease != op.lease:
            lease = self.leases.get(old.lease)
            if lease is not None:
                lease.keys.discard(op.key)
        kv = KeyValue(
            op.key,
            op.value,
            self.revision if old is None else old.create_revision,
            self.revision,
            1 if old is None else old.version + 1,
            op.lease,
        )
        self.kvs[op.key] = kv
        if op.lease:
            self.leases[op.lease].keys.add(op.key)
        self._batch.append(WatchEvent("put", kv))

    def _delete_one(self, key: str) -> None:
        old = self.kvs.pop(key, None)
        if old is None:
            return
        if old.lease:
            lease = self.leases.get(old.lease)
            if lease is not None:
                lease.keys.discard(key)
        gone = replace(old, value="", mod_revision=self.revision, version=0, lease=0)
        self._batch.append(WatchEvent("delete", gone))

    # ------------------------------------------------------------------ watches
    def _notify(self) -> None:
        batch, self._batch = self._batch, []
        if batch:
            for watch in list(self.watches):
                watch.offer(batch)

    def _flush_watches(self) -> None:
        for watch in list(self.watches):
            watch.flush()


class SimWatch(Watch):
    """A watch of a prefix, its events delivered in order in its member's process (the
    product's ``Watch`` reads an HTTP stream from a thread: none here)."""

    def __init__(
        self,
        etcd: SimEtcd,
        proc: Process,
        member: str,
        key: str,
        on_event: Callable[[WatchEvent], None] | None,
    ) -> None:  # (no thread, no transport: the base's ``__init__`` is not for it)
        self.endpoint = 0
        self.last_revision = 0
        self.error = None
        self._etcd = etcd
        self._proc = proc
        self._life = proc.life
        self._member = member
        self._prefix_key = key
        self._end = prefix_end(key)
        self._deliver = on_event
        self._held: list[list[WatchEvent]] = []
        self._at = 0.0
        self._running = True
        self.on_news: Callable[[], None] = lambda: None
        """Told after each message it delivered (what wakes the node's thread)."""

    @property
    def running(self) -> bool:
        return self._running and self._proc.alive and self._proc.life == self._life

    def stop(self, timeout: float = 5.0) -> None:
        self._running = False
        if self in self._etcd.watches:
            self._etcd.watches.remove(self)

    def offer(self, events: list[WatchEvent]) -> None:
        """The events of one write (one message of etcd's stream)."""
        start, end = self._prefix_key, self._end
        mine = [e for e in events if start <= e.kv.key and (not end or e.kv.key < end)]
        if not mine:
            return
        if not self.running:
            self.stop()
            return
        self._held.append(mine)
        self.flush()

    def flush(self) -> None:
        if not self._etcd.reachable(self._member):
            return
        held, self._held = self._held, []
        loop = self._etcd.loop
        for events in held:
            self._at = max(self._at, loop.now + loop.rng.uniform(0.0005, 0.01))
            loop.at(self._at, lambda e=events: self._proc.run(lambda: self._arrive(e)))

    def _arrive(self, events: list[WatchEvent]) -> None:
        deliver = self._deliver
        for event in events:
            if not self.running or deliver is None:
                return
            self.last_revision = event.kv.mod_revision
            deliver(event)
        self.on_news()


class SimEtcdClient(EtcdClient):
    """One member's ``EtcdClient``, its calls made on ``SimEtcd`` (see the module's doc)."""

    __slots__ = ("etcd", "member", "on_news", "proc")

    def __init__(self, etcd: SimEtcd, member: str, proc: Process) -> None:  # (no transport)
        self.etcd = etcd
        self.member = member
        self.proc = proc
        self.on_news: Callable[[], None] = lambda: None
        """Told after each message one of its watches delivered."""

    def __repr__(self) -> str:
        return f"SimEtcdClient({self.member!r})"

    @property
    def switches(self) -> int:
        return 0

    @property
    def preferred(self) -> int:
        return 0

    def _reach(self, what: str) -> SimEtcd:
        etcd = self.etcd
        if not etcd.reachable(self.member):
            raise EtcdError(f"etcd (simulated): {what} timed out")
        return etcd

    def _news(self) -> None:
        self.on_news()

    def _answered(self, what: str) -> None:
        """After a write was applied: now and then its answer is lost."""
        if self.etcd.loop.chance(ANSWER_LOST):
            self.etcd.loop.count("etcd answer lost")
            raise EtcdError(f"etcd (simulated): the answer to {what} was lost")

    def range(self, key: str, *, prefix: bool = False) -> RangeResult:
        etcd = self._reach("range")
        return RangeResult(etcd.range(key, prefix), etcd.revision)

    def stat(self, key: str, *, prefix: bool = False, since: int = 0) -> RangeStat:
        etcd = self._reach("count")
        kvs = etcd.range(key, prefix)
        return RangeStat(len(kvs), any(kv.mod_revision > since for kv in kvs), etcd.revision)

    def txn(
        self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        result = self._reach("transaction").txn(compare, success, failure)
        self._answered("transaction")
        return result

    def lease_grant(self, ttl: int) -> Lease:
        lease = self._reach("lease grant").grant(ttl)
        self._answered("lease grant")
        return lease

    def lease_keepalive_once(self, lease_id: int) -> int:
        ttl = self._reach("keep-alive").keepalive(lease_id)
        self._answered("keep-alive")
        return ttl

    def lease_revoke(self, lease_id: int) -> None:
        self._reach("revoke").revoke(lease_id)

    def watch(
        self,
        key: str,
        *,
        prefix: bool = False,
        start_revision: int = 0,
        on_event: Callable[[WatchEvent], None] | None = None,
        timeout: float | None = None,
    ) -> Watch:
        # (from ``start_revision``: a member watches from the revision after the one it read in
        # the same step, so nothing happened in between)
        etcd = self._reach("watch")
        watch = SimWatch(etcd, self.proc, self.member, key, on_event)
        watch.on_news = self._news
        etcd.watches.append(watch)
        return watch
