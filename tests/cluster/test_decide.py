"""A member's per-shard decisions (pure), its ownership snapshots, fence raising and URLs."""

from __future__ import annotations

import json
import math
import re

import pytest

from dflockd_server import constants
from dflockd_server.cluster.decide import (
    ERROR_UNAVAILABLE,
    FENCED,
    SHARD_STATES,
    decide,
)
from dflockd_server.cluster.membership import ClusterView
from dflockd_server.cluster.ops import parse_cluster_url, summary
from dflockd_server.cluster.shardmap import SHARD_COUNT, ShardAssignment, ShardMap, shard_id
from dflockd_server.cluster.snapshot import ClusterOwnership
from dflockd_server.fence import fence_of
from dflockd_server.protocol import reply_moved
from dflockd_server.tokens import FenceCounter

A, B, C = "a:1", "b:1", "c:1"
WAIT = 3.0


def view(shards: dict[int, ShardAssignment], members: set[str] | None = None) -> ClusterView:
    return ClusterView(frozenset(members or {A, B, C}), A, ShardMap(shards))


def test_each_kind_of_shard() -> None:
    v = view(
        {
            0: ShardAssignment(A, A),  # serve
            1: ShardAssignment(B, A),  # moving out to B
            2: ShardAssignment(A, B),  # taking over from live B
            3: ShardAssignment(A, "d:1"),  # failover from dead d
            4: ShardAssignment(A, ""),  # failover: nobody served it
            5: ShardAssignment(B, B),  # other
            6: ShardAssignment(C, ""),  # other, nobody current: the target
            7: ShardAssignment(C, "d:1"),  # other: the current node, as the contract says
        }
    )
    d = decide(v, A, now=10.0, failover_since={}, failover_wait_s=WAIT)
    assert d.verdicts[0] is None
    assert d.verdicts[1] == ERROR_UNAVAILABLE  # but the keys held or queued here: not split yet
    assert d.holding == {1}
    assert d.verdicts[2] == ERROR_UNAVAILABLE
    assert d.verdicts[3] == ERROR_UNAVAILABLE
    assert d.verdicts[4] == ERROR_UNAVAILABLE
    assert d.verdicts[5] == b"error_moved b:1\n"
    assert d.verdicts[6] == b"error_moved c:1\n"
    assert d.verdicts[7] == b"error_moved d:1\n"
    assert d.verdicts[8] == ERROR_UNAVAILABLE  # no assignment at all
    assert d.serving == {0}
    assert d.moving_out == {B: frozenset({1})}
    assert d.failover_due == ()
    # Every shard whose current member is gone (or that has none), whatever its target.
    assert d.failover_since == {3: 10.0, 4: 10.0, 6: 10.0, 7: 10.0}
    # The same pass counts them (what the metrics report); 8..8191 have no assignment.
    assert d.states == {
        "serving": 1,
        "moving_out": 1,
        "taking_over": 1,
        "failing_over": 2,
        "other": 3,
        "unavailable": SHARD_COUNT - 8,
    }
    assert tuple(d.states) == SHARD_STATES


def test_a_split_shard_is_asked_for_at_its_node_whatever_its_target() -> None:
    split = f"split={B}"
    v = view(
        {
            0: ShardAssignment(B, A, (split,)),  # moving out to B, split
            1: ShardAssignment(A, A, (split,)),  # the move cancelled: still split to B
            2: ShardAssignment(C, A, (split,)),  # retargeted: still split to B
            3: ShardAssignment(A, B, (f"split={A}",)),  # importing from live B
            4: ShardAssignment(C, B, (f"split={A}",)),  # importing, another target
            5: ShardAssignment(B, A, ("split=d:1",)),  # split to a member not live
        }
    )
    d = decide(v, A, now=10.0, failover_since={}, failover_wait_s=WAIT)
    for shard in (0, 1, 2):
        assert d.verdicts[shard] == b"error_ask b:1\n"
    assert d.verdicts[3] == d.verdicts[4] == b"error_moved b:1\n"
    assert d.verdicts[5] == ERROR_UNAVAILABLE
    assert d.holding == {0, 1, 2, 5}
    assert d.importing == {3, 4}
    assert d.moving_out == {B: frozenset({0, 1, 2}), "d:1": frozenset({5})}
    assert d.granting == {0, 1, 2, 3, 4, 5}
    # Not cleared (the fence not raised yet): nothing asked for, nothing imported.
    d = decide(v, A, now=10.0, failover_since={}, failover_wait_s=WAIT, cleared=set())
    assert d.holding == d.importing == frozenset()
    assert set(d.verdicts[:5]) == {ERROR_UNAVAILABLE}
    # The handover to the split's node drops the flag; any other node keeps it.
    assert ShardAssignment(B, A, (split,)).served_by(B).flags == ()
    assert ShardAssignment(C, "", (split,)).served_by(C).split == B


