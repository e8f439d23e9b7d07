"""The server's asyncio loop (``loops.TurnLoop``): the journal's group write (``--journal-fsync
always``) at the end of the turn that held the replies back, not in a turn of its own; the
other fsync modes write the journal before the replies, with no turn end at all; and a server
on any other asyncio loop (a program's own) still writes its journal before each reply."""

from __future__ import annotations

import asyncio
import selectors
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dflockd_server import Config
from dflockd_server.cli import _loop_factory  # pyright: ignore[reportPrivateUsage]
from dflockd_server.constants import JOURNAL_DIRECT_WRITES, JOURNAL_LONE_TURNS
from dflockd_server.loops import TurnLoop, at_turn_end
from dflockd_server.testing import ServerThread
from dflockd_server.turn import Turn
from tests.support.wire import Wire

PAIRS = 200


class CountingTurnLoop(TurnLoop):
    """A ``TurnLoop`` that counts its waits for I/O, and those that found nothing to do: a
    zero-timeout wait that returned no event (a turn run only for a callback the turn before
    scheduled). It counts at the epoll object the turn waits on (Linux's selector)."""

    def __init__(self) -> None:
        super().__init__()
        self.empty_turns = 0
        self.turns = 0
        selector: Any = self._selector  # pyright: ignore[reportAttributeAccessIssue]
        assert type(selector) is selectors.EpollSelector
        inside: Any = selector  # the epoll object the turn waits on, as the selector keeps it
        epoll: Any = inside._selector
        loop = self

        class CountingEpoll:
            def poll(self, timeout: float = -1, maxevents: int = -1) -> list[tuple[int, int]]:
                events = epoll.poll(timeout, maxevents)
                loop.turns += 1
                if timeout == 0 and not events:
                    loop.empty_turns += 1
                return events

            def __getattr__(self, name: str) -> Any:
                return getattr(epoll, name)

        inside._selector = CountingEpoll()
        self.counted_turn_end = CountingList()
        self.turn_end = self.counted_turn_end
        self._turn = Turn(self, self.turn_end)


class CountingList(list[Callable[[], object]]):
    """A turn's end callbacks, counting those added (``at_turn_end`` hands out ``append``)."""

    def __init__(self) -> None:
        super().__init__()
        self.added = 0

    def append(self, callback: Callable[[], object], /) -> None:
        self.added += 1
        super().append(callback)


def _journal_config(tmp_path: Path, fsync: str = "always") -> Config:
    """A journal whose replies wait for the group write (``always``), unless ``fsync`` says."""
    return Config(host="127.0.0.1", port=0, state_dir=str(tmp_path / "state"), journal_fsync=fsync)


def _state_text(tmp_path: Path) -> str:
    """What the server's state directory holds, its journal included, as text."""
    state = tmp_path / "state"
    return "".join(p.read_text(errors="replace") for p in state.rglob("*") if p.is_file())


def test_the_journal_is_written_in_the_turn_that_held_the_replies(tmp_path: Path) -> None:
    """One connection, round trips: each request is a turn; its reply waits for the journal's
    write. On asyncio's plain loop that write ran a turn later, after an ``epoll_wait`` that
    found nothing (one empty turn per request); on the server's loop it runs in the turn."""
    loop_holder: list[CountingTurnLoop] = []

    def factory() -> asyncio.AbstractEventLoop:
        loop = CountingTurnLoop()
        loop_holder.append(loop)
        return loop

    with (
        ServerThread(_journal_config(tmp_path), loop_factory=factory) as srv,
        Wire(srv.address) as wire,
    ):
        assert wire.req("ping") == "ok"
        loop = loop_holder[0]
        empty_before, turns_before = loop.empty_turns, loop.turns
        token = ""
        for i in range(PAIRS):
            token = wire.lock(f"k{i % 10}")
            assert wire.req("r", f"k{i % 10}", token) == "ok"
        empty = loop.empty_turns - empty_before
        turns = loop.turns - turns_before
    assert turns >= 2 * PAIRS  # every request woke the loop
    # A few empty turns may come from timers; one per request would be the old behaviour.
    assert empty < PAIRS // 10, f"{empty} empty turns for {2 * PAIRS} requests"
    assert f" {token} " in _state_text(tmp_path)


