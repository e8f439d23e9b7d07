"""The shard map (pure): shard ids, the value format, initial map, updates, pins, rebalance."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings, strategies as st

from dflockd_server.cluster.shardmap import (
    PINNED,
    SHARD_COUNT,
    Move,
    ShardAssignment,
    ShardMap,
    fnv1a_32,
    shard_id,
)

# -- shard ids ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        # The FNV-1a 32-bit reference vectors (Fowler/Noll/Vo test suite, Go's hash/fnv tests).
        (b"", 0x811C9DC5),
        (b"a", 0xE40C292C),
        (b"ab", 0x4D2505CA),
        (b"abc", 0x1A47E90B),
        (b"foobar", 0xBF9CF968),
    ],
)
def test_fnv1a_32_known_vectors(data: bytes, expected: int) -> None:
    assert fnv1a_32(data) == expected


def test_shard_id_is_fnv1a_of_utf8_modulo_8192() -> None:
    assert SHARD_COUNT == 8192
    assert shard_id("") == 0x811C9DC5 % 8192
    assert shard_id("foobar") == 0xBF9CF968 % 8192
    # Non-ASCII keys hash their UTF-8 bytes.
    assert shard_id("clé") == fnv1a_32("clé".encode()) % 8192


@given(st.text())
def test_shard_id_is_in_range(key: str) -> None:
    assert 0 <= shard_id(key) < SHARD_COUNT


def test_shard_ids_spread_over_all_shards() -> None:
    ids = {shard_id(f"task:{i}") for i in range(100_000)}
    assert len(ids) > 0.99 * SHARD_COUNT


# -- the value format ---------------------------------------------------------------------------

A, B = "localhost:47001", "localhost:47002"


@pytest.mark.parametrize(
    ("value", "target", "current", "flags"),
    [
        # Every example of the seed's "Value Format Examples".
        ("localhost:47001", A, "", ()),
        ("localhost:47001,localhost:47002", A, B, ()),
        ("localhost:47001,localhost:47002,f=pinned", A, B, ("pinned",)),
        ("localhost:47001,,f=pinned", A, "", ("pinned",)),
        ("f=pinned,localhost:47001,localhost:47002", A, B, ("pinned",)),
        ("localhost:47001,f=pinned,localhost:47002", A, B, ("pinned",)),
        ("localhost:47001,localhost:47002,f=pinned,f=readonly", A, B, ("pinned", "readonly")),
        # Spaces around parts are not part of names (goverse trims them too).
        (" localhost:47001 , localhost:47002 ", A, B, ()),
        # An empty current node at the end.
        ("localhost:47001,", A, "", ()),
        # Flags only before the target.
        ("f=a,f=b,localhost:47001", A, "", ("a", "b")),
        # Parts after the first two non-flag parts are ignored, as the format says.
        ("localhost:47001,localhost:47002,localhost:47003", A, B, ()),
    ],
)
def test_parse(value: str, target: str, current: str, flags: tuple[str, ...]) -> None:
    assignment = ShardAssignment.parse(value)
    assert assignment == ShardAssignment(target, current, flags)
    assert ShardAssignment.parse(assignment.format()) == assignment


@pytest.mark.parametrize(
    ("assignment", "value"),
    [
        (ShardAssignment(A), "localhost:47001,"),
        (ShardAssignment(A, B), "localhost:47001,localhost:47002"),
        (ShardAssignment(A, "", (PINNED,)), "localhost:47001,,f=pinned"),
        (ShardAssignment(A, B, (PINNED, "readonly")), f"{A},{B},f=pinned,f=readonly"),
    ],
)
def test_format(assignment: ShardAssignment, value: str) -> None:
    assert assignment.format() == value


@pytest.mark.parametrize("value", ["", ",", " ", "f=pinned", ",localhost:47002", "f=x,,b"])
def test_a_value_without_target_is_refused(value: str) -> None:
    with pytest.raises(ValueError, match="no target"):
        ShardAssignment.parse(value)


@pytest.mark.parametrize("node", ["a,b", " a", "f=a"])
def test_names_that_cannot_be_stored_are_refused(node: str) -> None:
    with pytest.raises(ValueError, match="cannot be stored"):
        ShardAssignment(node)
    with pytest.raises(ValueError, match="cannot be stored"):
        ShardAssignment("ok", node)


_names = st.text(
    st.characters(blacklist_characters=",", blacklist_categories=("Cs",)), min_size=1
).filter(lambda s: s == s.strip() and not s.startswith("f="))
_flags = st.lists(
    st.text(st.characters(blacklist_characters=",", blacklist_categories=("Cs",))).filter(
        lambda s: s == s.strip()
    ),
    max_size=3,
)


@given(_names, st.one_of(st.just(""), _names), _flags, st.randoms(use_true_random=False))
def test_format_parse_round_trip_with_flags_anywhere(
    target: str, current: str, flags: list[str], rnd: object
) -> None:
    assignment = ShardAssignment(target, current, tuple(flags))
    assert ShardAssignment.parse(assignment.format()) == assignment
    # Flags moved anywhere parse to the same assignment.
    import random

    assert isinstance(rnd, random.Random)
    parts: list[str] = [target, current]
    low = 0  # flags keep their order among themselves
    for flag in flags:
        low = rnd.randint(low, len(parts))
        parts.insert(low, "f=" + flag)
        low += 1
    assert ShardAssignment.parse(",".join(parts)) == assignment


# -- the initial map ------------------------------------------------------------------------------


def test_initial_map_is_the_seeds_example() -> None:
    m = ShardMap.initial(["node3", "node1", "node2"])
    assert m.counts() == {"node1": 2731, "node2": 2731, "node3": 2730}
    assert sum(m.counts().values()) == SHARD_COUNT
    assert [m[s].target for s in range(7)] == ["node1", "node2", "node3"] * 2 + ["node1"]
    assert all(m[s].target == ["node1", "node2", "node3"][s % 3] for s in range(SHARD_COUNT))
    # Nothing was served before: nothing to hand over.
    assert m.moves_in_progress() == []
    assert len(m) == SHARD_COUNT


def test_initial_map_does_not_depend_on_the_order_given() -> None:
    assert ShardMap.initial(["b", "c", "a"]) == ShardMap.initial(["a", "b", "c"])


@given(st.integers(min_value=1, max_value=50))
def test_initial_map_is_even(n: int) -> None:
    counts = ShardMap.initial([f"n{i:02d}" for i in range(n)]).counts()
    assert len(counts) == n
    assert max(counts.values()) - min(counts.values()) <= 1


def test_stored_values_read_back_to_the_same_map() -> None:
    m = ShardMap.initial(["a", "b"]).pin(5).updated(["a"])
    assert ShardMap({s: ShardAssignment.parse(a.format()) for s, a in m.items()}) == m


# -- updates when members change ----------------------------------------------------------------


NODES = ["node1", "node2", "node3"]


def test_a_removed_nodes_shards_and_only_those_move() -> None:
    before = ShardMap.initial(NODES)
    after = before.updated(["node1", "node3"])
    changed = before.diff(after)
    assert set(changed) == {s for s in range(SHARD_COUNT) if before[s].target == "node2"}
    for new in changed.values():
        assert new is not None
        assert new.target in {"node1", "node3"}
        # The current node stays: whoever takes over knows node2 may still have holders.
        assert new.current == "node2"
    assert after.counts() == {"node1": 4096, "node3": 4096}
    assert set(after.moves_in_progress()) == set(changed)


def test_reassignment_goes_to_the_least_loaded_first() -> None:
    # node1 has 6 shards more than node3 before node2 leaves; node3 catches up first.
    m = ShardMap.initial(NODES)
    for shard in range(2, 20, 3):  # six of node3's shards to node1
        m = m.apply([Move(shard, "node3", "node1")])
    assert m.counts() == {"node1": 2737, "node2": 2731, "node3": 2724}
    after = m.updated(["node1", "node3"])
    assert after.counts() == {"node1": 4096, "node3": 4096}


def test_new_nodes_get_nothing_until_rebalance() -> None:
    before = ShardMap.initial(NODES)
    after = before.updated([*NODES, "node4"])
    assert after == before
    assert "node4" not in after.counts()


def test_an_unchanged_membership_changes_nothing() -> None:
    m = ShardMap.initial(NODES)
    assert m.updated(reversed(NODES)) == m


def test_missing_shards_are_assigned() -> None:
    partial = ShardMap({s: ShardAssignment("a", "a") for s in range(0, SHARD_COUNT, 2)})
    full = partial.updated(["a", "b"])
    assert len(full) == SHARD_COUNT
    assert full.counts() == {"a": 4096, "b": 4096}
    assert all(full[s] == ShardAssignment("b") for s in range(1, SHARD_COUNT, 2))


@given(
    st.sets(st.sampled_from([f"n{i}" for i in range(8)]), min_size=1),
    st.sets(st.sampled_from([f"n{i}" for i in range(8)]), min_size=1),
)
@settings(max_examples=40)
def test_updates_preserve_every_live_assignment(first: set[str], live: set[str]) -> None:
    before = ShardMap.initial(first)
    after = before.updated(live)
    for shard in range(SHARD_COUNT):
        if before[shard].target in live:
            assert after[shard] == before[shard]
        else:
            assert after[shard].target in live
    # The reassigned shards are spread: the nodes that received any differ by at most one.
    received = [n for n in live if n not in first]  # new nodes: only orphans can go there
    if set(first) & live:
        orphans = sum(1 for s in range(SHARD_COUNT) if before[s].target not in live)
        assert sum(after.counts().get(n, 0) for n in received) <= orphans


# -- pinned shards ------------------------------------------------------------------------------


def test_pinned_shards_are_never_moved_automatically() -> None:
    m = ShardMap.initial(NODES).pin(1).pin(4).pin(0, "node3")
    assert m[1] == ShardAssignment("node2", "node2", (PINNED,))
    assert m[0].target == "node3" and m[0].pinned
    after = m.updated(["node1", "node3"])
    # Pinned to a node that is gone: kept (an operator's decision), and reported.
    assert after[1] == m[1]
    assert after[4] == m[4]
    assert after.unavailable_pinned(["node1", "node3"]) == [1, 4]
    plan = after.rebalance_plan(["node1", "node3", "node4"])
    assert {0, 1, 4}.isdisjoint(move.shard for move in plan)
    assert after.unpin(1).updated(["node1", "node3"])[1].target in {"node1", "node3"}


def test_pin_and_unpin_keep_other_flags() -> None:
    m = ShardMap({7: ShardAssignment("a", "a", ("readonly",))})
    assert m.pin(7)[7].flags == ("readonly", PINNED)
    assert m.pin(7).pin(7)[7].flags == ("readonly", PINNED)
    assert m.pin(7).unpin(7)[7].flags == ("readonly",)
    with pytest.raises(ValueError, match="no assignment"):
        m.pin(8)
    with pytest.raises(ValueError, match="outside"):
        m.pin(SHARD_COUNT)


def test_a_pinned_heavy_node_keeps_its_pins_and_the_rest_evens_out() -> None:
    pins = (PINNED,)
    m = ShardMap(
        {s: ShardAssignment("a", "a", pins if s < 5000 and s % 2 == 0 else ()) for s in range(8192)}
    )
    plan = m.rebalance_plan(["a", "b", "c"])
    after = m.apply(plan)
    assert all(after[s].target == "a" for s in range(0, 5000, 2))
    counts = after.counts()
    assert counts["b"] - counts["c"] in (-1, 0, 1)
    assert counts["a"] >= 2500


# -- rebalance ----------------------------------------------------------------------------------


def test_rebalance_gives_a_new_node_its_share_and_moves_nothing_else() -> None:
    m = ShardMap.initial(NODES)
    plan = m.rebalance_plan([*NODES, "node4"])
    assert len(plan) == SHARD_COUNT // 4  # 2048: exactly what node4 needs
    assert all(move.to_node == "node4" for move in plan)
    after = m.apply(plan)
    assert after.counts() == dict.fromkeys(["node1", "node2", "node3", "node4"], 2048)
    # A move changes the target; the current node changes at handover.
    assert after.moves_in_progress() == sorted(move.shard for move in plan)
    assert all(after[move.shard].current == move.from_node for move in plan)
    moved = after[plan[0].shard]
    assert moved.served_by(moved.target).current == "node4"
    done = ShardMap({s: ShardAssignment.parse(f"{a.target},{a.target}") for s, a in after.items()})
    assert done.moves_in_progress() == []


def test_a_balanced_map_needs_no_rebalance() -> None:
    assert ShardMap.initial(NODES).rebalance_plan(NODES) == []


def _minimum_moves(m: ShardMap, live: set[str]) -> int:
    """Orphans plus the excess over the even share (the largest loads get the rounded-up share)."""
    loads = {n: 0 for n in live}
    orphans = 0
    for _, a in m.items():
        if a.target in live:
            loads[a.target] += 1
        else:
            orphans += 1
    orphans += SHARD_COUNT - len(m)
    total = SHARD_COUNT
    base, extra = divmod(total, len(live))
    ordered = sorted(loads.values(), reverse=True)
    quotas = [base + 1] * extra + [base] * (len(live) - extra)
    return orphans + sum(max(0, load - quota) for load, quota in zip(ordered, quotas, strict=True))


@given(
    st.lists(st.sampled_from([f"n{i}" for i in range(7)]), min_size=1, max_size=3),
    st.sets(st.sampled_from([f"n{i}" for i in range(7)]), min_size=1),
    st.lists(st.integers(0, SHARD_COUNT - 1), max_size=300),
)
@settings(max_examples=25)
def test_rebalance_moves_the_minimum_and_evens_out(
    history: list[str], live: set[str], dropped: list[int]
) -> None:
    # A map with history: built on one set, then nodes removed and added one at a time.
    m = ShardMap.initial(history[:1])
    for node in history[1:]:
        m = m.updated([*m.counts(), node])
        m = m.apply(m.rebalance_plan([*m.counts(), node]))
    unassigned = set(dropped)
    m = ShardMap({s: a for s, a in m.items() if s not in unassigned})
    plan = m.rebalance_plan(live)
    assert len({move.shard for move in plan}) == len(plan)
    assert len(plan) == _minimum_moves(m, live)
    after = m.apply(plan)
    counts = after.counts()
    assert set(counts) <= live
    assert len(after) == SHARD_COUNT
    assert max(counts.get(n, 0) for n in live) - min(counts.get(n, 0) for n in live) <= 1
    assert math.isclose(sum(counts.values()), SHARD_COUNT)
    for move in plan:
        assert move.from_node == (m[move.shard].target if move.shard in m else "")
    assert after.rebalance_plan(live) == []
