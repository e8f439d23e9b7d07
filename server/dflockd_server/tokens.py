"""Issuing fencing tokens: a strictly increasing 64-bit counter, then a random suffix.

The counter starts at the wall clock in nanoseconds (so it keeps increasing across restarts
even without a state file: no server hands out a billion grants per second) and, when a ceiling
store is configured (``fence``: a file, or in cluster mode an etcd key), never below the
ceiling persisted there. The store records a ceiling ``FENCE_PERSIST_BLOCK`` grants ahead of
the counter; it is rewritten only when the counter reaches it, not on every grant, and always
before any counter at or above the old ceiling is issued (a failed write issues nothing). In a
cluster the ceiling is also what the next owner of a shard reads to raise its own counter above
everything this member issued (``raise_to``).

``next_token`` runs on the server's loop, once per grant (the hot path: this module is compiled
with the request path, see server/hatch_build.py); ``raise_to`` may come from a cluster
member's thread, so both hold the counter's lock.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Final

from dflockd_server import constants as c
from dflockd_server.fence import CeilingStore, FileCeilingStore

__all__ = ["FenceCounter"]

_SUFFIX_HEX = 16
"""The random suffix: 8 bytes, in hex."""
_BYTE_HEX: Final = tuple(f"{i:02x}" for i in range(256))
"""Each byte's two hex digits."""
_CHUNK_BYTES = 4096
"""Random bytes drawn at once (one ``os.urandom`` per 512 tokens)."""
_SMALL_BOUND = (1 << 62) - 1
"""``next_token`` compares each counter with one bound (``_check_at``: the ceiling, or this),
and only at it checks the 64-bit limit and the store. Kept below 2**62 so that, compiled, the
comparison is of two small ints (a counter started at the wall clock in nanoseconds reaches it
in the year 2116; from there on every token takes the full checks)."""


class FenceCounter:
    """Issues tokens: 16 hex digits of counter, then 16 hex digits of randomness."""

    __slots__ = (
        "_block",
        "_ceiling",
        "_check_at",
        "_counter",
        "_high",
        "_high_hex",
        "_lock",
        "_pool",
        "_pool_pos",
        "_random",
        "_store",
    )

    def __init__(
        self,
        state_file: str | None = None,
        *,
        store: CeilingStore | None = None,
        wall_clock_ns: Callable[[], int] = time.time_ns,
        random_bytes: Callable[[int], bytes] = os.urandom,
        persist_block: int = c.FENCE_PERSIST_BLOCK,
    ) -> None:
        """``persist_block``: how far ahead of the counter each stored ceiling is."""
        if state_file is not None and store is not None:
            raise ValueError("a fence counter takes a state file or a ceiling store, not both")
        self._store: CeilingStore | None = (
            FileCeilingStore(state_file) if state_file is not None else store
        )
        self._random = random_bytes
        self._block = persist_block
        self._lock = threading.Lock()
        self._pool = ""
        self._pool_pos = 0
        self._high = -1
        """The counter's bytes but its last (``counter >> 8``) at the token before, and
        their 14 hex digits in ``_high_hex``: they change once every 256 tokens."""
        self._high_hex = ""
        start = wall_clock_ns()
        if self._store is not None:
            start = max(start, self._store.read())
        self._counter = start
        self._ceiling = 0
        self._check_at = _SMALL_BOUND
        if self._store is not None:
            self._persist(start)

    @property
    def last(self) -> int:
        """The most recently issued counter value (or the seed, before any)."""
        return self._counter

    @property
    def ceiling(self) -> int:
        """The ceiling last stored (0 without a store): every counter issued is below it."""
        return self._ceiling

    def _persist(self, counter: int) -> None:
        assert self._store is not None
        ceiling = counter + self._block
        self._store.write(ceiling)
        self._ceiling = ceiling
        self._check_at = min(ceiling, _SMALL_BOUND)

    def _before_issuing(self, counter: int) -> None:
        """``counter`` reached ``_check_at``: refuse it past the counter's 64 bits, or store
        the next ceiling before it is issued (a failed write issues nothing)."""
        if counter > c.FENCE_MAX:
            raise OverflowError("fencing counter exhausted")
        if self._store is not None and counter >= self._ceiling:
            self._persist(counter)

    def publish(self) -> int:
        """Store the current ceiling again (a no-op in effect) and return it.

        A cluster member calls it before handing a shard over: the next owner reads it.
        """
        with self._lock:
            if self._store is not None:
                self._store.write(self._ceiling)
            return self._ceiling

    def raise_to(self, floor: int) -> None:
        """Issue only counters above ``floor`` from now on (e.g. another member's ceiling).

        With a store, the raised ceiling is stored before this returns.
        """
        if floor > c.FENCE_MAX:
            raise OverflowError("fencing counter exhausted")
        with self._lock:
            if floor <= self._counter:
                return
            if self._store is not None and floor >= self._ceiling:
                self._persist(floor)
            self._counter = floor

    def raise_within(self, floor: int) -> bool:
        """``raise_to(floor)`` when that needs no store write (``floor`` below the stored
        ceiling), for the server's loop; whether every counter issued from now on is above
        ``floor`` (False: the caller has ``raise_to`` run where it may wait)."""
        if floor > c.FENCE_MAX:
            return False
        with self._lock:
            if floor <= self._counter:
                return True
            if self._store is not None and floor >= self._ceiling:
                return False
            self._counter = floor
            return True

    def next_token(self) -> str:
        """A new token whose counter is larger than every one issued before."""
        with self._lock:
            counter = self._counter + 1
            if counter >= self._check_at:
                self._before_issuing(counter)
            self._counter = counter
        pos = self._pool_pos
        if pos >= len(self._pool):
            self._pool = self._random(_CHUNK_BYTES).hex()
            pos = 0
        end = pos + _SUFFIX_HEX
        self._pool_pos = end
        # counter <= FENCE_MAX (64 bits): its 8 bytes in hex are the 16 digits ("%016x"),
        # the first 7 kept from the token before while they stay the same (compiled, a
        # to_bytes and a hex per token were calls by name, about 1,000 instructions)
        high = counter >> 8
        if high != self._high:
            self._high = high
            self._high_hex = high.to_bytes(7, "big").hex()
        return f"{self._high_hex}{_BYTE_HEX[counter & 255]}{self._pool[pos:end]}"