def test_a_lone_connection_writes_the_journal_itself(tmp_path: Path) -> None:
    """At the default fsync (``everysec``), one connection alone in its turns: after
    ``JOURNAL_LONE_TURNS`` group writes of its replies alone, it writes the journal itself before
    its replies, and no turn ends with a callback any more (at one connection, a callback per
    request cost more than the write it waited for); every record is in the file when its reply
    arrives, either way."""
    loop_holder: list[CountingTurnLoop] = []

    def factory() -> asyncio.AbstractEventLoop:
        loop = CountingTurnLoop()
        loop_holder.append(loop)
        return loop

    with (
        ServerThread(_journal_config(tmp_path, "everysec"), loop_factory=factory) as srv,
        Wire(srv.address) as wire,
    ):
        for i in range(PAIRS):
            token = wire.lock(f"k{i % 10}")
            assert f"G {token} " in _state_text(tmp_path)
            assert wire.req("r", f"k{i % 10}", token) == "ok"
        added = loop_holder[0].counted_turn_end.added
        direct = srv.call(lambda: srv.server.group_write.direct)
    assert direct
    assert added == JOURNAL_LONE_TURNS, f"{added} turn-end callbacks for {2 * PAIRS} requests"


@pytest.mark.parametrize("fsync", ["everysec", "always"])
def test_connections_sharing_a_turn_share_the_group_write(tmp_path: Path, fsync: str) -> None:
    """A connection that wrote the journal itself ``JOURNAL_DIRECT_WRITES`` times hands back to the
    group write, which looks whether it is still alone: two connections with requests in one turn
    (the loop held up while both send) are written once for both, and writing directly waits for
    ``JOURNAL_LONE_TURNS`` lone turns in a row again. With ``always`` no connection ever writes
    directly (one fsync per turn for all)."""
    with (
        ServerThread(_journal_config(tmp_path, fsync)) as srv,
        Wire(srv.address) as a,
        Wire(srv.address) as b,
    ):
        group_write = srv.server.group_write
        lone = (JOURNAL_LONE_TURNS + JOURNAL_DIRECT_WRITES) // 2  # a pair: two writes
        for i in range(lone):
            assert a.req("r", "a", a.lock("a")) == "ok", i
        assert srv.call(lambda: (group_write.direct, group_write.lone)) == (False, 0)
        for _ in range(3):
            assert a.req("r", "a", a.lock("a")) == "ok"
        lone_before = srv.call(lambda: (group_write.direct, group_write.lone))
        assert lone_before == (False, 0 if fsync == "always" else 6)

        stalled = threading.Event()

        def stall() -> None:
            stalled.set()
            time.sleep(0.3)

        held_up = threading.Thread(target=srv.call, args=(stall,))
        held_up.start()
        assert stalled.wait(5.0)  # the loop is held up: both requests wait for one turn
        a.send("l", "a2", "0")
        b.send("l", "b2", "0")
        held_up.join()
        token_a, token_b = a.recv().split()[1], b.recv().split()[1]
        shared = srv.call(lambda: (group_write.direct, group_write.lone))
        text = _state_text(tmp_path)
        assert f"G {token_a} " in text and f"G {token_b} " in text
    assert shared == (False, 0)  # the two replies were one group write: not alone any more


