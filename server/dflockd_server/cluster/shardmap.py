"""The fixed-shard map of a lock cluster: pure data and decisions, no I/O; maps are immutable
(every change returns a new ``ShardMap``).

Every lock key belongs to one of ``SHARD_COUNT`` shards (``shard_id``), and every shard has an
assignment: the node that should serve it (*target*), the node that serves it now (*current*,
empty while nobody does) and flags. How the map changes: docs/deployment.md, *A cluster*.

- ``ShardMap.updated`` retargets only the shards whose target is not live (or that have none)
  and keeps their current node, so whoever takes over a dead member's shard knows to wait until
  its grants can no longer be held. A new node gets nothing until a rebalance.
- Pinned shards (flag ``pinned``, an operator's decision) never move automatically, even when
  their target is gone: they stay unavailable until it returns or they are unpinned.
- A shard *released* (flag ``released``, current empty) was let go by a member leaving
  gracefully, with no holder on it, after publishing its fence ceiling: its target may serve it
  at once. An empty current *without* the flag means "unknown": its target waits as after a
  failover.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, replace

SHARD_COUNT = 8192  # the fixed number of shards (goverse's NumShards)
FLAG_PREFIX = "f="  # a part of a shard value that starts with this is a flag, wherever it stands
PINNED = "pinned"
RELEASED = "released"

SPLIT = "split="
"""The flag ``split=<node>`` of a shard whose keys are split between its current node and
``<node>`` (docs/protocol.md, *Key-level moves*). Only the current node writes it, and only
the handover to ``<node>`` drops it."""

_FNV32_OFFSET = 0x811C9DC5
_FNV32_PRIME = 0x01000193
_U32 = 0xFFFFFFFF


def fnv1a_32(data: bytes) -> int:
    """FNV-1a, 32 bits (as Go's ``hash/fnv`` ``New32a``)."""
    h = _FNV32_OFFSET
    for byte in data:
        h = ((h ^ byte) * _FNV32_PRIME) & _U32
    return h


def shard_id(key: str) -> int:
    """The shard of ``key``: FNV-1a 32-bit of its UTF-8 bytes, modulo ``SHARD_COUNT``."""
    return fnv1a_32(key.encode("utf-8")) % SHARD_COUNT


def _check_node(node: str, what: str) -> None:
    if "," in node or node != node.strip() or node.startswith(FLAG_PREFIX):
        raise ValueError(
            f"{what} {node!r} cannot be stored in a shard value "
            f"(no commas, no surrounding spaces, no leading {FLAG_PREFIX!r})"
        )


@dataclass(frozen=True, slots=True)
class ShardAssignment:
    """One shard's entry: where it should be, where it is, and its flags."""

    target: str
    current: str = ""
    flags: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.target:
            raise ValueError("a shard assignment needs a target node")
        _check_node(self.target, "target node")
        if self.current:
            _check_node(self.current, "current node")
        for flag in self.flags:
            if "," in flag or flag != flag.strip():
                raise ValueError(f"flag {flag!r} cannot be stored in a shard value")

    @classmethod
    def parse(cls, value: str) -> ShardAssignment:
        """Read ``"<target>[,<current>][,f=<flag>...]"``: parts stripped, flags anywhere,
        further non-flag parts ignored; a value without a target is an error."""
        parts = [part.strip() for part in value.split(",")]
        flags = tuple(p[len(FLAG_PREFIX) :] for p in parts if p.startswith(FLAG_PREFIX))
        nodes = [p for p in parts if not p.startswith(FLAG_PREFIX)] + ["", ""]
        if not nodes[0]:
            raise ValueError(f"shard value {value!r} names no target node")
        return cls(nodes[0], nodes[1], flags)

    def format(self) -> str:
        """``"<target>,<current>[,f=<flag>...]"`` (the current part is present even if empty)."""
        return ",".join([self.target, self.current, *(FLAG_PREFIX + f for f in self.flags)])

    @property
    def pinned(self) -> bool:
        return PINNED in self.flags

    @property
    def moving(self) -> bool:
        return self.target != self.current

    @property
    def released(self) -> bool:
        """Nobody serves it and nothing granted on it can still be held."""
        return not self.current and RELEASED in self.flags

    def release(self) -> ShardAssignment:
        flags = tuple(f for f in self.flags if f != RELEASED)
        return replace(self, current="", flags=(*flags, RELEASED))

    @property
    def split(self) -> str:
        """The split's node ("" when not split; see ``SPLIT``)."""
        return next((f[len(SPLIT) :] for f in self.flags if f.startswith(SPLIT)), "")

    def split_to(self, node: str) -> ShardAssignment:
        _check_node(node, "split node")
        flags = tuple(f for f in self.flags if not f.startswith(SPLIT))
        return replace(self, flags=(*flags, SPLIT + node))

    def unsplit(self) -> ShardAssignment:
        return replace(self, flags=tuple(f for f in self.flags if not f.startswith(SPLIT)))

    def served_by(self, node: str) -> ShardAssignment:
        """``node`` as the current node, no longer released; a split stays unless ``node``
        is the split's node (only it can hold every key of the shard)."""
        kept = self.unsplit() if self.split == node else self
        return replace(kept, current=node, flags=tuple(f for f in kept.flags if f != RELEASED))


@dataclass(frozen=True, slots=True)
class Move:
    """A change of a shard's target (its current node changes later, at handover)."""

    shard: int
    from_node: str  # the target before the move ("" for a shard that had no assignment)
    to_node: str


def _check_shard(shard: int) -> None:
    if not 0 <= shard < SHARD_COUNT:
        raise ValueError(f"shard {shard} is outside 0..{SHARD_COUNT - 1}")


def _live_set(nodes: Iterable[str]) -> frozenset[str]:
    live = frozenset(nodes)
    if not live:
        raise ValueError("a shard map needs at least one live node")
    for node in live:
        if not node:
            raise ValueError("a node name cannot be empty")
        _check_node(node, "node")
    return live


class ShardMap:
    """Shard -> assignment, for the shards that have one (a map read back may be partial)."""

    __slots__ = ("_shards", "_sorted")

    def __init__(self, assignments: Mapping[int, ShardAssignment] | None = None) -> None:
        shards = dict(assignments or {})
        for shard in shards:
            _check_shard(shard)
        self._shards: dict[int, ShardAssignment] = shards
        self._sorted: tuple[tuple[int, ShardAssignment], ...] | None = None
        """`items()`, sorted once (a member reads the same map at each step)."""

    @classmethod
    def initial(cls, nodes: Iterable[str]) -> ShardMap:
        """Round robin over the nodes in lexicographic order; current = target."""
        ordered = sorted(_live_set(nodes))
        n = len(ordered)
        return cls({s: ShardAssignment(ordered[s % n], ordered[s % n]) for s in range(SHARD_COUNT)})

    def __len__(self) -> int:
        return len(self._shards)

    def __iter__(self) -> Iterator[int]:  # (else ``for`` would index 0, 1, ... by __getitem__)
        return iter(sorted(self._shards))

    def __contains__(self, shard: object) -> bool:
        return shard in self._shards

    def __getitem__(self, shard: int) -> ShardAssignment:
        return self._shards[shard]

    def __eq__(self, other: object) -> bool:
        return self._shards == other._shards if isinstance(other, ShardMap) else NotImplemented

    def __hash__(self) -> int:
        return hash(frozenset(self._shards.items()))

    def __repr__(self) -> str:
        return f"ShardMap({len(self._shards)} shards, {self.counts()})"

    def items(self) -> tuple[tuple[int, ShardAssignment], ...]:
        """(shard, assignment) in shard order."""
        if self._sorted is None:
            self._sorted = tuple(sorted(self._shards.items()))
        return self._sorted

    def counts(self) -> dict[str, int]:
        """Shards per target node."""
        return dict(sorted(Counter(a.target for a in self._shards.values()).items()))

    def moves_in_progress(self) -> list[int]:
        """Shards whose current node is not (yet) their target."""
        return sorted(s for s, a in self._shards.items() if a.moving)

    def pinned_shards(self) -> list[int]:
        return sorted(s for s, a in self._shards.items() if a.pinned)

    def unavailable_pinned(self, live_nodes: Iterable[str]) -> list[int]:
        """Pinned shards whose target is not live (they stay unavailable: never moved)."""
        live = frozenset(live_nodes)
        return sorted(s for s, a in self._shards.items() if a.pinned and a.target not in live)

    def diff(self, other: ShardMap) -> dict[int, ShardAssignment | None]:
        """What to write to turn ``self`` into ``other`` (``None``: delete the shard's entry)."""
        old, new = self._shards, other._shards
        return {s: new.get(s) for s in sorted(old.keys() | new.keys()) if old.get(s) != new.get(s)}

    def pin(self, shard: int, node: str | None = None) -> ShardMap:
        """Pin a shard (to ``node`` as its target when given, else where it is targeted)."""
        old = self._require(shard)
        flags = old.flags if old.pinned else (*old.flags, PINNED)
        new = replace(old, target=node or old.target, flags=flags)
        return ShardMap({**self._shards, shard: new})

    def unpin(self, shard: int) -> ShardMap:
        old = self._require(shard)
        flags = tuple(f for f in old.flags if f != PINNED)
        return ShardMap({**self._shards, shard: replace(old, flags=flags)})

    def apply(self, moves: Iterable[Move]) -> ShardMap:
        """Retarget shards (current nodes stay until each handover completes)."""
        shards = dict(self._shards)
        for move in moves:
            _check_shard(move.shard)
            old = shards.get(move.shard)
            shards[move.shard] = (
                ShardAssignment(move.to_node) if old is None else replace(old, target=move.to_node)
            )
        return ShardMap(shards)

    def updated(self, live_nodes: Iterable[str]) -> ShardMap:
        """Reassign the shards whose target is gone (or that have none), in shard order, each
        to the live node with the fewest shards at that moment (ties: the smallest name)."""
        live = _live_set(live_nodes)
        return self.apply(self._orphan_moves(live, self._loads(live)))

    def rebalance_plan(self, live_nodes: Iterable[str]) -> list[Move]:
        """The fewest moves that leave the live nodes at most one shard apart: the orphans (as
        ``updated``), then, while the most loaded node with an unpinned shard holds at least two
        more than the least loaded, its highest unpinned shard moves there. Pinned shards count
        but never move."""
        live = _live_set(live_nodes)
        loads = self._loads(live)
        moves = self._orphan_moves(live, loads)
        moved = {m.shard for m in moves}
        movable: dict[str, list[int]] = {node: [] for node in live}
        for shard, a in self.items():
            if a.target in live and not a.pinned and shard not in moved:
                movable[a.target].append(shard)
        for m in moves:
            movable[m.to_node].append(m.shard)
        # Each move takes one shard from above the even share to below it, so none is wasted.
        for _ in range(SHARD_COUNT):
            donors = [n for n in live if movable[n]]
            if not donors:
                break
            donor = max(donors, key=lambda n: (loads[n], n))
            receiver = min(live, key=lambda n: (loads[n], n))
            if loads[donor] - loads[receiver] <= 1:
                break
            # Its highest own shard: a node that received shards is never a donor afterwards
            # (it was the least loaded), so the end of its list is what it had, in shard order.
            shard = movable[donor].pop()
            movable[receiver].append(shard)
            loads[donor] -= 1
            loads[receiver] += 1
            moves.append(Move(shard, self._shards[shard].target, receiver))
        # A shard moved twice in the plan (an orphan, then onward) is one move.
        final: dict[int, Move] = {}
        for m in moves:
            first = final.get(m.shard)
            final[m.shard] = m if first is None else Move(m.shard, first.from_node, m.to_node)
        return [final[s] for s in sorted(final) if final[s].from_node != final[s].to_node]

    def _require(self, shard: int) -> ShardAssignment:
        _check_shard(shard)
        try:
            return self._shards[shard]
        except KeyError:
            raise ValueError(f"shard {shard} has no assignment") from None

    def _loads(self, live: frozenset[str]) -> dict[str, int]:
        targets = Counter(a.target for a in self._shards.values())
        return {node: targets[node] for node in live}

    def _orphan_moves(self, live: frozenset[str], loads: dict[str, int]) -> list[Move]:
        """Moves for the orphaned shards; updates ``loads`` as it goes."""
        heap = [(load, node) for node, load in loads.items()]
        heapq.heapify(heap)
        moves: list[Move] = []
        for shard in range(SHARD_COUNT):
            a = self._shards.get(shard)
            if a is not None and (a.target in live or a.pinned):
                continue
            load, node = heapq.heappop(heap)
            moves.append(Move(shard, "" if a is None else a.target, node))
            loads[node] = load + 1
            heapq.heappush(heap, (load + 1, node))
        return moves
