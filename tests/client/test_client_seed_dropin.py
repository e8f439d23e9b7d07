"""Code written for the dflockd clients runs unchanged on ours (issue 13, point 14)."""

from __future__ import annotations

import asyncio

import pytest

from celery_dflock import (
    AsyncDistributedLock,
    DistributedLock,
    DistributedSemaphore,
    LockNotAcquired,
)
from dflockd_server.testing import ServerThread


def test_a_timed_out_with_block_is_a_timeout_error(dflock_server: ServerThread) -> None:
    servers = [dflock_server.address]
    with DistributedLock("seed:timeout", servers=servers):
        caught: list[BaseException] = []
        try:  # as dflockd's README writes it
            with DistributedLock("seed:timeout", acquire_timeout_s=0, servers=servers):
                pytest.fail("the key is held: the second lock must not be granted")
        except TimeoutError as exc:
            caught.append(exc)
    assert len(caught) == 1
    assert isinstance(caught[0], LockNotAcquired)
    assert "seed:timeout" in str(caught[0])


def test_a_timed_out_async_with_block_is_a_timeout_error(dflock_server: ServerThread) -> None:
    servers = [dflock_server.address]

    async def main() -> None:
        async with AsyncDistributedLock("seed:atimeout", servers=servers):
            with pytest.raises(TimeoutError):
                async with AsyncDistributedLock(
                    "seed:atimeout", acquire_timeout_s=0, servers=servers
                ):
                    pytest.fail("the key is held: the second lock must not be granted")

    asyncio.run(main())


def test_enqueue_answers_acquired_or_queued(dflock_server: ServerThread) -> None:
    servers = [dflock_server.address]
    first = DistributedLock("seed:2p", servers=servers)
    second = DistributedLock("seed:2p", servers=servers)
    try:
        got = first.enqueue()
        assert got == "acquired" and isinstance(got, str) and bool(got) is True
        queued = second.enqueue()
        assert queued == "queued" and isinstance(queued, str) and bool(queued) is False
        first.release()
        assert second.wait(5) is True
    finally:
        first.release()
        second.release()
    sem = DistributedSemaphore("seed:2p-sem", 2, servers=servers)
    try:
        assert sem.enqueue() == "acquired"
    finally:
        sem.release()


def test_async_enqueue_answers_acquired_or_queued(dflock_server: ServerThread) -> None:
    servers = [dflock_server.address]

    async def main() -> None:
        first = AsyncDistributedLock("seed:a2p", servers=servers)
        second = AsyncDistributedLock("seed:a2p", servers=servers)
        try:
            assert await first.enqueue() == "acquired"
            queued = await second.enqueue()
            assert queued == "queued" and not queued
            await first.release()
            assert await second.wait(5) is True
        finally:
            await first.release()
            await second.release()

    asyncio.run(main())
