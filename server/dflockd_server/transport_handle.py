"""What an ``asyncio.Server`` of CPython 3.13 holds for a ``transport.SocketTransport``.

From 3.13 a server keeps its connections' transports in a ``weakref.WeakSet`` (for
``close_clients`` and ``abort_clients``). A class compiled by mypyc cannot be referred to
weakly, so the compiled transport hands the server this handle instead, holds it for as long
as it is attached, and the handle passes ``close`` and ``abort`` on. It stays Python so that
it can be referred to weakly.
"""

from __future__ import annotations

import asyncio

__all__ = ["ServerHandle"]


class ServerHandle:
    """A transport, as its server sees it (see the module's doc)."""

    __slots__ = ("__weakref__", "transport")

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def close(self) -> None:
        self.transport.close()

    def abort(self) -> None:
        self.transport.abort()
