"""A lease is a promise (issue 47): a key becomes free only by its holder's release or by the
end of what holds it alive (its lease; a session whose end the holder can know in time), and
one function of the table, ``free_holder``, is where every grant ends.

The table's rules step by step on a fake clock, the source-level check that nothing else drops
a holder, and the rules on the wire against the ``dflockd`` console script."""

from __future__ import annotations

import ast
import itertools
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import dflockd_server
from celery_dflock.client.clients import DEFAULT_SESSION_TTL_S
from dflockd_server.keys import Client, Holder, KeyState
from dflockd_server.table import LockTable
from tests.support.clock import FakeClock as Clock
from tests.support.servers import DflockdProcess
from tests.support.wire import Wire

LEASE = 60
SESSION_TTL = 3


def make_table(clock: Clock, *, auto_release: bool = True) -> LockTable:
    serial = itertools.count(1)
    return LockTable(
        clock=clock,
        new_token=lambda: f"{next(serial):032x}",
        max_locks=100,
        auto_release_on_disconnect=auto_release,
        session_ttl_s=SESSION_TTL,
    )


def take(table: LockTable, client: Client, key: str = "k", lease: int = LEASE) -> Holder:
    got = table.acquire(client, key, lease, None, queue=False)
    assert isinstance(got, Holder), got
    return got


def free_for_rival(table: LockTable, key: str = "k") -> bool:
    """Whether a rival's try-once acquire of ``key`` is granted now (then it releases it)."""
    got = table.acquire(table.open_client(), key, LEASE, None, queue=False)
    if got is None:
        return False
    assert isinstance(got, Holder)
    assert table.release(key, got.token)
    return True


# ---------------------------------------------------------------- the table, on a fake clock
@pytest.mark.parametrize("session", [False, True], ids=["plain", "session"])
def test_a_close_the_server_makes_itself_frees_nothing_before_the_lease_ends(
    session: bool,
) -> None:
    clock = Clock()
    table = make_table(clock)
    holder_conn = table.open_client()
    holder_conn.session = session
    take(table, holder_conn)
    clock.now = 23.0  # the read timeout: the server closes the silent connection
    table.disconnect(holder_conn, by_peer=False)
    assert not free_for_rival(table)
    clock.now = LEASE - 0.01
    table.expire()
    assert not free_for_rival(table)
    clock.now = LEASE
    assert table.expire() == 1
    assert free_for_rival(table)
    assert table.grants.counts.lost_by_disconnect == [0, 0]


def test_a_plain_connection_closed_by_its_peer_frees_its_grants_at_once() -> None:
    """The seed's auto-release, for dflockd clients that expect it."""
    clock = Clock()
    table = make_table(clock)
    holder_conn = table.open_client()
    take(table, holder_conn)
    waiter = table.acquire(table.open_client(), "k", LEASE, None, queue=True)
    assert waiter is not None and not isinstance(waiter, Holder)
    table.disconnect(holder_conn)
    assert waiter.holder is not None  # granted at once, at the close
    assert table.grants.counts.lost_by_disconnect == [1, 0]


def test_a_session_connection_closed_by_its_peer_keeps_its_grants_for_the_session_ttl() -> None:
    clock = Clock()
    table = make_table(clock)
    holder_conn = table.open_client()
    holder_conn.session = True
    take(table, holder_conn)
    waiter = table.acquire(table.open_client(), "k", LEASE, None, queue=True)
    assert waiter is not None and not isinstance(waiter, Holder)
    clock.now = 10.0
    table.disconnect(holder_conn)
    assert waiter.holder is None
    clock.now = 10.0 + SESSION_TTL - 0.01
    table.expire()
    assert waiter.holder is None
    clock.now = 10.0 + SESSION_TTL
    assert table.expire() == 1
    assert waiter.holder is not None
    assert table.grants.counts.expiries == [1, 0]


def test_a_session_grant_whose_lease_ends_sooner_ends_with_its_lease() -> None:
    clock = Clock()
    table = make_table(clock)
    holder_conn = table.open_client()
    holder_conn.session = True
    take(table, holder_conn, lease=5)
    clock.now = 4.0
    table.disconnect(holder_conn)
    clock.now = 5.0
    assert table.expire() == 1
    assert free_for_rival(table)


