"""A TCP proxy on loopback that a test can make misbehave: stall, drop, reset, add latency.

``FaultProxy(upstream).start()`` listens on 127.0.0.1 (ephemeral port) and forwards every
connection to ``upstream``, on its own event loop in a daemon thread. Controls (thread safe;
each returns once it has taken effect):

* ``stall(seconds)``: forward nothing, in either direction, for ``seconds`` (bytes and
  end-of-stream wait in the proxy; new connections are accepted but not yet connected
  upstream), then carry on as if nothing happened. ``resume()`` ends a stall early.
* ``drop()``: close both sides of every open connection (a FIN each way).
* ``reset()``: abort both sides of every open connection with a RST (``SO_LINGER`` 0).
* ``set_latency(seconds)``: delay each chunk by ``seconds`` in each direction.
* ``hold_reply_after(marker)``: a one-shot trap for one request. The next chunk a client sends
  that contains ``marker`` (a command name, say) is forwarded, and from then on nothing comes
  back to that client (its reply is held) until ``release_replies()`` or the client hangs up.
  The event it returns is set once such a request has gone upstream: the client now waits for
  a reply that does not come.
* ``drop_after_reply(marker)``: a one-shot trap for one request. The next request a client sends
  whose chunk contains ``marker`` is forwarded, and so is its reply; then that connection is
  closed on both sides (a FIN each way), as a server that closed it at once after answering. The
  event it returns is set once it is closed.
* ``hold_replies_of(marker)``: from now on, nothing more comes back on the connections open now
  whose request began with bytes containing ``marker`` (a long-lived stream's, say: an etcd
  watch); their requests still go upstream, and they stay open, silent. Other connections, and
  later ones, are not touched. ``release_replies()`` lets the held replies through.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import socket
import struct
import threading
from collections.abc import Callable, Coroutine
from types import TracebackType
from typing import Any, TypeVar

T = TypeVar("T")

CHUNK_BYTES = 65536
START_TIMEOUT_S = 10.0
CONTROL_TIMEOUT_S = 10.0
CONNECT_TIMEOUT_S = 5.0
HEAD_BYTES = 256
"""How much of what a client sends first a connection keeps (``hold_replies_of``)."""
_LINGER_RST = struct.pack("ii", 1, 0)


class _Pair:
    """One proxied connection: the client's side and the upstream side."""

    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.client = client
        self.upstream: asyncio.StreamWriter | None = None
        self.tasks: list[asyncio.Task[None]] = []
        self.replies = asyncio.Event()
        """Cleared while this connection's replies are held (``hold_reply_after``)."""
        self.replies.set()
        self.sent_tail = b""
        """The last bytes the client sent (a marker may straddle two chunks)."""
        self.head = b""
        """The first bytes the client sent (its request line, for ``hold_replies_of``)."""
        self.drop_after: threading.Event | None = None
        """Set by ``drop_after_reply``: the next reply is the last (then this event is set)."""

    def writers(self) -> list[asyncio.StreamWriter]:
        return [w for w in (self.client, self.upstream) if w is not None]


