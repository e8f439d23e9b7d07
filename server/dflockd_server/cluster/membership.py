"""Cluster membership on etcd: registration under a lease, leader election, the shared map.

A ``Member`` (one per server process), under ``<prefix>``:

- registers ``<prefix>/members/<advertise>`` under an etcd lease a thread keeps alive (a dead
  process's key goes with its lease) and, in the same transaction, puts
  ``<prefix>/registered/<advertise>`` with no lease: its ``mod_revision`` tells an heir whether
  the member registered again after the heir saw it gone (``cluster.handover``: a life the
  heir's view missed);
- takes part in the election: the leader holds ``<prefix>/leader``, created only if absent and
  under its lease (it goes with its holder; the others then try again);
- as the leader, writes the map (``<prefix>/shard/<id>``, the seed's value format), each write
  conditioned on ``<prefix>/leader`` still held under its lease (a deposed leader writes
  nothing) and on the shard as read (``mapwrite``: a concurrent write is never clobbered). With
  no map yet it waits until membership has been still for ``settle_s`` and writes
  ``ShardMap.initial``; then each membership change applies ``ShardMap.updated``, and once
  membership has been still for ``auto_rebalance_s`` with no shard moving,
  ``ShardMap.rebalance_plan`` (docs/deployment.md, *A cluster*);
- watches the whole prefix into a local copy of members, leader and map (``snapshot``), and
  checks that watch every ``lease_ttl`` with one small read (``EtcdClient.stat``: the prefix's
  key count, whether a key was put after the watch's last revision). A watch that owes changes
  at two checks in a row, bringing nothing between, is stalled (open and silent: a connection
  cut off without FIN or RST, a proxy that stopped forwarding, an etcd member cut off from its
  cluster): the member reads the prefix again and watches anew, as when a watch ends.

The lease's life is measured from when the last successful keep-alive was *sent* (etcd renews
it on receipt, so it lives at least that long): ``lease_valid_until`` and ``on_lease`` tell the
cluster node until when this member may act as one. Threads: the keep-alive, the member's loop
(election, map upkeep) and the watch.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from dflockd_server.cluster.etcd import (
    Compare,
    DuplicateMember,
    EtcdClient,
    EtcdError,
    Put,
    RangeResult,
    Watch,
    WatchEvent,
)
from dflockd_server.cluster.mapwrite import ShardWrite, write_shards
from dflockd_server.cluster.shardmap import SHARD_COUNT, ShardAssignment, ShardMap

REGISTER_MARGIN_S = 1.0  # a dead member's key may outlast its last keep-alive by lease TTL + this
KEEPALIVE_RETRY_S = 0.1  # the next attempt after a keep-alive no etcd endpoint answered
REGISTER_RETRY_S = 0.2  # between attempts to register while another lease holds the key
STEP_FAILURE_LOG_S = 30.0  # a warning this often while etcd fails the member's steps (one at once)

log = logging.getLogger("dflockd_server")


class ClusterKeys:
    """Where a cluster's state lives in etcd."""

    __slots__ = ("leader", "members", "prefix", "root", "shards")

    def __init__(self, prefix: str) -> None:
        if not prefix.startswith("/") or prefix.endswith("/"):
            raise ValueError(f"cluster prefix {prefix!r}: expected /NAME (no trailing /)")
        self.prefix = prefix
        self.root = prefix + "/"
        self.members = prefix + "/members/"
        self.leader = prefix + "/leader"
        self.shards = prefix + "/shard/"

    def member(self, advertise: str) -> str:
        return self.members + advertise

    def registered(self, advertise: str) -> str:
        """Put with each registration of ``advertise``, no lease (see the module's docstring)."""
        return f"{self.prefix}/registered/{advertise}"

    def shard(self, shard: int) -> str:
        return f"{self.shards}{shard}"

    def shard_of(self, key: str) -> int | None:
        """The shard whose key (as ``shard`` writes it) is ``key``, else None: another spelling
        of a number ("05", "+5") would share a shard's revision with a key nobody writes."""
        tail = key.removeprefix(self.shards)
        if not (tail.isascii() and tail.isdigit() and len(tail) <= len(str(SHARD_COUNT))):
            return None
        shard = int(tail)
        return shard if shard < SHARD_COUNT and self.shard(shard) == key else None


