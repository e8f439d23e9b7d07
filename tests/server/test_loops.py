"""The loops the server runs on (``loops``): uvloop's by default, asyncio's own on request; the
journal's group write once per turn of either, scheduled with ``call_soon``, and a connection
alone in its turns writing the journal itself."""

from __future__ import annotations

import asyncio
import importlib.util
import select
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dflockd_server import Config
from dflockd_server.cli import _loop_factory  # pyright: ignore[reportPrivateUsage]
from dflockd_server.constants import JOURNAL_DIRECT_WRITES, JOURNAL_LONE_TURNS
from dflockd_server.loops import default_loop_factory, loop_name, uvloop_factory
from dflockd_server.stream import GroupWrite
from dflockd_server.testing import ServerThread
from tests.support.waiting import wait_until
from tests.support.wire import Wire

PAIRS = 200
STALL_LIMIT_S = 10.0
"""Longest a test holds the server's loop up waiting for its requests to arrive."""
HAS_UVLOOP = importlib.util.find_spec("uvloop") is not None
LOOPS = [
    "asyncio",
    pytest.param("uvloop", marks=pytest.mark.skipif(not HAS_UVLOOP, reason="no uvloop")),
]


class GroupWrites:
    """A loop of ``kind`` (``asyncio``, ``uvloop``) that counts the group writes it is asked to
    run: ``call_soon`` of a ``GroupWrite``'s ``write``."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.scheduled = 0

    def factory(self) -> asyncio.AbstractEventLoop:
        base: Any = asyncio.SelectorEventLoop
        if self.kind == "uvloop":
            base = importlib.import_module("uvloop").Loop
        counts = self

        class Counting(base):  # pyright: ignore[reportUntypedBaseClass]
            def call_soon(self, callback: Callable[..., object], *args: Any, **kwargs: Any) -> Any:
                if isinstance(getattr(callback, "__self__", None), GroupWrite):
                    counts.scheduled += 1
                return super().call_soon(callback, *args, **kwargs)  # pyright: ignore[reportUnknownMemberType]

        loop: asyncio.AbstractEventLoop = Counting()
        return loop


def _journal_config(tmp_path: Path, fsync: str = "always") -> Config:
    """A journal whose replies wait for the group write (``always``), unless ``fsync`` says."""
    return Config(host="127.0.0.1", port=0, state_dir=str(tmp_path / "state"), journal_fsync=fsync)


def _socket_of(transport: asyncio.BaseTransport | None) -> int:
    """The file descriptor of a connection's socket at the server (on the loop)."""
    assert transport is not None
    fd: int = transport.get_extra_info("socket").fileno()
    return fd


def _state_text(tmp_path: Path) -> str:
    """What the server's state directory holds, its journal included, as text."""
    state = tmp_path / "state"
    return "".join(p.read_text(errors="replace") for p in state.rglob("*") if p.is_file())


@pytest.mark.parametrize("kind", LOOPS)
def test_a_lone_connection_writes_the_journal_itself(tmp_path: Path, kind: str) -> None:
    """At the default fsync (``everysec``), one connection alone in its turns: after
    ``JOURNAL_LONE_TURNS`` group writes of its replies alone, it writes the journal itself before
    its replies, and no group write is scheduled any more (at one connection, a callback per
    request cost more than the write it waited for); every record is in the file when its reply
    arrives, either way."""
    counted = GroupWrites(kind)
    with (
        ServerThread(_journal_config(tmp_path, "everysec"), loop_factory=counted.factory) as srv,
        Wire(srv.address) as wire,
    ):
        assert srv.stats()["loop"] == kind
        for i in range(PAIRS):
            token = wire.lock(f"k{i % 10}")
            assert f"G {token} " in _state_text(tmp_path)
            assert wire.req("r", f"k{i % 10}", token) == "ok"
        direct = srv.call(lambda: srv.server.group_write.direct)
    assert direct
    assert counted.scheduled == JOURNAL_LONE_TURNS, (
        f"{counted.scheduled} group writes for {2 * PAIRS} requests"
    )


@pytest.mark.parametrize("kind", LOOPS)
def test_every_request_of_a_turn_waits_for_one_group_write(tmp_path: Path, kind: str) -> None:
    """With ``always``, the replies wait for the group write: one scheduled per round trip at
    one connection (each request is a turn of its own), each reply after its record."""
    counted = GroupWrites(kind)
    with (
        ServerThread(_journal_config(tmp_path), loop_factory=counted.factory) as srv,
        Wire(srv.address) as wire,
    ):
        for i in range(20):
            token = wire.lock(f"k{i}")
            assert f"G {token} " in _state_text(tmp_path)
            assert wire.req("r", f"k{i}", token) == "ok"
    assert counted.scheduled == 40


@pytest.mark.parametrize("fsync", ["everysec", "always"])
@pytest.mark.parametrize("kind", LOOPS)
def test_connections_sharing_a_turn_share_the_group_write(
    tmp_path: Path, fsync: str, kind: str
) -> None:
    """A connection that wrote the journal itself ``JOURNAL_DIRECT_WRITES`` times hands back to the
    group write, which looks whether it is still alone: two connections with requests in one turn
    (the loop held up while both send) are written once for both, and writing directly waits for
    ``JOURNAL_LONE_TURNS`` lone turns in a row again. With ``always`` no connection ever writes
    directly (one fsync per turn for all)."""
    with (
        ServerThread(
            _journal_config(tmp_path, fsync), loop_factory=GroupWrites(kind).factory
        ) as srv,
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

        # The loop is held up until both requests have reached the server's ends of `a` and
        # `b`, ordered by events rather than by a pause: a loaded CI machine may not run this
        # thread's two sends within a fixed pause (0.3 s used to be it), and a request that
        # arrives after the loop has resumed gets a turn of its own.
        server_ends = srv.call(
            lambda: [_socket_of(conn.stream.transport) for conn in srv.server.admission.connections]
        )
        assert len(server_ends) == 2
        stalled = threading.Event()
        both_arrived = threading.Event()

        def stall() -> None:
            stalled.set()
            both_arrived.wait(STALL_LIMIT_S)

        held_up = threading.Thread(target=srv.call, args=(stall, STALL_LIMIT_S + 5.0))
        held_up.start()
        assert stalled.wait(STALL_LIMIT_S)  # the loop is held up: both requests wait for one turn
        a.send("l", "a2", "0")
        b.send("l", "b2", "0")
        wait_until(
            lambda: all(select.select([fd], [], [], 0)[0] for fd in server_ends),
            what="both requests readable at the server",
        )
        both_arrived.set()
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


def test_the_cli_runs_uvloop_by_default_and_asyncio_s_own_loop_on_request() -> None:
    assert _loop_factory("asyncio") is asyncio.new_event_loop
    expected = uvloop_factory() or asyncio.new_event_loop
    assert _loop_factory("auto") is expected
    assert default_loop_factory() is expected
    loop = default_loop_factory()()
    try:
        assert loop_name(loop) == ("uvloop" if HAS_UVLOOP else "asyncio")
    finally:
        loop.close()


def test_a_server_thread_runs_what_dflockd_runs_by_default() -> None:
    with ServerThread() as srv:
        assert srv.stats()["loop"] == ("uvloop" if HAS_UVLOOP else "asyncio")
