"""Pools of idle connections to lock servers, one pool object per owner and process.

A lock borrows a connection when it acquires, pins it while held (closing a plain connection frees
its locks), and gives it back after releasing. The pool keeps idle connections per server
(``host``, ``port``, auth token and TLS context), checks each before reuse, drops ones idle for
longer than the server would keep them, and asks each server ``hello`` once. Pools are fork safe:
in a forked child a pool forgets the inherited connections (closing only its copies of their
sockets) and opens new ones.

A blocking pool also carries the `Renewer` that renews the leases of the locks using it from
one long-lived thread. An asyncio pool belongs to the event loop it is first used in. Without
a pool (``pool=``), each lock opens its own connection and closes it on release."""

from celery_dflock.client._async.pool import (
    DEFAULT_MAX_IDLE_PER_SERVER,
    DEFAULT_MAX_IDLE_TIME_S,
    AsyncConnectionPool,
)
from celery_dflock.client._sync.pool import ConnectionPool
from celery_dflock.client._sync_backend import RENEWAL_LINGER_S

__all__ = [
    "DEFAULT_MAX_IDLE_PER_SERVER", "DEFAULT_MAX_IDLE_TIME_S", "RENEWAL_LINGER_S",
    "AsyncConnectionPool", "ConnectionPool",
]  # fmt: skip