@pytest.mark.parametrize("fsync", ["everysec", "always"])
def test_a_server_on_a_plain_asyncio_loop_still_writes_its_journal_first(
    tmp_path: Path, fsync: str
) -> None:
    """A server started on a program's own asyncio loop schedules its group write
    (``always``) with ``call_soon``: every grant is in the journal before its reply, and
    nothing waits; at ``everysec`` each connection writes it."""
    with (
        ServerThread(_journal_config(tmp_path, fsync), loop_factory=asyncio.new_event_loop) as srv,
        Wire(srv.address) as wire,
    ):
        tokens = [wire.lock(f"k{i}") for i in range(20)]
        text = _state_text(tmp_path)
        for token in tokens:
            assert f"G {token} " in text
        for i, token in enumerate(tokens):
            assert wire.req("r", f"k{i}", token) == "ok"


def test_the_cli_runs_asyncio_on_the_turn_loop() -> None:
    assert _loop_factory("asyncio") is TurnLoop


def test_at_turn_end_runs_after_the_turns_callbacks_before_the_next_wait() -> None:
    loop = TurnLoop()
    order: list[str] = []
    try:

        def first() -> None:
            order.append("first")
            loop.at_turn_end(lambda: order.append("turn end"))
            loop.call_soon(lambda: order.append("scheduled by first"))

        async def main() -> None:
            loop.call_soon(first)
            loop.call_soon(lambda: order.append("second"))
            await asyncio.sleep(0.01)

        loop.run_until_complete(main())
    finally:
        loop.close()
    # The turn's callbacks, then its end, then what they scheduled (the next turn).
    assert order == ["first", "second", "turn end", "scheduled by first"]


def test_what_a_turn_end_callback_schedules_runs_without_waiting_for_io() -> None:
    """A turn-end callback that schedules a callback (a transport closed by a failed write
    does) must not leave it behind a blocking wait: with no timer and no I/O, the loop would
    wait forever."""
    loop = TurnLoop()
    try:
        done = loop.create_future()

        def end() -> None:
            loop.call_soon(done.set_result, "ran")

        loop.call_soon(loop.at_turn_end, end)
        assert loop.run_until_complete(asyncio.wait_for(done, 5)) == "ran"
        timer_fired = loop.create_future()
        loop.call_soon(loop.at_turn_end, lambda: loop.call_later(0, timer_fired.set_result, 1))
        assert loop.run_until_complete(asyncio.wait_for(timer_fired, 5)) == 1
    finally:
        loop.close()


def test_a_failing_turn_end_callback_goes_to_the_exception_handler_and_the_loop_goes_on() -> None:
    loop = TurnLoop()
    seen: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, context: seen.append(context))
    ran: list[str] = []
    try:

        def boom() -> None:
            raise RuntimeError("boom")

        async def main() -> None:
            loop.at_turn_end(boom)
            loop.at_turn_end(lambda: ran.append("after"))
            await asyncio.sleep(0)
            await asyncio.sleep(0)

        loop.run_until_complete(main())
    finally:
        loop.close()
    assert ran == ["after"]
    assert len(seen) == 1 and isinstance(seen[0]["exception"], RuntimeError)
    assert "turn-end callback" in seen[0]["message"]


@pytest.mark.parametrize("kind", ["turn loop", "plain asyncio"])
def test_at_turn_end_picks_the_loop_s_way(kind: str) -> None:
    loop = TurnLoop() if kind == "turn loop" else asyncio.new_event_loop()
    try:
        schedule = at_turn_end(loop)
        if kind == "turn loop":
            assert isinstance(loop, TurnLoop)
            schedule(lambda: None)
            assert len(loop.turn_end) == 1
        else:
            assert schedule == loop.call_soon
    finally:
        loop.close()


