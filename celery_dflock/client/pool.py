"""Pools of idle connections to lock servers, one pool object per owner and process.

A lock borrows a connection when it acquires, pins it while held (the server releases a
connection's locks when it closes), and gives it back after releasing. The pool keeps idle
connections per server (``host``, ``port``, auth token and TLS context), checks each before
reuse, and drops ones idle for longer than the server would keep them. It asks each server
``hello`` once, to learn what it supports: the liveness check uses ``ping`` only where the
server knows it, and locks report ``fence`` only where the server issues fencing tokens.

Pools are fork safe: a pool records the pid that created it; used in another process (a forked
child) it forgets the inherited connections, closing only its own copies of their sockets (never
``shutdown``, which would cut the parent's connection), and opens new ones.

A blocking pool also carries the `Renewer` that renews the leases of the locks using it, so
a process renews all of them from one long-lived thread instead of a thread per grant. An
asyncio pool belongs to the event loop it is first used in; create one per loop.

Nothing here is global: whoever wants pooling creates a pool and passes it as ``pool=`` to
the locks (the Celery integration keeps one per app and process). Without a pool, each lock
opens its own connection and closes it on release.
"""

from celery_dflock.client._async.pool import AsyncConnectionPool
from celery_dflock.client._pooling import DEFAULT_MAX_IDLE_PER_SERVER, DEFAULT_MAX_IDLE_TIME_S
from celery_dflock.client._sync.pool import ConnectionPool
from celery_dflock.client._sync_backend import RENEWAL_LINGER_S

__all__ = [
    "DEFAULT_MAX_IDLE_PER_SERVER",
    "DEFAULT_MAX_IDLE_TIME_S",
    "RENEWAL_LINGER_S",
    "AsyncConnectionPool",
    "ConnectionPool",
]