def test_a_renewal_by_token_after_a_close_keeps_the_grant_and_binds_it_to_the_new_connection() -> (
    None
):
    clock = Clock()
    table = make_table(clock)
    first = table.open_client()
    first.session = True
    token = take(table, first).token
    table.disconnect(first)
    clock.now = SESSION_TTL - 0.5
    second = table.open_client()  # a plain one: its close by the peer frees at once
    assert table.renew("k", token, LEASE, second) == LEASE
    clock.now = SESSION_TTL + 1.0
    table.expire()
    assert not free_for_rival(table)  # renewed: past the first session's end
    table.disconnect(second)
    assert free_for_rival(table)  # the grant is the second connection's now


def test_without_auto_release_a_close_by_the_peer_frees_nothing_before_the_lease_ends() -> None:
    clock = Clock()
    table = make_table(clock, auto_release=False)
    for session in (False, True):
        conn = table.open_client()
        conn.session = session
        take(table, conn, key=f"k{session}")
        table.disconnect(conn)
    clock.now = LEASE - 0.01
    table.expire()
    assert not free_for_rival(table, "kFalse")
    assert not free_for_rival(table, "kTrue")
    clock.now = LEASE
    assert table.expire() == 2


def test_every_way_a_grant_ends_goes_through_free_holder() -> None:
    """Release, an operator's force release, expiry (a lock alone and a key with a state), a
    session's end, a foreign close by the peer, a close by the server, a drain: each grant that
    ends is ended by
    ``free_holder``, and nothing ends one that the rule keeps."""
    clock = Clock()
    table = make_table(clock)
    freed: list[tuple[str, list[int]]] = []
    real = table.grants.free_holder

    def spy(holder: Holder, state: KeyState | None, now: float, why: list[int]) -> None:
        freed.append((holder.key, why))
        real(holder, state, now, why)

    table.grants.free_holder = spy  # type: ignore[method-assign]
    counts = table.grants.counts
    a, b, c, d, e = (table.open_client() for _ in range(5))
    d.session = True
    released = take(table, a, "released")
    take(table, a, "expired", lease=5)
    take(table, b, "expired-with-state", lease=5)
    table.acquire(table.open_client(), "expired-with-state", LEASE, None, queue=True)
    take(table, c, "closed-by-peer")
    take(table, d, "session-closed")
    take(table, e, "closed-by-server")
    take(table, table.open_client(), "drained")
    table.acquire(table.open_client(), "drained", LEASE, None, queue=True)
    take(table, b, "forced")

    assert table.release("released", released.token)
    assert [h.key for h in table.force_release("forced")] == ["forced"]
    table.disconnect(c)  # a plain connection, by its peer
    table.disconnect(e, by_peer=False)  # the server's own close
    table.drop_queued()  # a drain
    assert freed == [
        ("released", counts.releases),
        ("forced", counts.forced),
        ("closed-by-peer", counts.lost_by_disconnect),
    ]
    clock.now = 5.0
    table.expire()
    assert sorted(key for key, _ in freed[3:]) == ["expired", "expired-with-state"]
    assert all(why is counts.expiries for _, why in freed[3:])
    table.disconnect(d)  # a session connection, by its peer
    clock.now = SESSION_TTL + 5.0
    table.expire()
    assert freed[-1] == ("session-closed", counts.expiries)
    assert {key for key, _ in freed} == {
        "released",
        "forced",
        "expired",
        "expired-with-state",
        "closed-by-peer",
        "session-closed",
    }
    assert table.is_busy("closed-by-server")
    assert table.is_busy("drained")


def _server_sources() -> Iterator[tuple[Path, ast.Module]]:
    root = Path(dflockd_server.__file__).parent
    for path in sorted(root.rglob("*.py")):
        yield path, ast.parse(path.read_text(encoding="utf-8"))


def test_no_code_of_the_server_but_free_holder_ends_a_grant() -> None:
    """Source level: a holder's ``live`` turns False only in ``free_holder`` (a grant's end)
    and ``move`` (a rebind: a new holder takes the grant on, nothing is freed); the totals
    of ended grants are counted only in ``free_holder``."""
    ends = {"releases", "forced", "expiries", "lost_by_disconnect"}
    offenders: list[str] = []
    for path, tree in _server_sources():
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef):
                continue
            for node in ast.walk(func):
                targets: list[ast.expr] = []
                if isinstance(node, ast.Assign):
                    targets = node.targets
                elif isinstance(node, ast.AugAssign):
                    targets = [node.target]
                for target in targets:
                    if (
                        isinstance(target, ast.Attribute)
                        and target.attr == "live"
                        and isinstance(node, ast.Assign)
                        and isinstance(node.value, ast.Constant)
                        and node.value.value is False
                        and func.name not in ("free_holder", "move")
                    ):
                        offenders.append(f"{path.name}:{node.lineno} {func.name} sets live")
                    if (
                        isinstance(target, ast.Subscript)
                        and isinstance(target.value, ast.Attribute)
                        and target.value.attr in ends
                        and func.name != "free_holder"
                    ):
                        offenders.append(f"{path.name}:{target.lineno} {func.name} counts an end")
    assert offenders == []