@dataclass(frozen=True, slots=True)
class ClusterView:
    """A member's local copy of the cluster's state."""

    members: frozenset[str]
    leader: str | None
    shard_map: ShardMap
    revisions: Mapping[int, int] = field(default_factory=dict[int, int])
    """Each shard key's ``mod_revision`` as read (for writes conditioned on it)."""
    revision: int = 0  # every change of the prefix up to this etcd revision is in the view


class EtcdCopy:
    """A cluster's state in etcd, read whole (``load``) then changed key by key (``apply_kv``);
    a member changes it under its lock."""

    def __init__(self, keys: ClusterKeys, clock: Callable[[], float] = time.monotonic) -> None:
        self.keys = keys
        self._clock = clock
        self.members: set[str] = set()
        self.leader: str | None = None
        self.shards: dict[int, ShardAssignment] = {}
        self._map: ShardMap | None = None  # `shards` as a map, made at the first read after changes
        self.revisions: dict[int, int] = {}
        self.members_changed_at = clock()
        self.seen_revision = 0  # up to this revision the copy holds the prefix (read, then watched)

    def load(self, read: RangeResult) -> None:
        """The copy as of a read of the whole prefix."""
        self.members, self.leader, self._map = set(), None, None
        self.shards, self.revisions = {}, {}
        for kv in read.kvs:
            self.apply_kv(kv.key, kv.value, kv.mod_revision, deleted=False)
        self.seen_revision = read.revision

    def view(self) -> ClusterView:
        members, revisions = frozenset(self.members), dict(self.revisions)
        return ClusterView(members, self.leader, self.shard_map(), revisions, self.seen_revision)

    def shard_map(self) -> ShardMap:
        if self._map is None:
            self._map = ShardMap(self.shards)
        return self._map

    def apply_kv(self, key: str, value: str, revision: int, *, deleted: bool) -> None:
        """One key's change."""
        keys = self.keys
        if key.startswith(keys.members):
            member = key[len(keys.members) :]
            if deleted:
                self.members.discard(member)
            else:
                self.members.add(member)
            self.members_changed_at = self._clock()
        elif key == keys.leader:
            self.leader = None if deleted else value
        elif (shard := keys.shard_of(key)) is not None:
            assignment = None
            if not deleted:
                with contextlib.suppress(ValueError):  # unreadable: treated as unassigned
                    assignment = ShardAssignment.parse(value)
            self.apply_shard(shard, revision, assignment, deleted=deleted)

    def apply_shard(
        self, shard: int, revision: int, assignment: ShardAssignment | None, *, deleted: bool
    ) -> None:
        """One shard's key as of ``revision``."""
        if revision < self.revisions.get(shard, 0):
            return  # older than what the copy holds (the leader's own write, a take-over)
        self._map = None
        if deleted:
            self.revisions.pop(shard, None)
        else:
            self.revisions[shard] = revision
        if assignment is None:
            self.shards.pop(shard, None)
        else:
            self.shards[shard] = assignment


def read_view(client: EtcdClient, prefix: str) -> ClusterView:
    """The cluster's state under ``prefix`` as one read of etcd finds it."""
    copy = EtcdCopy(ClusterKeys(prefix))
    copy.load(client.range(copy.keys.root, prefix=True))
    return copy.view()