class FaultProxy:
    """A misbehaving TCP proxy in front of ``upstream`` (see the module docstring)."""

    def __init__(self, upstream: tuple[str, int]) -> None:
        self.upstream = upstream
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._server: asyncio.Server | None = None
        self._pairs: set[_Pair] = set()
        self._flowing: asyncio.Event | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        self._latency_s = 0.0
        self._hold_marker: bytes | None = None
        self._held = threading.Event()
        self._drop_marker: bytes | None = None
        self._dropped = threading.Event()
        self._port = 0
        self.accepted = 0

    # ------------------------------------------------------------------ lifecycle
    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", self._port)

    def start(self) -> FaultProxy:
        self._thread = threading.Thread(target=self._run, name="fault-proxy", daemon=True)
        self._thread.start()
        if not self._ready.wait(START_TIMEOUT_S):
            raise RuntimeError("the fault proxy did not start")
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._listen())
            self._ready.set()
            loop.run_forever()
        finally:
            # A connection accepted while its upstream connect was under way (stop() cuts the
            # pairs' pumps, not their accepts): cancelled and finished here, or its socket and
            # task were left to a later test's garbage collection ("Task was destroyed but it
            # is pending", an unclosed socket: an error in that test's teardown).
            pending = asyncio.all_tasks(loop)
            for task in pending:
                task.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            # A transport aborted in the loop's last turn (an upstream connect that finished
            # as the proxy stopped) closes its socket in the next one: run it.
            loop.run_until_complete(asyncio.sleep(0))
            loop.close()

    async def _listen(self) -> None:
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server = await asyncio.start_server(self._accepted, "127.0.0.1", 0)
        self._port = int(self._server.sockets[0].getsockname()[1])

    def stop(self) -> None:
        """Close the listener and every connection (RST), and end the thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
            self._call(self._shutdown())
        loop.call_soon_threadsafe(loop.stop)
        thread.join(CONTROL_TIMEOUT_S)

    async def _shutdown(self) -> None:
        if self._server is not None:
            self._server.close()
        self._cut(rst=True)
        if self._flowing is not None:
            self._flowing.set()
        await asyncio.sleep(0)

    def __enter__(self) -> FaultProxy:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # ------------------------------------------------------------------ controls
    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        loop = self._loop
        if loop is None:
            coro.close()
            raise RuntimeError("proxy not started")
        return asyncio.run_coroutine_threadsafe(coro, loop).result(CONTROL_TIMEOUT_S)

    def _run_in_loop(self, fn: Callable[[], T]) -> T:
        async def runner() -> T:
            return fn()

        return self._call(runner())

    @property
    def connections(self) -> int:
        """Connections open right now."""
        return self._run_in_loop(lambda: len(self._pairs))

    def stall(self, seconds: float) -> None:
        """Stop forwarding for ``seconds`` (a later call replaces the running stall)."""

        def begin() -> None:
            assert self._flowing is not None and self._loop is not None
            if self._stall_timer is not None:
                self._stall_timer.cancel()
            self._flowing.clear()
            self._stall_timer = self._loop.call_later(seconds, self._end_stall)

        self._run_in_loop(begin)

    def _end_stall(self) -> None:
        self._stall_timer = None
        if self._flowing is not None:
            self._flowing.set()

    def resume(self) -> None:
        """End a stall now."""

        def end() -> None:
            if self._stall_timer is not None:
                self._stall_timer.cancel()
            self._end_stall()

        self._run_in_loop(end)

    def flowing(self) -> bool:
        """False while stalled."""
        return self._run_in_loop(lambda: self._flowing is None or self._flowing.is_set())

    def drop(self) -> int:
        """Close every open connection on both sides; how many there were."""
        return self._run_in_loop(lambda: self._cut(rst=False))

    def reset(self) -> int:
        """Reset every open connection on both sides; how many there were."""
        return self._run_in_loop(lambda: self._cut(rst=True))

    def set_latency(self, seconds: float) -> None:
        def apply() -> None:
            self._latency_s = seconds

        self._run_in_loop(apply)

    def hold_reply_after(self, marker: bytes) -> threading.Event:
        """Hold the replies to the next request containing ``marker`` (see the module docstring)."""
        if not marker:
            raise ValueError("an empty marker would catch any request")

        def arm() -> threading.Event:
            self._held = threading.Event()
            self._hold_marker = marker
            for pair in self._pairs:
                pair.sent_tail = b""  # what came before the trap was set is not looked at
            return self._held

        return self._run_in_loop(arm)

    def drop_after_reply(self, marker: bytes) -> threading.Event:
        """Close the connection after the reply to the next request containing ``marker`` (see
        the module docstring)."""
        if not marker:
            raise ValueError("an empty marker would catch any request")

        def arm() -> threading.Event:
            self._dropped = threading.Event()
            self._drop_marker = marker
            return self._dropped

        return self._run_in_loop(arm)

    def hold_replies_of(self, marker: bytes) -> int:
        """Hold the replies of the open connections whose first bytes contain ``marker`` (see
        the module docstring); how many were caught."""
        if not marker:
            raise ValueError("an empty marker would catch any connection")

        def hold() -> int:
            caught = [pair for pair in self._pairs if marker in pair.head]
            for pair in caught:
                pair.replies.clear()
            return len(caught)

        return self._run_in_loop(hold)

    def release_replies(self) -> None:
        """Let held replies through (and disarm a hold that caught nothing yet)."""

        def release() -> None:
            self._hold_marker = None
            for pair in self._pairs:
                pair.replies.set()

        self._run_in_loop(release)

    # ------------------------------------------------------------------ forwarding
    def _cut(self, *, rst: bool) -> int:
        pairs = list(self._pairs)
        self._pairs.clear()
        for pair in pairs:
            self._cut_pair(pair, rst=rst)
        return len(pairs)

    @staticmethod
    def _cut_pair(pair: _Pair, *, rst: bool) -> None:
        for task in pair.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        for writer in pair.writers():
            if rst:
                sock = writer.get_extra_info("socket")
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
                writer.transport.abort()
            else:
                writer.close()

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        pair = _Pair(writer)
        self._pairs.add(pair)
        try:
            assert self._flowing is not None
            await self._flowing.wait()
            if pair not in self._pairs:  # cut while it stalled (a stop): nothing to connect
                return
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(*self.upstream), CONNECT_TIMEOUT_S
            )
        except (OSError, TimeoutError):
            self._forget(pair)
            writer.transport.abort()
            return
        if pair not in self._pairs:  # cut while connecting
            up_writer.transport.abort()
            return
        pair.upstream = up_writer
        pair.tasks = [
            asyncio.create_task(self._pump(reader, up_writer, pair, upstream=True)),
            asyncio.create_task(self._pump(up_reader, writer, pair, upstream=False)),
        ]

    def _catches(self, pair: _Pair, data: bytes) -> threading.Event | None:
        """The armed hold's event if the client's ``data`` springs it (and disarms it)."""
        marker = self._hold_marker
        if marker is None:
            return None
        seen = pair.sent_tail + data
        pair.sent_tail = seen[-(len(marker) - 1) :] if len(marker) > 1 else b""
        if marker not in seen:
            return None
        self._hold_marker = None
        pair.replies.clear()
        return self._held

    async def _pump(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        pair: _Pair,
        *,
        upstream: bool,
    ) -> None:
        assert self._flowing is not None
        try:
            while True:
                data = await reader.read(CHUNK_BYTES)
                await self._flowing.wait()
                if self._latency_s:
                    await asyncio.sleep(self._latency_s)
                if upstream and len(pair.head) < HEAD_BYTES:
                    pair.head += data[: HEAD_BYTES - len(pair.head)]
                caught = self._catches(pair, data) if upstream else None
                if upstream and self._drop_marker is not None and self._drop_marker in data:
                    self._drop_marker = None
                    pair.drop_after = self._dropped
                if not upstream:
                    await pair.replies.wait()
                if not data:
                    if upstream:
                        pair.replies.set()  # the client hung up: nobody waits for a reply
                    if writer.can_write_eof():
                        writer.write_eof()
                    break
                writer.write(data)
                await writer.drain()
                if caught is not None:
                    caught.set()
                if not upstream and (dropped := pair.drop_after) is not None:
                    self._forget(pair)
                    self._cut_pair(pair, rst=False)
                    dropped.set()
                    return
        except (OSError, asyncio.IncompleteReadError):
            self._forget(pair)
            for w in pair.writers():
                w.transport.abort()
            return
        # One direction is finished; once both are, the pair is gone.
        if all(t.done() or t is asyncio.current_task() for t in pair.tasks):
            self._forget(pair)
            for w in pair.writers():
                w.close()

    def _forget(self, pair: _Pair) -> None:
        self._pairs.discard(pair)
