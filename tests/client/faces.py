"""The two faces of the client for one test body: the blocking one (`DistributedLock`,
`DistributedSemaphore`, `ConnectionPool`) and the asyncio one (`AsyncDistributedLock`, ...).

A test of tests/client/test_client_faces.py is written once, as a coroutine, against a
:class:`Face`: ``await face.run(lock.acquire())`` calls the blocking method or awaits the
coroutine, ``async with face.held(lock)`` enters either kind of context manager, and so on.
The blocking face's calls block the test's event loop while they run, which nothing on that
face needs (its renewals run in threads of their own).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import pytest

from celery_dflock import (
    AsyncConnectionPool,
    AsyncDistributedLock,
    AsyncDistributedSemaphore,
    ConnectionPool,
    DflockError,
    DistributedLock,
    DistributedSemaphore,
)
from dflockd_server.testing import ServerThread
from tests.support.wire import holders_and_waiters

T = TypeVar("T")

Lock = Any
"""A lock or semaphore of either face (their methods return values or coroutines)."""


@dataclass(frozen=True)
class Face:
    """One face of the client, and how a coroutine test drives it."""

    name: str
    lock_class: type[Any]
    semaphore_class: type[Any]
    pool_class: type[Any]

    @property
    def is_async(self) -> bool:
        return self.name == "async"

    async def run(self, value: T | Awaitable[T]) -> T:
        """The blocking face's result as it is; the asyncio face's coroutine, awaited."""
        if inspect.isawaitable(value):
            return await value
        return value

    @contextlib.asynccontextmanager
    async def held(self, manager: Any) -> AsyncIterator[Any]:
        """``with manager`` or ``async with manager``, by face."""
        if self.is_async:
            async with manager as entered:
                yield entered
        else:
            with manager as entered:
                yield entered

    async def wait_lost(self, lock: Lock, timeout: float) -> bool:
        """Whether ``lock.lost_event`` is set within ``timeout`` seconds."""
        if not self.is_async:
            return bool(lock.lost_event.wait(timeout))
        try:
            await asyncio.wait_for(lock.lost_event.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def spawn(self, call: Callable[[], Any]) -> Callable[[float], Awaitable[None]]:
        """Start ``call()`` beside the test (a thread, or a task for a coroutine); returns an
        ``await join(timeout)`` that waits for it to end and raises what it raised."""
        if self.is_async:
            task = asyncio.ensure_future(call())

            async def join_task(timeout: float) -> None:
                await asyncio.wait_for(task, timeout)

            return join_task
        failed: list[BaseException] = []

        def target() -> None:
            try:
                call()
            except BaseException as exc:
                failed.append(exc)

        thread = threading.Thread(target=target)
        thread.start()

        async def join_thread(timeout: float) -> None:
            await asyncio.to_thread(thread.join, timeout)
            assert not thread.is_alive(), "the thread did not end"
            if failed:
                raise failed[0]

        return join_thread


BLOCKING = Face("sync", DistributedLock, DistributedSemaphore, ConnectionPool)
ASYNCIO = Face("async", AsyncDistributedLock, AsyncDistributedSemaphore, AsyncConnectionPool)
FACES = (BLOCKING, ASYNCIO)


@dataclass(frozen=True)
class Maker:
    """Builds a lock of ``face`` on ``server`` (unless ``servers=`` is given), or a semaphore
    of limit 1 (the same behaviour) when ``semaphore``."""

    face: Face
    server: ServerThread
    semaphore: bool

    def __call__(self, key: str, *args: Any, **kwargs: Any) -> Lock:
        kwargs.setdefault("servers", [self.server.address])
        if self.semaphore:
            return self.face.semaphore_class(key, kwargs.pop("limit", 1), *args, **kwargs)
        return self.face.lock_class(key, *args, **kwargs)

    def holders(self, key: str) -> tuple[int, int]:
        """Holders and waiters of ``key`` on the server, as the server counts them."""
        return holders_and_waiters(self.server.address, key, self.semaphore)


async def until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
    """Poll server state (which cannot be awaited) without blocking the event loop."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        await asyncio.sleep(0.01)


async def assert_lost_reported(
    face: Face, lock: Lock, calls: list[Lock], caplog: pytest.LogCaptureFixture, token: str
) -> None:
    interval = lock.lease * 0.5
    assert await face.wait_lost(lock, interval + 5.0), "lost not reported in a renewal interval"
    assert lock.lost and not lock.owned()
    with pytest.raises(DflockError, match="was lost; call release"):
        await face.run(lock.acquire())
    assert await face.run(lock.release()) is False  # nothing more can happen after it
    assert calls == [lock]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING and "lost" in r.message]
    assert len(warnings) == 1
    assert repr(lock.key) in warnings[0].getMessage()
    assert token not in caplog.text