def test_a_released_shard_is_taken_at_once_an_empty_current_alone_waits() -> None:
    released = ShardAssignment(A, B).release()
    assert released == ShardAssignment(A, "", ("released",)) and released.released
    v = view(
        {
            0: released,  # B left gracefully, nothing held: no lease to wait for
            1: ShardAssignment(A, ""),  # no history (an orphan given a target): wait
            2: ShardAssignment(A, "d:1"),  # a dead member: wait
            3: ShardAssignment(C, "", ("released",)),  # released, another target: send there
            4: ShardAssignment(A, B, ("released",)),  # stale flag beside a current: no meaning
        }
    )
    d = decide(v, A, now=10.0, failover_since={}, failover_wait_s=WAIT)
    assert d.failover_due == (0,)
    assert d.failover_since == {1: 10.0, 2: 10.0}  # never a released one: nothing to wait for
    assert d.next_due == 10.0  # the released one is due now (again, if its write failed)
    assert d.verdicts[0] == ERROR_UNAVAILABLE  # until current = self is written and seen
    assert d.verdicts[3] == b"error_moved c:1\n"
    assert d.verdicts[4] == ERROR_UNAVAILABLE  # taking over from live B: B hands it over
    assert d.states["failing_over"] == 3 and d.states["taking_over"] == 1
    # The heir's write drops the flag; the next view serves it.
    taken = v.shard_map[0].served_by(A)
    assert taken == ShardAssignment(A, A) and not taken.released
    served = decide(view({0: taken}), A, now=10.0, failover_since={}, failover_wait_s=WAIT)
    assert served.verdicts[0] is None and served.failover_due == ()


def test_only_a_graceful_leave_writes_a_released_shard() -> None:
    # The leader's upkeep moves a gone member's targets and keeps current and flags: a
    # released shard stays released (its new target takes it at once), a shard whose member
    # died keeps naming it (its new target waits).
    m = ShardMap({0: ShardAssignment(B, B).release(), 1: ShardAssignment(B, B)})
    after = m.updated([A])
    assert after[0] == ShardAssignment(A, "", ("released",)) and after[0].released
    assert after[1] == ShardAssignment(A, B) and not after[1].released
    # A shard without any assignment gets a target and an empty current, never the flag.
    orphan = ShardMap({0: ShardAssignment(A, A)}).updated([A])[1]
    assert orphan == ShardAssignment(A, "") and not orphan.released
    # A fresh map: current = target everywhere.
    assert not any(a.released or not a.current for _, a in ShardMap.initial([A, B]).items())
    # Stored and read back; the flag kept beside others (pinned).
    pinned = ShardAssignment(B, B, ("pinned",)).release()
    assert pinned.format() == "b:1,,f=pinned,f=released"
    assert ShardAssignment.parse(pinned.format()).released
    assert pinned.served_by(B) == ShardAssignment(B, B, ("pinned",))
    assert pinned.served_by(pinned.target) == ShardAssignment(B, B, ("pinned",))