# ---------------------------------------------------------------- on the wire
@pytest.fixture
def dflockd() -> Iterator[tuple[str, int]]:
    """``dflockd`` as a user starts it, with a short read timeout (so a silent connection is
    closed by the server quickly) and a fast lease sweep."""
    proc = DflockdProcess(
        [
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--read-timeout",
            "1",
            "--lease-sweep-interval",
            "0.1",
            "--state-dir",
            "none",
        ],
        {},
    )
    try:
        yield proc.wait_listening()
    finally:
        proc.kill()


def test_a_silent_plain_holder_keeps_its_key_until_its_lease_ends(
    dflockd: tuple[str, int],
) -> None:
    """A foreign client's ``l k 0 <lease>``, then silence past the read timeout: the server
    closes the connection (its own act) and the key stays held to the lease's end."""
    lease = 6
    with Wire(dflockd) as holder:
        granted_at = time.monotonic()
        holder.lock("k", 0, lease)
        assert holder.closed_by_server()  # the read timeout (1 s)
    with Wire(dflockd) as rival:
        assert rival.req("l", "k", "0") == "timeout"
        reply = rival.req("l", "k", "30").split()  # a request in flight: no read timeout
        assert reply[0] == "ok", reply
        assert time.monotonic() - granted_at >= lease - 0.5  # not before the lease's end


def test_a_session_connection_closed_by_its_peer_can_be_reattached_by_token(
    dflockd: tuple[str, int],
) -> None:
    with Wire(dflockd) as holder:
        hello = holder.req("hello", "_", "session")
        assert '"session"' in hello and '"session_ttl_s":3' in hello, hello
        token = holder.lock("k", 0, LEASE)
    # The peer's close (a FIN): the grant is kept for the session's time.
    with Wire(dflockd) as rival:
        assert rival.req("l", "k", "0") == "timeout"
    with Wire(dflockd) as again:
        assert again.req("n", "k", token).split()[0] == "ok"  # reattached by token
        # Its new connection is closed by the server (the read timeout): kept to the lease.
        assert again.closed_by_server()
    time.sleep(SESSION_TTL + 0.5)
    with Wire(dflockd) as rival:
        assert rival.req("l", "k", "0") == "timeout"
        assert rival.req("r", "k", token) == "ok"
        assert rival.req("l", "k", "0").split()[0] == "ok"


_HOLDER = textwrap.dedent(
    """
    import sys, time
    from celery_dflock.client import Client

    client = Client([(sys.argv[1], int(sys.argv[2]))])
    lock = client.lock("k", lease_ttl_s=60)
    assert lock.acquire()
    print("held", flush=True)
    time.sleep(600)
    """
)


def _spawn_holder(address: tuple[str, int]) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, address[0], str(address[1])],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.fixture
def dflockd_as_started() -> Iterator[tuple[str, int]]:
    """``dflockd`` with its defaults (a lease sweep every second, the read timeout of 23 s)."""
    proc = DflockdProcess(["--host", "127.0.0.1", "--port", "0"], {})
    try:
        yield proc.wait_listening()
    finally:
        proc.kill()


def test_a_killed_holder_frees_its_key_when_its_session_ends(
    dflockd_as_started: tuple[str, int],
) -> None:
    """kill -9 of a process holding a lock through the project's client (a client session
    of the default 15 s, kept alive every 5 s): its key is free once the session ends, between
    10 and 15 s after the kill and a sweep; not at the kill (a close of its connection is no
    end of the session), and long before its lease of 60 s."""
    server = dflockd_as_started
    proc = _spawn_holder(server)
    try:
        with Wire(server, timeout=DEFAULT_SESSION_TTL_S + 10) as rival:
            assert rival.req("l", "k", "0") == "timeout"
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            killed = time.monotonic()
            reply = rival.req("l", "k", "5").split()
            assert reply == ["timeout"], reply  # its session lives on for a while
            reply = rival.req("l", "k", str(DEFAULT_SESSION_TTL_S + 2)).split()
            assert reply[0] == "ok", reply
            assert time.monotonic() - killed <= DEFAULT_SESSION_TTL_S + 2
    finally:
        _reap(proc)


def _reap(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(10)
    if proc.stdout is not None:
        proc.stdout.close()
