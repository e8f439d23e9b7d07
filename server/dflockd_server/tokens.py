"""Issuing fencing tokens: a strictly increasing 64-bit counter, then a random suffix.

The counter starts at the wall clock in nanoseconds (it keeps increasing across restarts even
without a state file) and never below the ceiling of its store (``fence``: a file, or in cluster
mode an etcd key). The store holds a ceiling ``FENCE_PERSIST_BLOCK`` grants ahead, rewritten
before a counter at or above the old one is issued (a failed write issues nothing); a shard's
next owner reads it to raise its own counter above everything this member issued (``raise_to``).

``next_token`` runs on the server's loop once per grant, ``raise_to`` maybe on a cluster member's
thread: both hold the counter's lock, which is never held while a ceiling is stored (an fsync,
an etcd round trip). Stores go one at a time under ``_store_lock``: a member thread storing for
a slow etcd never holds up the loop's grants.

With ``store_ahead`` (a server), the next ceiling is stored on the executor's thread once the
counter has used half the block, while grants go on; a counter that reaches the stored ceiling
first issues nothing (``FenceStateError``) rather than wait ([A slow disk or a slow
etcd](../server.md#a-slow-disk-or-a-slow-etcd)). Without it the ceiling is stored when the
counter reaches it, in the caller's thread."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Final

from dflockd_server import constants as c
from dflockd_server.fence import CeilingStore, FenceStateError

log = logging.getLogger("dflockd_server")

__all__ = ["FenceCounter"]

_SUFFIX_HEX = 16  # the random suffix: 8 bytes, in hex
_BYTE_HEX: Final = tuple(f"{i:02x}" for i in range(256))
_CHUNK_BYTES = 4096  # random bytes drawn at once (one `os.urandom` per 512 tokens)
_SMALL_BOUND = (1 << 62) - 1
"""``next_token`` compares each counter with one bound (``_check_at``: the ceiling, or this) and
only there checks the 64-bit limit and the store; under 2**62: compiled, two small ints compare."""


class FenceCounter:
    """Issues tokens: 16 hex digits of counter, then 16 hex digits of randomness."""

    __slots__ = ("_ahead", "_block", "_ceiling", "_check_at", "_counter", "_high", "_high_hex",
                 "_lock", "_pool", "_pool_pos", "_random", "_store", "_store_lock",
                 "_storing")  # fmt: skip

    def __init__(
        self,
        *,
        store: CeilingStore | None = None,
        wall_clock_ns: Callable[[], int] = time.time_ns,
        random_bytes: Callable[[int], bytes] = os.urandom,
        persist_block: int = c.FENCE_PERSIST_BLOCK,
        defer_failed_store: bool = False,
    ) -> None:
        """``persist_block``: how far ahead of the counter each stored ceiling is.
        ``defer_failed_store``: when the first ceiling cannot be stored (a full disk at the
        start), start anyway and issue no token until it is."""
        self._store = store
        self._random = random_bytes
        self._block = persist_block
        self._lock = threading.Lock()
        self._store_lock = threading.Lock()
        """Held while a ceiling is stored (one store at a time), never with ``_lock`` held."""
        self._ahead: Executor | None = None
        self._storing = False
        self._pool = ""
        self._pool_pos = 0
        self._high = -1  # `counter >> 8` at the token before, and its 14 hex digits in `_high_hex`
        self._high_hex = ""
        self._counter = wall_clock_ns()
        self._ceiling = 0
        self._check_at = _SMALL_BOUND
        if self._store is not None:
            self._counter = max(self._counter, self._store.read())
            try:
                self._persist(self._counter)
            except FenceStateError:
                if not defer_failed_store:
                    raise
                self._check_at = 0  # every token checks the store until one write succeeds

    @property
    def last(self) -> int:
        """The most recently issued counter value (or the seed, before any)."""
        return self._counter

    @property
    def ceiling(self) -> int:
        """The ceiling last stored (0 without a store): every counter issued is below it."""
        return self._ceiling

    def _persist(self, counter: int) -> None:
        """Store ``counter`` plus a block as the ceiling, unless a higher one is stored."""
        assert self._store is not None
        ceiling = counter + self._block
        with self._store_lock:
            if ceiling > self._ceiling:
                self._store.write(ceiling)
                self._stored(ceiling)

    def _stored(self, ceiling: int) -> None:
        """``ceiling`` is stored: raise ``_ceiling``, then ``_check_at`` (in that order:
        ``_check_at`` read with or without ``_lock`` is at most the stored ceiling)."""
        self._ceiling = max(self._ceiling, ceiling)
        half = self._block // 2 if self._ahead is not None else 0
        self._check_at = min(self._ceiling - half, _SMALL_BOUND)

    def store_ahead(self, executor: Executor) -> None:
        """From now on, store each next ceiling on ``executor``'s thread, ahead of the counter."""
        with self._lock:
            self._ahead = executor
            if self._store is not None:
                self._stored(self._ceiling)

    def _before_issuing(self, counter: int) -> None:
        """``counter`` reached ``_check_at``: refuse it past 64 bits, or store the next ceiling
        (with ``store_ahead``: have it stored, refusing only a counter at the stored ceiling)."""
        if counter > c.FENCE_MAX:
            raise OverflowError("fencing counter exhausted")
        store, ahead = self._store, self._ahead
        if store is None:
            return
        if ahead is None:
            if counter >= self._ceiling:
                self._persist(counter)
            return
        if not self._storing:
            self._storing = True
            self._check_at = min(self._ceiling, _SMALL_BOUND)  # no second store meanwhile
            try:
                ahead.submit(self._store_next, counter)
            except RuntimeError:  # the server stops: its executor is shut down
                self._storing = False
        if counter >= self._ceiling:
            raise FenceStateError(
                "the next fence ceiling is not stored yet (etcd or the disk is slow): "
                "nothing granted until it is"
            )

    def _store_next(self, counter: int) -> None:
        """On the ``store_ahead`` thread: store the ceiling a block above ``counter``."""
        try:
            self._persist(counter)
        except Exception as exc:  # logged: the grants at the ceiling are refused meanwhile
            log.error("cannot store the next fence ceiling: %s", exc)
            with self._lock:
                self._check_at = min(self._counter + 1, _SMALL_BOUND)  # tried again at once
        finally:
            self._storing = False

    def publish(self) -> int:
        """Store the current ceiling again and return it (before a shard is handed over)."""
        with self._store_lock:
            ceiling = self._ceiling
            if self._store is not None:
                self._store.write(ceiling)
            return ceiling

    def raise_to(self, floor: int) -> None:
        """Issue only counters above ``floor`` from now on; with a store, the raised ceiling is
        stored before this returns."""
        if floor > c.FENCE_MAX:
            raise OverflowError("fencing counter exhausted")
        if floor <= self._counter:
            return
        if self._store_due(floor):
            self._persist(floor)
        with self._lock:
            self._counter = max(self._counter, floor)

    def _store_due(self, floor: int) -> bool:
        """Whether counters from ``floor`` on want a new ceiling stored first: at or past the
        stored one, or, with ``store_ahead``, in the last half-block under it."""
        if self._store is None:
            return False
        half = self._block // 2 if self._ahead is not None else 0
        return floor >= self._ceiling - half

    def raise_within(self, floor: int) -> bool:
        """``raise_to(floor)`` when that needs no store write, for the server's loop; whether
        every counter issued from now on is above ``floor``."""
        if floor > c.FENCE_MAX:
            return False
        with self._lock:
            if floor <= self._counter:
                return True
            if self._store_due(floor):
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
        # the counter's 8 bytes in hex ("%016x"), the first 7 kept while they stay the same
        high = counter >> 8
        if high != self._high:
            self._high = high
            self._high_hex = high.to_bytes(7, "big").hex()
        return f"{self._high_hex}{_BYTE_HEX[counter & 255]}{self._pool[pos:end]}"