def _scripted_run(loop: asyncio.AbstractEventLoop) -> list[str]:
    """A program in phases, each waited out before the next (so the order within each is the
    loop's alone, not the machine's speed): callbacks, one raising, one scheduling another;
    150 timers, two thirds cancelled (enough for asyncio to rebuild its timer heap); a writer
    and a reader on a socket pair, then a reader and a writer cancelled in place; a wake-up
    from another thread while the loop waits with no timer. What ran, in order."""
    order: list[str] = []

    def handler(_loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        handle = type(context.get("handle")).__name__
        order.append(f"{context['message']}: {context['exception']!r} ({handle})")

    loop.set_exception_handler(handler)
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)

    async def main() -> None:
        for i in range(3):
            loop.call_soon(order.append, f"soon {i}")
        loop.call_soon(_raise, "boom")
        loop.call_soon(lambda: loop.call_soon(order.append, "nested soon"))
        loop.call_soon(order.append, "soon 3")
        loop.call_soon(order.append, "cancelled while ready").cancel()
        for _ in range(3):
            await asyncio.sleep(0)

        timers = [loop.call_later(0.0001 * i, order.append, f"timer {i}") for i in range(150)]
        for timer in timers[::3] + timers[1::3]:
            timer.cancel()
        await asyncio.sleep(0.03)

        read = loop.create_future()

        def reader() -> None:
            loop.remove_reader(a)
            order.append(f"read {a.recv(100)!r}")
            read.set_result(None)

        def writer() -> None:
            loop.remove_writer(b)
            order.append("writable")
            b.send(b"ping")

        loop.add_reader(a, reader)
        loop.add_writer(b, writer)
        await read

        # A reader and a writer cancelled where they stand (not removed): the turn drops each
        # from the selector when its socket is next ready, and runs neither.
        selecting: Any = loop  # asyncio's selector loop: the handle-returning _add_reader
        selecting._add_reader(a, order.append, "cancelled reader ran").cancel()
        selecting._add_writer(b, order.append, "cancelled writer ran").cancel()
        b.send(b"pong")
        await asyncio.sleep(0.02)
        watched = selecting._selector.get_map()
        order.append(f"still selected: {a.fileno() in watched}, {b.fileno() in watched}")
        order.append(f"left to read {a.recv(100)!r}")

        woken = loop.create_future()
        threading.Timer(0.01, loop.call_soon_threadsafe, (woken.set_result, None)).start()
        await woken
        order.append("woken")

    try:
        loop.run_until_complete(main())
    finally:
        a.close()
        b.close()
        loop.close()
    return order


def _raise(message: str) -> None:
    raise RuntimeError(message)


def test_the_turn_loop_runs_a_program_as_asyncio_s_own_loop_does() -> None:
    """``turn.Turn`` runs asyncio's turn step for step: the same program gives the same order
    on both loops (the turn's end aside, which this program does not use), and a callback
    that raises reaches the exception handler as it does from asyncio's ``Handle._run``."""
    own = _scripted_run(asyncio.SelectorEventLoop())
    # (CPython 3.13 leaves the arguments out of the callback's name outside debug mode)
    (boom,) = [o for o in own if o.startswith("Exception in callback _raise(")]
    where = f"{Path(__file__).name}:{_raise.__code__.co_firstlineno}"
    assert boom.endswith(f"{where}: RuntimeError('boom') (Handle)"), boom
    expected = [
        *("soon 0", "soon 1", "soon 2", boom, "soon 3", "nested soon"),
        *(f"timer {i}" for i in range(2, 150, 3)),
        *("writable", "read b'ping'"),
        *("still selected: False, False", "left to read b'pong'", "woken"),
    ]
    assert own == expected
    assert _scripted_run(TurnLoop()) == expected


def test_in_debug_mode_the_turn_loop_runs_asyncio_s_turn_and_still_ends_it() -> None:
    loop = TurnLoop()
    loop.set_debug(True)
    order: list[str] = []
    try:

        async def main() -> None:
            loop.call_soon(lambda: loop.at_turn_end(lambda: order.append("turn end")))
            loop.call_soon(order.append, "callback")
            await asyncio.sleep(0.01)

        loop.run_until_complete(main())
    finally:
        loop.close()
    assert order == ["callback", "turn end"]