def test_failover_waits_from_when_it_was_first_seen() -> None:
    v = view({3: ShardAssignment(A, "d:1")})
    first = decide(v, A, now=10.0, failover_since={}, failover_wait_s=WAIT)
    later = decide(v, A, now=12.9, failover_since=first.failover_since, failover_wait_s=WAIT)
    assert later.failover_due == ()
    assert later.failover_since == {3: 10.0}
    # When it is due, from when it was first seen: a member steps again then (or on news).
    assert first.next_due == later.next_due == 10.0 + WAIT
    waits = {"d:1": WAIT + 5.0}  # the longest lease the dead member published, plus the margin
    longer = decide(
        v, A, now=12.9, failover_since={3: 10.0}, failover_wait_s=WAIT, failover_waits=waits
    )
    assert longer.failover_due == () and longer.next_due == 10.0 + WAIT + 5.0
    due = decide(v, A, now=13.0, failover_since=later.failover_since, failover_wait_s=WAIT)
    assert due.failover_due == (3,) and due.next_due == 10.0 + WAIT  # past: step again
    assert due.verdicts[3] == ERROR_UNAVAILABLE  # until current = self is written and seen
    # The dead member came back before the wait ended: a handover now, the wait forgotten.
    back = view({3: ShardAssignment(A, "d:1")}, {A, "d:1"})
    again = decide(back, A, now=13.0, failover_since=later.failover_since, failover_wait_s=WAIT)
    assert again.failover_due == () and again.failover_since == {}
    assert again.next_due == math.inf  # nothing waits on time: only news wakes it


def test_held_shards_wait_for_the_fence() -> None:
    v = view({0: ShardAssignment(A, A), 1: ShardAssignment(A, A)})
    d = decide(v, A, now=0.0, failover_since={}, failover_wait_s=WAIT, cleared={0})
    assert d.verdicts[0] is None and d.verdicts[1] == ERROR_UNAVAILABLE
    assert d.serving == {0, 1}


def test_fenced_refuses_everything() -> None:
    assert set(FENCED.verdicts) == {ERROR_UNAVAILABLE}
    assert FENCED.states == {**dict.fromkeys(SHARD_STATES, 0), "unavailable": SHARD_COUNT}
    assert len(FENCED.verdicts) == SHARD_COUNT
    assert reply_moved("h:6388") == b"error_moved h:6388\n"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_snapshot_checks_keys_and_its_lease_deadline() -> None:
    key = "task:1"
    s = shard_id(key)
    v = view({s: ShardAssignment(A, A), (s + 1) % SHARD_COUNT: ShardAssignment(B, A)})
    d = decide(v, A, now=0.0, failover_since={}, failover_wait_s=WAIT)
    clock = Clock()
    own = ClusterOwnership(
        A, v, d.verdicts, valid_until=101.0, clock=clock, current=frozenset(d.serving)
    )
    assert own.check(key) is None and own.may_hold(key)
    assert not own.may_hold(next(k for k in (f"k{i}" for i in range(999)) if shard_id(k) != s))
    clock.now = 101.0  # the lease may be gone: no grant, no renewal, without any thread's help
    assert own.check(key) == ERROR_UNAVAILABLE
    assert not own.may_hold(key)
    fenced = ClusterOwnership(A, v, d.verdicts, 1e9, clock, fenced=True, current=d.serving)
    assert fenced.check(key) == ERROR_UNAVAILABLE and not fenced.may_hold(key)


def test_describe_is_the_contracts_json() -> None:
    m = dict(ShardMap.initial([A, B]).pin(5).apply([]).items())
    m = ShardMap({**m, 7: ShardAssignment(C, A), 9: ShardAssignment(B, "")})
    v = ClusterView(frozenset({B, A}), B, m)
    own = ClusterOwnership(B, v, FENCED.verdicts, 0.0, Clock())
    d = json.loads(json.dumps(own.describe()))
    assert d["mode"] == "cluster" and d["self"] == B and d["leader"] == B
    assert d["members"] == [A, B] and d["shard_count"] == 8192 and d["hash"] == "fnv1a32"
    assert d["nodes"] == [A, B, C]
    assert len(d["current"]) == len(d["target"]) == SHARD_COUNT
    assert d["target"][7] == 2 and d["current"][7] == 0
    assert d["target"][9] == 1 and d["current"][9] == -1
    assert d["pinned"] == [5]
    assert d["moving"] == [7, 9]


class MemoryStore:
    def __init__(self) -> None:
        self.value = 0
        self.writes: list[int] = []

    def read(self) -> int:
        return self.value

    def write(self, ceiling: int) -> None:
        self.value = ceiling
        self.writes.append(ceiling)


