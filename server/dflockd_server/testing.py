"""Run a real server in a background thread (its own event loop), for tests and demos."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from dflockd_server.config import Config
from dflockd_server.health import WILDCARD_LOOPBACK
from dflockd_server.loops import default_loop_factory, run_on
from dflockd_server.net import Server
from dflockd_server.ownership import Ownership

T = TypeVar("T")

_START_TIMEOUT_S = 10.0
_STOP_TIMEOUT_S = 60.0


class ServerThread:
    """A ``Server`` on its own event loop in a daemon thread
    (``with ServerThread(Config(host="127.0.0.1", port=0)) as s: s.address``)."""

    def __init__(
        self,
        config: Config | None = None,
        *,
        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
        ownership: Ownership | None = None,
    ) -> None:
        """``loop_factory``: the loop to run on (default: what ``dflockd`` runs). ``ownership``:
        serve by it instead of what the config makes."""
        self.config = config or Config(host="127.0.0.1", port=0)
        self._loop_factory = loop_factory or default_loop_factory()
        self.server = Server(self.config, ownership=ownership)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stop_lock = threading.Lock()
        self._stopped = False
        self.port = 0
        self.host = self.config.host
        """Where a client on this machine reaches it (both set once it has started)."""

    @property
    def address(self) -> tuple[str, int]:
        return (self.host, self.port)

    @property
    def metrics_url(self) -> str | None:
        """``http://host:port/metrics`` when the config sets ``metrics_port``, else ``None``."""
        if (address := self.server.metrics_address) is None:
            return None
        host = WILDCARD_LOOPBACK.get(address[0], address[0])
        return f"http://{f'[{host}]' if ':' in host else host}:{address[1]}/metrics"

    def start(self) -> ServerThread:
        """Start serving (idempotent); raises what the server raised if it cannot start."""
        if self._thread is not None:
            return self
        self._thread = threading.Thread(target=self._run, name="dflockd-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(_START_TIMEOUT_S):
            # Cancelled, a start closes what it opened (a started server stops): the thread ends.
            if (loop := self._loop) is not None:
                with contextlib.suppress(RuntimeError):  # (a loop closed since: it has ended)
                    loop.call_soon_threadsafe(self._main_task.cancel)
                self._thread.join(_STOP_TIMEOUT_S)
            raise RuntimeError("dflockd server thread did not start in time")
        if self._error is not None:
            raise self._error
        return self

    def _run(self) -> None:
        loop = self._loop_factory()
        self._main_task = loop.create_task(self._main())
        self._loop = loop
        try:
            loop.run_until_complete(self._main_task)
        except BaseException as exc:
            if not self._ready.is_set():
                self._error = exc
                self._ready.set()
            else:
                raise
        finally:
            loop.close()

    async def _main(self) -> None:
        await self.server.start()
        host, self.port = self.server.sockname
        self.host = WILDCARD_LOOPBACK.get(self.config.host, host)
        self._ready.set()
        try:
            await self.server.serve_forever()
        finally:
            await self.server.stop(0.0)  # (at once when stopped already)

    def stop(self, *, drain: bool = False) -> None:
        """Stop and wait for the thread to end (idempotent): by default every connection closed
        at once, as a killed server goes; ``drain=True`` as SIGTERM does."""
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        future = asyncio.run_coroutine_threadsafe(self.server.stop(None if drain else 0.0), loop)
        with contextlib.suppress(concurrent.futures.CancelledError):
            future.result(_STOP_TIMEOUT_S)
        thread.join(_STOP_TIMEOUT_S)

    def call(self, fn: Callable[[], T], timeout: float = 10.0) -> T:
        """Run ``fn()`` on the server's loop thread and return its result."""
        if (loop := self._loop) is None:
            raise RuntimeError("server not started")
        return run_on(loop, fn, timeout)

    def stats(self) -> dict[str, Any]:
        return self.call(self.server.stats)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
