"""Members in threads against a real etcd: registration, election, the map and its upkeep."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from dflockd_server.cluster.etcd import EtcdClient
from dflockd_server.cluster.membership import ClusterKeys, Member, read_view
from dflockd_server.cluster.shardmap import SHARD_COUNT, ShardAssignment, ShardMap
from tests.support.etcd import EtcdServer, find_etcd, put
from tests.support.proxy import FaultProxy
from tests.support.waiting import wait_until

TTL = 2  # seconds: etcd's minimum lease is about 1.5 s with its default timings
WAIT_S = 45.0
"""How long a wait for the cluster's progress may take before the test fails: a deadline, not
a bound the tests claim (CI, on a machine running 2-3x slower than usual, once took over 15 s to
serve the initial map)."""


def stored_map(etcd: EtcdClient, keys: ClusterKeys) -> ShardMap:
    kvs = etcd.get_prefix(keys.shards)
    return ShardMap(
        {int(kv.key[len(keys.shards) :]): ShardAssignment.parse(kv.value) for kv in kvs}
    )


@pytest.fixture
def members(etcd_server: EtcdServer, etcd_prefix: str) -> Iterator[Callable[..., list[Member]]]:
    """``start(*names)`` -> started members of one cluster; all stopped at teardown."""
    started: list[Member] = []
    prefix = etcd_prefix.rstrip("/")

    def start(*names: str, settle_s: float = 5.0, client: EtcdClient | None = None) -> list[Member]:
        # The group's map waits for the whole group: each member registers in etcd (a lease
        # grant and a transaction etcd fsyncs), one after another, and on CI's saturated cores
        # one registered more than 5 s after the one before, which the leader's map then left
        # out (a map without it and members that hand nothing over by themselves never agree).
        # So no map is written until every member of the group has registered; then the
        # members wait ``settle_s`` of still membership (the shipped default is 2 s).
        new = [
            Member(client or etcd_server.client(), prefix, name, lease_ttl=TTL, settle_s=math.inf)
            for name in names
        ]
        for member in new:
            started.append(member.start())
        for member in new:
            member.settle_s = settle_s
        return new

    yield start
    for member in started:
        member.stop(leave=False)


def leaders(group: list[Member]) -> list[str]:
    return [m.advertise for m in group if m.is_leader]


def agreed(group: list[Member], expected: ShardMap) -> bool:
    return all(m.snapshot().shard_map == expected for m in group)


def test_three_members_one_leader_and_the_initial_map(
    members: Callable[..., list[Member]], etcd: EtcdClient
) -> None:
    group = members("127.0.0.1:7003", "127.0.0.1:7001", "127.0.0.1:7002")
    keys = group[0].keys
    expected = ShardMap.initial(["127.0.0.1:7001", "127.0.0.1:7002", "127.0.0.1:7003"])
    took = wait_until(
        lambda: agreed(group, expected), timeout=WAIT_S, what="every member has the initial map"
    )
    print(f"initial map on every member after {took:.2f} s")
    assert len(leaders(group)) == 1
    leader = leaders(group)[0]
    assert {m.snapshot().leader for m in group} == {leader}
    assert {m.snapshot().members for m in group} == {frozenset(expected.counts())}
    assert expected.counts() == {
        "127.0.0.1:7001": 2731,
        "127.0.0.1:7002": 2731,
        "127.0.0.1:7003": 2730,
    }
    # The map is in etcd, one key per shard, in the seed's format.
    assert stored_map(etcd, keys) == expected
    assert etcd.get(keys.shard(0)) is not None
    kv = etcd.get(keys.shard(0))
    assert kv is not None and kv.value == "127.0.0.1:7001,127.0.0.1:7001"
    assert len(etcd.get_prefix(keys.shards)) == SHARD_COUNT


def test_a_new_member_gets_nothing_until_rebalance(
    members: Callable[..., list[Member]], etcd: EtcdClient
) -> None:
    group = members("a:1", "b:1")
    expected = ShardMap.initial(["a:1", "b:1"])
    wait_until(lambda: agreed(group, expected), timeout=WAIT_S, what="the initial map")
    (late,) = members("c:1")
    wait_until(
        lambda: all("c:1" in m.snapshot().members for m in group),
        timeout=WAIT_S,
        what="c:1 is seen",
    )
    wait_until(
        lambda: late.snapshot().shard_map == expected, timeout=WAIT_S, what="c:1 has the map"
    )
    time.sleep(0.5)  # the leader had its chance to (wrongly) change the map
    assert stored_map(etcd, group[0].keys) == expected
    # A map that did not change is not made again, nor sorted again: a member's node reads it
    # every 100 ms while a failover waits (8,192 shards copied, checked and sorted each time).
    first, again = late.snapshot().shard_map, late.snapshot().shard_map
    assert first is again
    assert first.items() is again.items()
    assert [s for s, _ in first.items()] == list(range(SHARD_COUNT))


@pytest.fixture
def etcd_proxy(etcd_server: EtcdServer) -> Iterator[FaultProxy]:
    """A proxy in front of the module's etcd (ask for it before ``members``: the members whose
    client goes through it are then stopped before it is)."""
    with FaultProxy(("127.0.0.1", etcd_server.client_port)) as proxy:
        yield proxy


def test_a_member_whose_watch_stalls_open_still_sees_members_join_and_leave(
    etcd_proxy: FaultProxy, members: Callable[..., list[Member]]
) -> None:
    """A watch stream that stays open but brings nothing more (etcd's replies stop on the way; the
    connection is not closed, so the watch's thread waits on, without an error) is noticed by the
    member's check of its watch against a read of the prefix: it reads the prefix again and
    watches anew. An idle watch (nothing changed) is not replaced."""
    proxied = EtcdClient(f"http://127.0.0.1:{etcd_proxy.address[1]}")
    (stalled,) = members("a:1", client=proxied)
    (other,) = members("b:1")
    expected = ShardMap.initial(["a:1", "b:1"])
    wait_until(lambda: agreed([stalled, other], expected), timeout=WAIT_S, what="the initial map")
    # Idle: the check (one every lease_ttl) leaves the watch alone.
    idle = stalled._watch
    assert idle is not None
    time.sleep(3 * TTL + 0.5)
    assert stalled._watch is idle and idle.running

    assert etcd_proxy.hold_replies_of(b"/v3/watch") == 1  # a:1's watch: open, silent from now on
    (late,) = members("c:1")
    took = wait_until(
        lambda: late.lost is not None or "c:1" in stalled.snapshot().members,
        timeout=WAIT_S,
        what="the member whose watch stalled sees c:1 join",
    )
    assert late.lost is None, late.lost  # (a c:1 that lost its lease would never be seen)
    print(f"c:1 seen through a stalled watch after {took:.2f} s (lease {TTL} s)")
    assert "c:1" in other.snapshot().members
    # Seen in a new read of the prefix; a new watch starts from it.
    wait_until(
        lambda: (watch := stalled._watch) is not None and watch is not idle and watch.running,
        timeout=WAIT_S,
        what="a:1 watches again",
    )

    # Its new watch stalls too; c:1 leaves (its key deleted, no key put: the count tells).
    renewed = stalled._watch
    assert etcd_proxy.hold_replies_of(b"/v3/watch") >= 1  # the old one may not be gone yet
    late.stop(leave=True)
    took = wait_until(
        lambda: "c:1" not in stalled.snapshot().members,
        timeout=WAIT_S,
        what="the member whose watch stalled sees c:1 leave",
    )
    print(f"c:1's leave seen through a stalled watch after {took:.2f} s")
    assert stalled._watch is not renewed  # read again, watched anew
    assert stalled.snapshot().shard_map == expected


def test_a_member_whose_first_read_outlasts_its_lease_keeps_it(
    etcd_proxy: FaultProxy, members: Callable[..., list[Member]]
) -> None:
    """A member's start reads the whole prefix (the map: 8,192 keys) after registering; on CI's
    saturated cores that read once took longer than the lease, and with the keep-alives only
    starting after it the new member's lease ran out before its first keep-alive: its key was
    gone, so nobody ever saw it join. The lease is kept alive from the registration on."""
    (first,) = members("a:1")
    expected = ShardMap.initial(["a:1"])
    wait_until(lambda: agreed([first], expected), timeout=WAIT_S, what="the initial map")
    proxied = EtcdClient(f"http://127.0.0.1:{etcd_proxy.address[1]}")
    held = etcd_proxy.hold_reply_after(b"/v3/kv/range")  # the new member's read of the prefix

    def release_after_the_lease() -> None:
        if held.wait(WAIT_S):
            time.sleep(TTL + 1.0)
        etcd_proxy.release_replies()

    releaser = threading.Thread(target=release_after_the_lease, daemon=True)
    releaser.start()
    began = time.monotonic()
    (late,) = members("c:1", client=proxied)
    releaser.join()
    assert time.monotonic() - began > TTL + 1.0, "the read was not held past the lease"
    time.sleep(TTL)  # its keep-alives (one every TTL / 3) had their chance
    assert late.lost is None
    wait_until(lambda: "c:1" in first.snapshot().members, timeout=WAIT_S, what="c:1 is seen")
    assert "c:1" in late.snapshot().members


def test_a_member_whose_etcd_calls_fail_says_so_and_when_they_answer_again(
    etcd_proxy: FaultProxy, members: Callable[..., list[Member]], caplog: pytest.LogCaptureFixture
) -> None:
    """A step of the member's loop that etcd fails is tried again at the next wake-up; the
    member says so at once (its view may be behind etcd's meanwhile), not only once its lease
    is gone, and says when it follows etcd again. Here one read through the proxy gets no
    reply (the client's 5 s timeout); the lease's keep-alives still pass."""
    caplog.set_level(logging.INFO, logger="dflockd_server")
    proxied = EtcdClient(f"http://127.0.0.1:{etcd_proxy.address[1]}")
    (member,) = members("a:1", client=proxied)
    wait_until(lambda: member.snapshot().shard_map is not None, timeout=WAIT_S, what="a map")
    held = etcd_proxy.hold_reply_after(b"/v3/kv/range")
    assert held.wait(WAIT_S), "no read went through the proxy"
    wait_until(lambda: member.step_failures >= 1, timeout=WAIT_S, what="a failed step")
    wait_until(
        lambda: any("follows etcd again" in r.getMessage() for r in caplog.records),
        timeout=WAIT_S,
        what="the member's word that it follows etcd again",
    )
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    failed = [m for m in warned if "cluster member a:1 cannot follow etcd" in m]
    assert len(failed) == 1, warned
    assert "(prefix) failed" in failed[0] and str(etcd_proxy.address[1]) in failed[0], failed[0]
    assert member.lost is None


def test_when_the_leaders_lease_goes_another_member_leads_and_takes_its_shards(
    members: Callable[..., list[Member]], etcd: EtcdClient
) -> None:
    group = members("a:1", "b:1", "c:1")
    before = ShardMap.initial(["a:1", "b:1", "c:1"])
    wait_until(lambda: agreed(group, before), timeout=WAIT_S, what="the initial map")
    (old,) = [m for m in group if m.is_leader]
    rest = [m for m in group if m is not old]
    etcd.lease_revoke(old.lease_id)  # as if it died and its lease ran out
    took = wait_until(lambda: len(leaders(rest)) == 1, timeout=WAIT_S, what="a new leader")
    print(f"new leader after {took:.2f} s")
    wait_until(
        lambda: old.lost is not None, timeout=WAIT_S, what="the old leader knows it lost its lease"
    )
    assert not old.is_leader
    survivors = {m.advertise for m in rest}
    after = before.updated(survivors)
    wait_until(
        lambda: agreed(rest, after), timeout=WAIT_S, what="the survivors have the updated map"
    )
    changed = before.diff(after)
    assert set(changed) == {s for s, a in before.items() if a.target == old.advertise}
    assert all(a is not None and a.current == old.advertise for a in changed.values())
    assert stored_map(etcd, old.keys) == after


def test_a_member_whose_lease_expires_disappears_and_only_its_shards_move(
    members: Callable[..., list[Member]], etcd: EtcdClient
) -> None:
    group = members("a:1", "b:1", "c:1")
    before = ShardMap.initial(["a:1", "b:1", "c:1"])
    wait_until(lambda: agreed(group, before), timeout=WAIT_S, what="the initial map")
    victim = next(m for m in group if not m.is_leader)
    rest = [m for m in group if m is not victim]
    victim.stop(leave=False)  # a crash: nobody revokes its lease, it runs out
    stopped_at = time.monotonic()
    wait_until(
        lambda: all(victim.advertise not in m.snapshot().members for m in rest),
        timeout=WAIT_S,
        what="the dead member is gone",
    )
    gone_after = time.monotonic() - stopped_at
    print(f"dead member gone after {gone_after:.2f} s (lease {TTL} s)")
    assert gone_after >= 1.0  # its lease, not something else, ended it
    after = before.updated({m.advertise for m in rest})
    wait_until(
        lambda: agreed(rest, after), timeout=WAIT_S, what="the survivors have the updated map"
    )
    assert set(before.diff(after)) == {s for s, a in before.items() if a.target == victim.advertise}
    assert after.counts() == {m.advertise: SHARD_COUNT // 2 for m in rest}
    assert stored_map(etcd, victim.keys) == after
    assert len(leaders(rest)) == 1


def test_members_resynchronise_after_etcd_restarts(tmp_path: Path, etcd_server: EtcdServer) -> None:
    """etcd stops and comes back (same data): the watches resume and the map is kept up."""
    binary = find_etcd()
    assert binary is not None  # etcd_server skipped or failed otherwise
    private = EtcdServer(binary, tmp_path).start()
    group: list[Member] = []
    try:
        # A longer lease: the members must not give up while etcd restarts (about a second
        # here, more on a loaded machine; a graceful leave revokes it, so it costs no time).
        # Membership still for 2 s before the first map: with 0.5 s, a loaded CI machine
        # registered the third member later than that, the map left it out, and the members
        # (which hand nothing over by themselves) never agreed on the map of three.
        group = [
            Member(
                private.client(timeout=2.0), "/restart", name, lease_ttl=15, settle_s=2.0
            ).start()
            for name in ("a:1", "b:1", "c:1")
        ]
        before = ShardMap.initial(["a:1", "b:1", "c:1"])
        wait_until(lambda: agreed(group, before), timeout=WAIT_S, what="the initial map")
        private.stop()
        private.start()
        # Every member's watch ended with the old process; a member sees a change after this
        # only if its loop replaced the watch (a fresh read of the prefix, then a new watch).
        leaving = next(m for m in group if not m.is_leader)
        rest = [m for m in group if m is not leaving]
        leaving.stop(leave=True)  # a graceful leave, after the restart
        after = before.updated({m.advertise for m in rest})
        took = wait_until(
            lambda: agreed(rest, after), timeout=WAIT_S, what="the survivors' map after the restart"
        )
        print(f"map updated {took:.2f} s after a leave that followed an etcd restart")
        assert all(m.lost is None for m in rest)
        assert len(leaders(rest)) == 1
        assert stored_map(private.client(), rest[0].keys) == after
    finally:
        for member in group:
            member.stop(leave=False)
        private.stop()


def test_the_map_is_read_from_its_own_keys_only(etcd: EtcdClient, etcd_prefix: str) -> None:
    """A key under the map's prefix that is not a shard's own spelling (what ``ClusterKeys.shard``
    writes) is no shard: not for a member, nor for the operator's commands (``read_view``, which
    a superscript digit made fail)."""
    keys = ClusterKeys(etcd_prefix.rstrip("/"))
    a = ShardAssignment("a:1", "a:1")
    spellings = ["05", "+5", " 5", "5 ", "0_5", "\u0665", "\u00b2", "-0", "", "x", "1" * 5000]
    for tail in [*spellings, str(SHARD_COUNT)]:
        put(etcd, keys.shards + tail, "b:1,b:1")
    expected = ({5: a}, {5: put(etcd, keys.shard(5), a.format())})
    view = read_view(etcd, keys.prefix)
    assert (dict(view.shard_map.items()), dict(view.revisions)) == expected
    member = Member(etcd, keys.prefix, "a:1", lease_ttl=TTL)
    assert member.join_once()  # read and watched, never stepped: it writes no map
    try:
        seen = member.snapshot()
        assert (dict(seen.shard_map.items()), dict(seen.revisions)) == expected
        put(etcd, keys.shards + "007", "b:1,b:1")  # through the watch, before shard 7's own key
        put(etcd, keys.shard(7), a.format())
        wait_until(lambda: 7 in member.snapshot().revisions, timeout=WAIT_S, what="shard 7 seen")
        assert dict(member.snapshot().shard_map.items()) == {5: a, 7: a}
    finally:
        member.stop()
