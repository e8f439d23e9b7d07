"""The lock table's two indexes, so that no periodic job scans the table: the lease expiry index and
the idle log. Both keep stale entries, dropped when met or by an amortised compaction."""

from __future__ import annotations

from array import array
from collections.abc import Iterator

from dflockd_server.keys import Entry, Holder, KeyState

__all__ = ["COMPACT_MIN", "IdleLog", "LeaseIndex", "LeaseRun"]

COMPACT_MIN = 64  # stale entries an index (or a key's queue) may keep beyond twice its current ones


class LeaseRun:
    """The leases of one length, in grant or renewal order: expiry times and holders, two
    arrays in step (a tuple per entry costs four times as much). Times are an ``array('d')``,
    a C double each. The sweep moves ``head`` on; taken entries are cut off once an eighth of
    the lists. Lists, not deques: compiled, a deque's calls go by name."""

    __slots__ = ("head", "holders", "times")

    def __init__(self) -> None:
        self.times = array("d")
        self.holders: list[Holder] = []
        self.head = 0


class LeaseIndex:
    """For each lease length, its ``LeaseRun``, in expiry order (the clock never goes back; a
    grant restored for longer than its lease goes in a longer run: ``LockTable.restore_all``).
    An entry is current while its holder is live and still expires at that time. ``Grants``
    inlines ``add`` and the dropping of released entries at the back: the hot path."""

    __slots__ = ("by_ttl", "cap", "count")

    def __init__(self) -> None:
        self.by_ttl: dict[int, LeaseRun] = {}
        self.count = 0  # entries, stale ones included
        self.cap = COMPACT_MIN

    def add(self, holder: Holder, expires_at: float, lease_ttl: int) -> None:
        """Add the holder's new expiry; compact when stale entries outnumber the rest."""
        run = self.by_ttl.get(lease_ttl)
        if run is None:
            run = self.by_ttl[lease_ttl] = LeaseRun()
        run.times.append(expires_at)
        run.holders.append(holder)
        self.count += 1
        if self.count > self.cap:
            self.compact()

    def compact(self) -> None:
        kept = 0
        for lease_ttl, run in list(self.by_ttl.items()):
            times, holders = run.times, run.holders
            kept_times = array("d")
            kept_holders: list[Holder] = []
            for i in range(run.head, len(times)):
                holder, expires_at = holders[i], times[i]
                if holder.live and holder.expires_at == expires_at:
                    kept_times.append(expires_at)
                    kept_holders.append(holder)
            if kept_times:
                run.times, run.holders, run.head = kept_times, kept_holders, 0
                kept += len(kept_times)
            else:
                del self.by_ttl[lease_ttl]
        self.count = kept
        self.cap = 2 * kept + COMPACT_MIN

    def due(self, now: float) -> Iterator[Holder]:
        """Take the entries due at ``now`` and yield their holders (stale ones too)."""
        by_ttl = self.by_ttl
        for lease_ttl in list(by_ttl):
            while True:
                # Fetched anew at each step: the grants an expiry makes may compact the index.
                if (run := by_ttl.get(lease_ttl)) is None:
                    break
                times, head = run.times, run.head
                if head >= len(times):
                    del by_ttl[lease_ttl]
                    break
                if times[head] > now:
                    break
                holder = run.holders[head]
                head += 1
                if head > COMPACT_MIN and 8 * head > len(times):
                    del times[:head]
                    del run.holders[:head]
                    head = 0
                run.head = head
                self.count -= 1
                yield holder


class IdleLog:
    """Keys that became idle, oldest first, each with its entry in the key map and the time it
    went idle. An entry is current while it is still the key's entry, idle, and unused since.
    Two lists in step and a taken head, as ``LeaseRun``."""

    __slots__ = ("entries", "head", "stamps")

    def __init__(self) -> None:
        self.entries: list[Entry] = []
        self.stamps: list[float] = []
        self.head = 0

    @staticmethod
    def current(keys: dict[str, Entry], entry: Entry, stamp: float) -> bool:
        if isinstance(entry, Holder):  # a released lock nobody waits for
            return not entry.live and entry.expires_at == stamp and keys.get(entry.key) is entry
        return entry.last_used == stamp and entry.idle and keys.get(entry.key) is entry

    def note(self, keys: dict[str, Entry], state: KeyState) -> None:
        if not state.n_waiting and not state.n_held:
            self.log(keys, state, state.last_used)

    def log(self, keys: dict[str, Entry], entry: Entry, stamp: float) -> None:
        entries, stamps = self.entries, self.stamps
        entries.append(entry)
        stamps.append(stamp)
        if len(entries) - self.head > 2 * len(keys) + COMPACT_MIN:  # mostly stale
            kept_entries: list[Entry] = []
            kept_stamps: list[float] = []
            current = self.current
            for i in range(self.head, len(entries)):
                if current(keys, entries[i], stamps[i]):
                    kept_entries.append(entries[i])
                    kept_stamps.append(stamps[i])
            self.entries, self.stamps, self.head = kept_entries, kept_stamps, 0

    def _take(self, head: int) -> None:
        if head > COMPACT_MIN and 8 * head > len(self.entries):
            del self.entries[:head]
            del self.stamps[:head]
            head = 0
        self.head = head

    def evict_oldest(self, keys: dict[str, Entry]) -> bool:
        """Forget the longest-idle key; False if no key is idle."""
        entries, stamps, head = self.entries, self.stamps, self.head
        while head < len(entries):
            entry, stamp = entries[head], stamps[head]
            head += 1
            if self.current(keys, entry, stamp):
                del keys[entry.key]
                self._take(head)
                return True
        self._take(head)
        return False

    def prune(self, keys: dict[str, Entry], now: float, max_idle_s: float) -> int:
        """Forget keys idle for at least ``max_idle_s``; returns how many."""
        entries, stamps, head = self.entries, self.stamps, self.head
        pruned = 0
        while head < len(entries):
            entry, stamp = entries[head], stamps[head]
            if not self.current(keys, entry, stamp):
                head += 1
            elif now - stamp >= max_idle_s:
                head += 1
                del keys[entry.key]
                pruned += 1
            else:
                break  # the rest became idle later
        self._take(head)
        return pruned
