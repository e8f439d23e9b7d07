"""The longest lease this server may have granted, raised off the event loop (what a client
sees: docs/server.md, "A slow disk or a slow etcd").

A restart's grace (``grace``) and the wait of the heir of a member's shards (the bound it
publishes in etcd: ``cluster.fencestore.EtcdLongestStore``) last this bound, so a longer lease
is not acknowledged before the longer bound is recorded: an fsync and maybe etcd round trips,
which ``LeaseBound`` does on a thread.

- A request within the bound (``table.grants.lease_noted``) is served at once: nearly every
  one, as the bound doubles at each raise (``grace.LeaseRecord.note``).
- A longer one (``dispatch.RaiseBound``) parks its connection while the others are served. One
  recording runs at a time, for the longest lease parked; then each covered request is answered
  as if just arrived (``Connection._bound_recorded``), or, if the recording failed,
  ``error_read_only`` where the bound's file could not be written, else ``error_unavailable``
  (etcd did not take a member's bound: the client tries again, as in any outage), or
  ``error_draining`` once the server stops. A parked request is not in its key's queue:
  another request within the bound may be granted first.
- A longer lease reaching the table without a connection calls ``note_now``, which records on
  the loop as a last resort."""

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
"""Told on the loop: ``None`` once the lease it waited for is recorded, else the reply to send."""


class LeaseBound:
    """Raises the recorded longest lease off the loop. ``table`` and the parked requests are
    touched on the loop only; ``record`` by one thread at a time, under ``_lock``."""

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
        self.table: LockTable | None = None  # whose `lease_noted` each recorded bound raises
        self._lock = threading.Lock()
        self._parked: list[tuple[int, Resume]] = []
        self._running = False

    @classmethod
    async def start(
        cls, loop: asyncio.AbstractEventLoop, make_record: Callable[[], LeaseRecord]
    ) -> LeaseBound:
        """Record the start's bound (``make_record`` writes and publishes it) on the thread. A
        member whose publish fails (etcd does not answer) tries again, pausing up to 10 s, and
        serves nothing meanwhile: the bound etcd has covers what its last run granted."""
        executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="dflockd-lease-bound"
        )
        pause = 1.0
        try:
            while True:
                try:
                    record = await loop.run_in_executor(executor, make_record)
                except FenceStateError as exc:
                    log.warning("%s: not serving yet, trying again in %g s", exc, pause)
                    await asyncio.sleep(pause)
                    pause = min(2 * pause, 10.0)
                else:
                    return cls(record, loop, executor)
        except BaseException:
            executor.shutdown(wait=False)
            raise

    def wait_for(self, lease_ttl: int, resume: Resume) -> None:
        """Call ``resume`` once a bound of at least ``lease_ttl`` is recorded, or failed."""
        self._parked.append((lease_ttl, resume))
        if not self._running:
            self._record_next()

    def note_now(self, lease_ttl: int) -> int:
        """The table's ``note_lease``: record a longer bound now, on the loop (a last resort)."""
        log.warning(
            "recording a longer lease bound (%d s) on the event loop: no request waited for it",
            lease_ttl,
        )
        return self._record(lease_ttl)

    def close(self) -> None:
        """Stop taking recordings; one under way finishes."""
        self._executor.shutdown(wait=False)

    def _record_next(self) -> None:
        target = max(lease for lease, _ in self._parked)
        try:
            future = self._loop.run_in_executor(self._executor, self._record, target)
        except RuntimeError:  # closed: the server stops
            parked, self._parked = self._parked, []
            for _, resume in parked:
                self._loop.call_soon(resume, p.REPLY_ERROR_DRAINING)  # not within the caller's pass
            return
        self._running = True
        future.add_done_callback(self._recorded)

    def _record(self, lease_ttl: int) -> int:
        with self._lock:
            return self.record.note(lease_ttl)

    def _recorded(self, future: asyncio.Future[int]) -> None:
        self._running = False
        parked, self._parked = self._parked, []
        if future.cancelled():
            failed = FenceStateError("the lease bound's recording was cancelled")
        else:
            failed = future.exception()
        table = self.table
        if failed is None and table is not None and future.result() > table.grants.lease_noted:
            table.grants.lease_noted = future.result()
        elif failed is not None and not isinstance(failed, FenceStateError):
            log.error("recording the lease bound failed", exc_info=failed)
        longest = self.record.longest
        unwritable = isinstance(failed, StateUnwritable)
        refusal = p.REPLY_ERROR_READ_ONLY if unwritable else p.REPLY_ERROR_UNAVAILABLE
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
