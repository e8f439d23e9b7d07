"""The longest lease this server may have granted, raised off the event loop.

Why the bound exists: a restarted server waits it out before its first grant (``grace``), and a
cluster member publishes it in etcd (``cluster.fencestore.EtcdLongestStore``) so that the heir
of its shards, after it died, waits that long before granting their keys again, rather than
``max_lease_ttl_s``. So a grant, a renewal or a hand-over with a lease longer than the bound
recorded (on disk, then in etcd) must not be acknowledged before the longer bound is recorded:
otherwise a member that dies right after the reply leaves a holder whose lease outlives its
heir's wait.

Recording means an fsync and, in a cluster, an etcd round trip (several when an endpoint is
slow: up to the etcd client's timeout). None of that may happen on the event loop, which
serves every connection of the server. ``LeaseBound`` therefore does it on a thread of its own:

- A request whose lease is within the bound (``table.grants.lease_noted``: what is recorded
  already) is served at once, as before; that is nearly every request, since the bound doubles
  each time it is raised (``grace.LeaseRecord.note``, capped at ``max_lease_ttl_s``), so a run
  raises it a handful of times.
- A request whose lease is longer (``dispatch.RaiseBound``) parks its connection: that
  connection answers nothing more until the bound is recorded (its requests are answered in
  order), every other connection keeps being served. ``wait_for`` queues it; one recording at
  a time runs on the thread, for the longest lease parked; when it is done, the loop raises
  ``table.grants.lease_noted`` and hands each parked request whose lease is now covered back to
  its connection, which answers it as if it had just arrived (``Connection._bound_recorded``: the
  draining state, the ownership and the table are asked then, not before). A recording that
  fails answers its parked requests ``error_read_only`` where the bound's file could not be
  written (a full disk: as while the journal cannot be written) and ``error`` otherwise (as a
  token that cannot be issued), and the bound stays where it was.
- A parked request is not in its key's queue while it waits: another connection's request for
  the same key, with a lease within the bound, may be granted first.
- The table still calls ``note_now`` if a lease longer than the bound reaches it without
  going through a connection (nothing does today: the journal's restored leases are in the
  initial bound). That call records on the loop, synchronously, as a last resort that keeps
  the bound's promise; it logs a warning.

The first recording (the start's bound) runs on the same thread before the server listens.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable

from dflockd_server import protocol as p
from dflockd_server.fence import FenceStateError, StateUnwritable
from dflockd_server.grace import LeaseRecord
from dflockd_server.table import LockTable

__all__ = ["LeaseBound"]

log = logging.getLogger("dflockd_server")

Resume = Callable[[bytes | None], None]
"""Told, on the loop, ``None`` once the lease it waited for is within the recorded bound, else
the reply to answer instead: ``error_read_only`` when the bound's file could not be written (a
full or failing disk: the server grants nothing longer meanwhile, as while its journal cannot
be written), ``error`` when it could not be published or the server stops."""


class LeaseBound:
    """Raises the recorded longest lease off the loop (see the module's doc).

    ``table`` and the parked requests are touched on the loop only; ``record`` by one thread
    at a time (the recording thread, or ``note_now`` on the loop), under ``_lock``."""

    __slots__ = ("_executor", "_lock", "_loop", "_parked", "_running", "record", "table")

    def __init__(
        self,
        record: LeaseRecord,
        loop: asyncio.AbstractEventLoop,
        executor: concurrent.futures.ThreadPoolExecutor,
    ) -> None:
        self.record = record
        self._loop = loop
        self._executor = executor
        self.table: LockTable | None = None
        """Whose ``lease_noted`` each recorded bound raises (set once the table is made)."""
        self._lock = threading.Lock()
        self._parked: list[tuple[int, Resume]] = []
        self._running = False

    @classmethod
    async def start(
        cls, loop: asyncio.AbstractEventLoop, make_record: Callable[[], LeaseRecord]
    ) -> LeaseBound:
        """Record the start's bound (``make_record`` writes and publishes it) on the
        recording thread, the loop free meanwhile."""
        executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="dflockd-lease-bound"
        )
        try:
            record = await loop.run_in_executor(executor, make_record)
        except BaseException:
            executor.shutdown(wait=False)
            raise
        return cls(record, loop, executor)

    @property
    def longest(self) -> int:
        """The bound recorded last (read on the loop after a recording has returned)."""
        return self.record.longest

    @property
    def parked(self) -> int:
        """Requests waiting for a recording."""
        return len(self._parked)

    def wait_for(self, lease_ttl: int, resume: Resume) -> None:
        """Call ``resume`` (on the loop) once a bound of at least ``lease_ttl`` is recorded
        (``True``), or recording it failed (``False``). On the loop."""
        self._parked.append((lease_ttl, resume))
        if not self._running:
            self._record_next()

    def note_now(self, lease_ttl: int) -> int:
        """The table's ``note_lease``: record a longer bound now, on the loop (a last resort:
        see the module's doc)."""
        log.warning(
            "recording a longer lease bound (%d s) on the event loop: no request waited for it",
            lease_ttl,
        )
        with self._lock:
            return self.record.note(lease_ttl)

    def close(self) -> None:
        """Stop taking recordings; one under way finishes on its thread."""
        self._executor.shutdown(wait=False)

    # ------------------------------------------------------------------ internals
    def _record_next(self) -> None:
        target = max(lease for lease, _ in self._parked)
        try:
            future = self._loop.run_in_executor(self._executor, self._record, target)
        except RuntimeError:  # closed: the server stops (its connections are closing)
            parked, self._parked = self._parked, []
            for _, resume in parked:
                self._loop.call_soon(resume, p.REPLY_ERROR)  # not within the caller's pass
            return
        self._running = True
        future.add_done_callback(self._recorded)

    def _record(self, lease_ttl: int) -> int:
        with self._lock:
            return self.record.note(lease_ttl)

    def _recorded(self, future: asyncio.Future[int]) -> None:
        self._running = False
        parked, self._parked = self._parked, []
        failed: BaseException | None = None
        if future.cancelled():
            failed = FenceStateError("the lease bound's recording was cancelled")
        else:
            failed = future.exception()
        table = self.table
        if failed is None and table is not None and future.result() > table.grants.lease_noted:
            table.grants.lease_noted = future.result()
        elif not isinstance(failed, FenceStateError):
            log.error("recording the lease bound failed", exc_info=failed)
        longest = self.record.longest
        refusal = p.REPLY_ERROR_READ_ONLY if isinstance(failed, StateUnwritable) else p.REPLY_ERROR
        waiting: list[tuple[int, Resume]] = []
        for lease, resume in parked:
            if lease <= longest:
                resume(None)
            elif failed is None:
                waiting.append((lease, resume))  # parked during the recording, longer still
            else:
                log.error("cannot record a lease bound of %d s: %s", lease, failed)
                resume(refusal)
        self._parked = waiting + self._parked  # resumes may have parked again
        if self._parked and not self._running:
            self._record_next()
