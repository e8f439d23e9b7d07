# pyright: reportMissingImports=false
"""Run by the peers' interpreter (not collected by pytest): the dflockd 0.5.0 clients and
dflockd-client 2.1.1 against the server at ``argv[1]:argv[2]``; one check per ``argv[3]``.

Each check asserts what a user of that client relies on and prints ``ok <check>``; a failure
exits non-zero with its traceback. Only the standard library and the peers are imported here.
"""

from __future__ import annotations

import asyncio
import sys
import time


def dflockd_sync(servers: list[tuple[str, int]]) -> None:
    from dflockd.sync_client import DistributedLock

    with DistributedLock("peer:sync", servers=servers) as lock:
        assert lock.token is not None and lock.lease > 0
        try:
            with DistributedLock("peer:sync", acquire_timeout_s=0, servers=servers):
                raise AssertionError("granted a held key")
        except TimeoutError:
            pass
    # two-phase
    first = DistributedLock("peer:2p", servers=servers)
    second = DistributedLock("peer:2p", servers=servers)
    assert first.enqueue() == "acquired"
    assert second.enqueue() == "queued"
    first.release()
    assert second.wait(5) is True
    second.release()
    # renewed past its lease (2 s) while another client is refused
    holder = DistributedLock("peer:renew", lease_ttl_s=2, servers=servers)
    assert holder.acquire()
    time.sleep(3)
    assert not DistributedLock("peer:renew", acquire_timeout_s=0, servers=servers).acquire()
    holder.release()
    assert DistributedLock("peer:renew", acquire_timeout_s=0, servers=servers).acquire()


def dflockd_async(servers: list[tuple[str, int]]) -> None:
    from dflockd.client import DistributedLock

    async def main() -> None:
        async with DistributedLock("peer:async", servers=servers) as lock:
            assert lock.token is not None
            other = DistributedLock("peer:async", acquire_timeout_s=0, servers=servers)
            assert not await other.acquire()
        first = DistributedLock("peer:a2p", servers=servers)
        second = DistributedLock("peer:a2p", servers=servers)
        assert await first.enqueue() == "acquired"
        assert await second.enqueue() == "queued"
        await first.release()
        assert await second.wait(5) is True
        await second.release()

    asyncio.run(main())


def dflockd_client_sync(servers: list[tuple[str, int]]) -> None:
    from dflockd_client import (
        SyncDistributedLock,
        SyncDistributedSemaphore,
        fence_from_token,
    )
    from dflockd_client._sync import open_conn, stats

    fences: list[int] = []
    for _ in range(2):
        with SyncDistributedLock("peer:dc", servers=servers) as lock:
            assert lock.token is not None
            fences.append(fence_from_token(lock.token))
    assert fences[0] < fences[1], fences  # our tokens are fencing tokens
    a = SyncDistributedSemaphore("peer:dc-sem", limit=2, servers=servers)
    b = SyncDistributedSemaphore("peer:dc-sem", limit=2, servers=servers)
    c = SyncDistributedSemaphore("peer:dc-sem", limit=2, acquire_timeout_s=0, servers=servers)
    assert a.acquire() and b.acquire()
    assert not c.acquire()
    host, port = servers[0]
    conn = open_conn(host, port, ssl_context=None, connect_timeout_s=5)
    try:
        seen = stats(conn)
    finally:
        conn.close()
    (sem,) = [s for s in seen["semaphores"] if s["key"] == "peer:dc-sem"]
    assert sem["holders"] == 2 and sem["limit"] == 2, sem
    a.release()
    b.release()
    first = SyncDistributedLock("peer:dc-2p", servers=servers)
    second = SyncDistributedLock("peer:dc-2p", servers=servers)
    assert first.enqueue() == "acquired" and second.enqueue() == "queued"
    first.release()
    assert second.wait(5) is True
    second.release()


def dflockd_client_async(servers: list[tuple[str, int]]) -> None:
    from dflockd_client import AsyncDistributedLock, AsyncDistributedSemaphore

    async def main() -> None:
        async with AsyncDistributedLock("peer:dca", servers=servers) as lock:
            assert lock.token is not None
            other = AsyncDistributedLock("peer:dca", acquire_timeout_s=0, servers=servers)
            assert not await other.acquire()
        sem = AsyncDistributedSemaphore("peer:dca-sem", limit=1, servers=servers)
        assert await sem.acquire()
        await sem.release()

    asyncio.run(main())


CHECKS = {
    "dflockd-sync": dflockd_sync,
    "dflockd-async": dflockd_async,
    "dflockd-client-sync": dflockd_client_sync,
    "dflockd-client-async": dflockd_client_async,
}

if __name__ == "__main__":
    address = [(sys.argv[1], int(sys.argv[2]))]
    for name in sys.argv[3:]:
        CHECKS[name](address)
        print("ok", name, flush=True)