class Member:
    """One member of a cluster (see the module's docstring); ``start`` then ``stop``."""

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        advertise: str,
        *,
        lease_ttl: int = 5,
        settle_s: float = 2.0,
        auto_rebalance_s: float | None = None,
        on_lease: Callable[[float], None] | None = None,
        on_update: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        ShardAssignment(advertise)  # the address (checked by ``Config``) fits in a shard value
        self.keys = ClusterKeys(prefix)
        self.copy = EtcdCopy(self.keys, clock)
        self._clock = clock
        self.client = client
        self.advertise = advertise
        self.lease_ttl = lease_ttl
        self.settle_s = settle_s
        self.auto_rebalance_s = auto_rebalance_s
        """The leader rebalances once membership is still this long (None: only by command)."""
        self._on_lease = on_lease
        self._on_update = on_update
        self.lease_id = 0
        self.lease_valid_until = 0.0
        """``clock()`` time the lease surely lives until: last answered keep-alive's send + TTL."""
        self.lost: str | None = None  # why this member stopped taking part (its lease is gone)
        self._lock = threading.Lock()
        self._key_count = 0  # how many keys the prefix holds as of copy.seen_revision
        self._next_watch_check = 0.0
        self._behind_at: int | None = None
        """``copy.seen_revision`` at the last check, if the watch owed changes etcd had then."""
        self.step_failures = 0  # steps of the loop etcd failed (each tried again at the next wake)
        self._failing_since: float | None = None
        self._next_failure_log = 0.0
        self._wake = threading.Event()
        self._next_wake_at: float | None = None
        """When the loop must step at the latest (``_wake_later``), if before ``step_interval``."""
        self._stopping = threading.Event()
        self._watch: Watch | None = None
        self._threads: list[threading.Thread] = []

    def start(self) -> Member:
        self._register()
        # Kept alive from now on: reading the whole prefix may outlast the lease on a loaded host,
        # and a lease gone before its first keep-alive takes the member key (and the join) along.
        self._start_thread(self._keep_alive, "keep-alive")
        try:
            self._resync()
        except BaseException:
            self._stopping.set()  # no keep-alive after this: the lease runs out, as unstarted
            for thread in self._threads:
                thread.join()
            raise
        self._start_thread(self._loop, "loop")
        return self

    def _start_thread(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(
            target=target, name=f"dflockd-member {self.advertise} {name}", daemon=True
        )
        self._threads.append(thread)
        thread.start()

    def _register(self) -> None:
        """Put this member's key under a new lease, only where no other lease holds it: a
        second live process with the same address must not serve these shards too. A crashed
        run's key goes with its lease, so one still there after a whole lease TTL belongs to a
        live process: ``DuplicateMember``."""
        key = self.keys.member(self.advertise)
        deadline = self._clock() + self.lease_ttl + REGISTER_MARGIN_S
        while (held_ttl := self._register_once()) is not None:
            if self._clock() >= deadline + max(0, held_ttl - self.lease_ttl):
                raise DuplicateMember(
                    f"another dflockd is registered in the cluster as {self.advertise} (etcd "
                    f"key {key} stayed alive for a whole lease): two servers cannot share one "
                    "--advertise (DFLOCKD_ADVERTISE); give this one the address it is reached at"
                )
            time.sleep(REGISTER_RETRY_S)

    def _register_once(self) -> int | None:
        """One attempt of ``_register``: None when the key is now held under a new lease of its
        own; else (another lease holds it) the TTL etcd gave this attempt's lease, revoked."""
        key = self.keys.member(self.advertise)
        sent = self._clock()
        lease = self.client.lease_grant(self.lease_ttl)
        registered = Put(self.keys.registered(self.advertise), str(lease.id))
        created = self.client.txn(
            [Compare(key, "CREATE", "EQUAL", 0)], [Put(key, self.advertise, lease.id), registered]
        ).succeeded
        # A registration retried on another endpoint reports failure when the unanswered first
        # attempt made it: the key is then held under this lease.
        if created or ((kv := self.client.get(key)) is not None and kv.lease == lease.id):
            self.lease_id = lease.id
            self.lease_valid_until = sent + self.lease_ttl
            return None
        with contextlib.suppress(EtcdError):
            self.client.lease_revoke(lease.id)
        return lease.ttl

    def join_once(self) -> bool:
        """Join without threads, in one attempt: register (False, nothing changed, while another
        lease holds the key), then read and watch the prefix. The caller then drives it by
        ``keep_alive_step`` and ``step`` (tests/sim). ``EtcdError`` if etcd does not answer."""
        if self._register_once() is not None:
            return False
        self._resync()
        return True

    def stop(self, *, leave: bool = True, timeout: float = 10.0) -> None:
        """Stop. ``leave``: revoke the lease now (a graceful leave); else it runs out (a crash)."""
        self._stopping.set()
        self._wake.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout)
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.stop(timeout)
        if leave and self.lease_id and self.lost is None:
            # etcd unreachable: the lease runs out by itself.
            with contextlib.suppress(EtcdError):
                self.client.lease_revoke(self.lease_id)

    def snapshot(self) -> ClusterView:
        with self._lock:
            return self.copy.view()

    @property
    def is_leader(self) -> bool:
        with self._lock:
            return self.lost is None and self.copy.leader == self.advertise

    def _keep_alive(self) -> None:
        wait: float | None = self.keepalive_interval
        while wait is not None and not self._stopping.wait(wait):
            wait = self.keep_alive_step()  # None once the lease is lost

    @property
    def keepalive_interval(self) -> float:
        """Between two keep-alives of the lease (a third of its TTL)."""
        return max(self.lease_ttl / 3, 0.2)

    def keep_alive_step(self) -> float | None:
        """One keep-alive (the keep-alive thread's step): the wait before the next, or None once
        the lease is lost (``lost`` says why)."""
        sent = self._clock()
        try:
            ttl = self.client.lease_keepalive_once(self.lease_id)
        except EtcdError as exc:
            if self._clock() >= self.lease_valid_until:
                self._lose(f"lease {self.lease_id:x} not renewed for {self.lease_ttl} s: {exc}")
                return None
            # Every endpoint failed (an etcd election, say): retry soon while the lease runs.
            return KEEPALIVE_RETRY_S
        if ttl <= 0:
            self._lose(f"lease {self.lease_id:x} expired")
            return None
        self.lease_valid_until = sent + self.lease_ttl
        if self._on_lease is not None:
            self._on_lease(self.lease_valid_until)
        return self.keepalive_interval

    def _lose(self, why: str) -> None:
        with self._lock:
            self.lost = why
            self.lease_valid_until = 0.0  # read live by the snapshots: grant nothing more
        self._stopping.set()
        self._wake.set()

    def _loop(self) -> None:
        while not self._stopping.is_set():
            wait = self.step_interval
            if (wake_at := self._next_wake_at) is not None:
                wait = max(min(wait, wake_at - self._clock()), 0.0)
            self._next_wake_at = None
            self._wake.wait(wait)
            self._wake.clear()
            if self._stopping.is_set():
                return
            self.step()

    @property
    def step_interval(self) -> float:
        """The member's loop steps at least this often (news wakes it sooner)."""
        return max(self.lease_ttl / 2, 0.2)

    def step(self) -> None:
        """One step of the member's loop: watch anew if the watch ended, moved away or
        stalled; take part in the election; as the leader, keep the map up."""
        began = self._clock()
        try:
            watch = self._watch
            if (
                watch is None
                or not watch.running
                # A watch on an endpoint the client left (paused, cut off from its cluster) may
                # stay open and silent: read again from the one that answers and watch there.
                or watch.endpoint != self.client.preferred
                or self._watch_stalled()
            ):
                self._resync()
            self._elect()
            if self.is_leader:
                self._maintain_map()
        except EtcdError as exc:  # etcd unreachable for now: try again at the next wake-up
            self._step_failed(exc, began)
            return
        if self._failing_since is not None:
            log.info(
                "cluster member %s follows etcd again, after %.1f s of failed steps",
                self.advertise,
                self._clock() - self._failing_since,
            )
            self._failing_since = None

    def _step_failed(self, exc: EtcdError, began: float) -> None:
        """Said at once, then every ``STEP_FAILURE_LOG_S`` while the failures last: meanwhile
        this member's view of members, leader and map may be behind etcd's."""
        now = self._clock()
        self.step_failures += 1
        if self._failing_since is None:
            self._failing_since, self._next_failure_log = began, now
        if now < self._next_failure_log:
            return
        self._next_failure_log = now + STEP_FAILURE_LOG_S
        log.warning(
            "cluster member %s cannot follow etcd (failing for %.1f s; its view of members, "
            "leader and map may be behind): %s",
            self.advertise,
            now - self._failing_since,
            exc,
        )

    def _watch_stalled(self) -> bool:
        """At most once per ``lease_ttl``: whether the watch owes changes (another key count,
        or a key put after the copy's revision) and owed them at the previous check already,
        with nothing brought since: at one check the changes may still be on their way."""
        now = self._clock()
        if now < self._next_watch_check:
            return False
        self._next_watch_check = now + self.lease_ttl
        with self._lock:
            seen, count = self.copy.seen_revision, self._key_count
        stat = self.client.stat(self.keys.root, prefix=True, since=seen)
        behind = stat.modified or stat.count != count
        stalled = behind and self._behind_at == seen
        self._behind_at = seen if behind else None
        if stalled:
            log.warning(
                "the etcd watch of %s brought nothing for %g s or more while etcd had changes "
                "after revision %d (read at %d: %d keys, %d here): reading it again",
                self.keys.root,
                self.lease_ttl,
                seen,
                stat.revision,
                stat.count,
                count,
            )
        return stalled

    def _resync(self) -> None:
        """Read the whole prefix, then watch it from the revision after what was read."""
        old, self._watch = self._watch, None
        if old is not None:
            old.stop()
        result = self.client.range(self.keys.root, prefix=True)
        with self._lock:
            self.copy.load(result)
            self._key_count = len(result.kvs)
        self._behind_at = None
        self._next_watch_check = self._clock() + self.lease_ttl
        self._watch = self.client.watch(
            self.keys.root, prefix=True, start_revision=result.revision + 1, on_event=self._on_event
        )
        self._changed()

    def _on_event(self, event: WatchEvent) -> None:
        kv = event.kv
        deleted = event.type == "delete"
        with self._lock:
            self.copy.apply_kv(kv.key, kv.value, kv.mod_revision, deleted=deleted)
            self.copy.seen_revision = max(self.copy.seen_revision, kv.mod_revision)
            if deleted:
                self._key_count -= 1
            elif kv.version == 1:
                self._key_count += 1  # created (a change of a key already there is version 2+)
        self._changed()

    def _changed(self) -> None:
        """The local copy changed: wake the loop, ``on_update()`` (cheap)."""
        self._wake.set()
        if self._on_update is not None:
            self._on_update()

    def _elect(self) -> None:
        with self._lock:
            leader = self.copy.leader
        if leader is None and self.client.create_if_absent(
            self.keys.leader, self.advertise, lease=self.lease_id
        ):
            with self._lock:  # the watch confirms it too
                self.copy.leader = self.advertise

    def _maintain_map(self) -> None:
        with self._lock:
            live = set(self.copy.members)
            current = self.copy.shard_map()
            revisions = dict(self.copy.revisions)
            still_for = self._clock() - self.copy.members_changed_at
        if not live:
            return
        if len(current) == 0:
            if still_for < self.settle_s:
                self._wake_later(self.settle_s - still_for)
            else:
                self._write(current.diff(ShardMap.initial(live)), revisions)
            return
        if changes := current.diff(current.updated(live)):
            self._write(changes, revisions)
        else:
            self._rebalance(current, live, still_for, revisions)

    def _rebalance(
        self, current: ShardMap, live: set[str], still_for: float, revisions: Mapping[int, int]
    ) -> None:
        """Even the live members out once membership has been still for ``auto_rebalance_s``
        and no shard is moving (each move is a handover, key by key: nothing held is cut)."""
        wait = self.auto_rebalance_s
        if wait is None:
            return
        if still_for < wait:
            self._wake_later(wait - still_for)
            return
        if any(current[s].target in live for s in current.moves_in_progress()):
            return  # the handovers' writes wake this loop again (a move towards a gone
            # member, a shard pinned there, cannot end: it does not hold the others back)
        if plan := current.rebalance_plan(live):
            log.info(
                "cluster leader %s: membership still for %.0f s; rebalancing %d shard(s)",
                self.advertise,
                still_for,
                len(plan),
            )
            self._write(current.diff(current.apply(plan)), revisions)

    def _wake_later(self, delay: float) -> None:
        """Step again in ``delay`` seconds at the latest (read by the loop, in this thread; a
        member driven by its steps, ``join_once``, is stepped often enough by its driver)."""
        at = self._clock() + delay
        if self._next_wake_at is None or at < self._next_wake_at:
            self._next_wake_at = at

    def _write(
        self, changes: dict[int, ShardAssignment | None], revisions: Mapping[int, int]
    ) -> None:
        """Write map changes, each on condition of leadership and of the shard being as read
        (when deposed or a shard had changed, decided again later)."""
        still_leader = Compare(self.keys.leader, "LEASE", "EQUAL", self.lease_id)
        result = write_shards(
            self.client,
            self.keys.shards,
            {s: ShardWrite(revisions.get(s, 0), a) for s, a in changes.items()},
            condition=[still_leader],
        )
        with self._lock:  # the watch confirms these too
            for s, revision in result.written.items():
                self.copy.apply_shard(s, revision, changes[s], deleted=changes[s] is None)
            if result.condition_failed and self.copy.leader == self.advertise:
                self.copy.leader = None  # deposed: the watch will say by whom
        if result.conflicted and not result.condition_failed:
            self._wake_later(max(self.lease_ttl / 4, 0.1))  # the watch brings what changed
