"""What the asyncio client does its own way. The lock shells, written once
(`celery_dflock.client._async.lock` and its generated blocking twin), import these names from
here or from `celery_dflock.client._sync_backend`, which has them with the same meaning:
`OpLock`, `Event` (``lost_event``), `call_back` (runs ``on_lost``), `background` (a release
the server was not there for), `gather`, `pause`, `AsyncRenewalDriver` (renews a held lock,
notices a closed connection), `AsyncPoolFace` and `PoolRenewer` (what a pool adds).

Here each held lock is renewed by an asyncio task of its own, dozing until the renewal is due.
The connection's protocol hears the peer's close and wakes that task, which reattaches the
lock at once. The renewal's request is shielded: cancelling the task (or a `renew` call) lets
it finish, and a `release` that follows waits for it."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Protocol, TypeAlias, TypeVar

from celery_dflock.client._async.connection import AsyncConnection
from celery_dflock.client._background import background_task as background
from celery_dflock.client._core import LockCore
from celery_dflock.client._settings import JOIN_TIMEOUT_S
from celery_dflock.client.errors import DflockError

__all__ = [
    "AsyncPoolFace", "AsyncRenewalDriver", "Background", "Event", "OpLock", "PoolRenewer",
    "background", "call_back", "check_callback", "gather", "pause",
]  # fmt: skip

OpLock = asyncio.Lock
Event = asyncio.Event
pause = asyncio.sleep
Background = asyncio.Task[None]  # what `background` started, kept by its lock object against GC


T = TypeVar("T")


async def gather(calls: Iterable[Awaitable[T]]) -> list[T]:
    return list(await asyncio.gather(*calls))


async def call_back(callback: Callable[[], object]) -> None:
    """``callback()``, awaited when it returns an awaitable (a coroutine function's)."""
    result = callback()
    if inspect.isawaitable(result):
        await result


def check_callback(callback: object) -> None:
    """``on_lost``: any callable (`call_back` awaits what it returns when awaitable)."""
    del callback


class Renewable(Protocol):
    """What a driver needs of the lock's holding."""

    core: LockCore

    @property
    def conn(self) -> AsyncConnection | None: ...
    async def renew_guarded(self, scheduled: bool) -> bool | None: ...


class AsyncRenewalDriver:
    """Renews one lock object's grants from a task of its own."""

    def __init__(self, lock: Renewable, pool: object) -> None:
        del pool  # every asyncio lock renews from its own task
        self._lock = lock
        self._task: asyncio.Task[None] | None = None
        self._renewing: asyncio.Task[bool | None] | None = None  # the shielded request
        self._wake: asyncio.Future[None] | None = None  # the renewal task's doze, cut short
        self._stopping = False
        self._poked = False  # `poke`: renew now, whatever the connection

    @property
    def cancelled(self) -> bool:
        """True once `stop` began: a scheduled renewal that starts now does nothing."""
        return self._stopping

    def start(self, conn: AsyncConnection, interval: float, first_in: float, name: str) -> None:
        """Renew every ``interval`` s (`LockCore.next_look_in`), the first time in ``first_in``
        s (operation lock held)."""
        del interval  # asked of the core after each look
        self._stopping = False
        conn.transport.watch(self._connection_event)
        self._task = asyncio.create_task(self._loop(first_in), name=name)

    def attach(self, conn: AsyncConnection) -> None:
        """The lock reattached on ``conn`` (operation lock held): watch it from now on."""
        conn.transport.watch(self._connection_event)

    def unwatch(self, conn: AsyncConnection | None) -> None:
        if conn is not None:
            conn.transport.watch(None)

    def renewed(self, conn: AsyncConnection) -> None:
        """After a renewal: a close heard mid-request woke the task to no effect; wake it again."""
        if conn.broken_while_idle():
            self._connection_event()

    def poke(self) -> None:
        """Renew now (the lock's client session is over)."""
        self._poked = True
        self._connection_event()

    def forget(self) -> None:
        """In a fork child: the parent's task is not this process's."""
        self._task = self._renewing = None

    def check(self) -> None:
        """Refuse a call from another event loop than the renewal task's: it would wait for that
        task forever (or meet that loop closed). A release calls it before anything else, so a
        refusal abandons nothing (a blocking lock has no such check: any thread may use it)."""
        task = self._task
        if task is not None and (loop := task.get_loop()) is not asyncio.get_running_loop():
            where = (
                "an event loop that has closed since (its grant ends with its lease, or its "
                "client's session)"
                if loop.is_closed()
                else "another event loop, whose task renews it: release or renew it on that loop"
            )
            raise DflockError(
                f"{self._lock.core.what} was acquired on {where}; an asyncio lock belongs to "
                "the event loop that acquired it"
            )

    async def stop(self) -> None:
        """Stop renewing; wait for a renewal in flight (and the on_lost it may run)."""
        self.check()
        self._stopping = True
        task, self._task = self._task, None
        current = asyncio.current_task()
        if task is not None and task is not current:
            task.cancel()
            await asyncio.wait([task])
        renewing = self._renewing
        if renewing is not None and renewing is not current and not renewing.done():
            # Bounded: an on_lost that waits for this release must not hang both.
            await asyncio.wait([renewing], timeout=JOIN_TIMEOUT_S)

    async def renew_now(self) -> bool | None:
        """`renew`: one renewal now, shielded from the caller's cancellation."""
        self.check()
        return await self._shielded(self._lock.renew_guarded(False))

    async def _shielded(self, work: Coroutine[object, object, bool | None]) -> bool | None:
        """Run ``work`` in a shielded task (a later `release` waits for it)."""
        task = self._renewing = asyncio.create_task(work)
        return await asyncio.shield(task)

    def _connection_event(self) -> None:
        """The held connection heard from the peer (bytes, EOF, or lost): wake the task."""
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def _doze(self, until: float) -> None:
        """Sleep until the loop time ``until``, or less if the held connection breaks."""
        conn = self._lock.conn
        if conn is not None and conn.broken_while_idle():
            return  # it broke during the last request or before this task ran
        wake: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._wake = wake
        try:
            async with asyncio.timeout_at(until):
                await wake
        except TimeoutError:
            pass
        finally:
            self._wake = None

    async def _loop(self, first_in: float) -> None:
        loop = asyncio.get_running_loop()
        due = loop.time() + first_in
        while True:
            await self._doze(due)
            conn = self._lock.conn
            poked, self._poked = self._poked, False
            fine = conn is not None and not conn.broken_while_idle()
            if loop.time() < due and fine and not poked:
                continue  # woken, but the connection is fine: renew when due
            if await self._shielded(self._lock.renew_guarded(True)) is not True:
                return
            due = loop.time() + self._lock.core.next_look_in()


PoolRenewer: TypeAlias = None  # each asyncio lock renews from its own task


class AsyncPoolFace:
    """What an asyncio pool adds: it belongs to the event loop it is first used in."""

    renewer: PoolRenewer = None

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None

    def forked(self) -> None:
        """In a fork child: the parent's loop is not this process's."""
        self._loop = None

    def check(self, *, bind: bool = True) -> None:
        """Before each use: on the pool's event loop (the first use binds it, unless not
        ``bind``: a close)."""
        loop = asyncio.get_running_loop()
        if self._loop is None:
            if bind:
                self._loop = loop
        elif self._loop is not loop:
            raise DflockError(
                "this AsyncConnectionPool (an AsyncClient's, or one given as pool=) belongs to "
                "the event loop it was first used in, another than this one; create one pool "
                "per event loop: make the AsyncClient (or pool) inside the coroutine that "
                "asyncio.run runs"
            )