def test_raise_to_stores_the_ceiling_first_and_never_goes_back() -> None:
    store = MemoryStore()
    counter = FenceCounter(store=store, wall_clock_ns=lambda: 1000)
    assert store.value == 1000 + constants.FENCE_PERSIST_BLOCK
    first = fence_of(counter.next_token())
    assert first == 1001
    other_ceiling = 10**12
    counter.raise_to(other_ceiling)
    assert store.value > other_ceiling  # stored before any counter at or above the old one
    assert fence_of(counter.next_token()) == other_ceiling + 1
    counter.raise_to(5)  # lower: nothing changes
    assert fence_of(counter.next_token()) == other_ceiling + 2
    assert counter.publish() == store.value == counter.ceiling


def test_a_new_counter_starts_above_its_stored_ceiling() -> None:
    store = MemoryStore()
    store.value = 5 * 10**18
    assert fence_of(FenceCounter(store=store).next_token()) == 5 * 10**18 + 1


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("etcd://127.0.0.1:2379", ("http://127.0.0.1:2379", "/dflockd")),
        ("etcd://etcd:2379/", ("http://etcd:2379", "/dflockd")),
        ("etcd://etcd:2379/locks/prod", ("http://etcd:2379", "/locks/prod")),
        ("etcd://e1:2379,e2:2379,e3:2379/p", ("http://e1:2379,e2:2379,e3:2379", "/p")),
        ("etcds://e1:2379,[::1]:2379", ("https://e1:2379,[::1]:2379", "/dflockd")),
    ],
)
def test_cluster_urls(url: str, expected: tuple[str, str]) -> None:
    assert parse_cluster_url(url) == expected


@pytest.mark.parametrize(
    "url",
    [
        "http://e:2379",
        "etcd://e",
        "etcd://e:x",
        "etcd://:1/p",
        "etcd://e:1/p?x=1",
        "etcd://e:1,,f:1/p",
        "etcd://e:1,e:1/p",
        "etcd://u:pw@e:1/p",
        "etcds://e:1,f/p",
        "etcd://a..b:1",  # (a traceback of the idna codec was its answer)
        f"etcd://e:1,{'x' * 64}.example:1/p",
    ],
)
def test_bad_cluster_urls_name_the_flag(url: str) -> None:
    with pytest.raises(ValueError, match=re.escape("--cluster (or DFLOCKD_CLUSTER)")):
        parse_cluster_url(url)


def test_summary_mentions_what_an_operator_needs() -> None:
    m = ShardMap.initial([A, B]).pin(3).updated([A])
    text = "\n".join(summary(ClusterView(frozenset({A, C}), A, m)))
    assert "b:1: target of 1, serving 1  (not live)" in text  # only its pinned shard stays
    assert "pinned: 3" in text and "not live: 3" in text
    assert "a rebalance would move" in text


def test_the_wait_counts_from_when_the_member_was_seen_gone_not_from_the_new_target() -> None:
    # The leader gives a dead member's shards new targets in batches of writes, seconds apart
    # when etcd is slow: each heir counts from when it saw the member gone, so one dead
    # member's shards fall due together, not batch by batch.
    dead = "d:1"
    before = view({3: ShardAssignment(dead, dead), 4: ShardAssignment(dead, dead)})
    seen = decide(before, A, now=10.0, failover_since={}, failover_wait_s=WAIT)
    assert seen.failover_since == {3: 10.0, 4: 10.0}
    assert seen.failover_due == () and seen.next_due == math.inf  # not this member's to take
    assert seen.verdicts[3] == b"error_moved d:1\n"
    one = view({3: ShardAssignment(A, dead), 4: ShardAssignment(dead, dead)})
    first = decide(one, A, now=11.0, failover_since=seen.failover_since, failover_wait_s=WAIT)
    assert first.failover_since == {3: 10.0, 4: 10.0} and first.next_due == 10.0 + WAIT
    taken = {3: ShardAssignment(A, dead), 4: ShardAssignment(A, dead)}
    both = view(taken)
    due = decide(both, A, now=13.0, failover_since=first.failover_since, failover_wait_s=WAIT)
    assert due.failover_due == (3, 4)
    # Its key back in etcd: it is live, and nothing is counted for it any more.
    back = decide(
        view(taken, {A, B, C, dead}),
        A,
        now=13.0,
        failover_since=due.failover_since,
        failover_wait_s=WAIT,
    )
    assert back.failover_since == {} and back.failover_due == ()
