"""Our client against the real dflockd 0.5.0 server (issue 13, points 11, 12, 13 and 15).

dflockd 0.5.0 knows ``l``/``n``/``r``/``e``/``w`` only: it answers ``ping``, ``stats`` and
``hello`` with ``error`` and closes the connection.
"""

from __future__ import annotations

import asyncio
import ssl
import threading
from pathlib import Path

import pytest

from celery_dflock import (
    AsyncConnectionPool,
    AsyncDistributedLock,
    Client,
    ConnectionPool,
    DistributedLock,
    HoldsUnsupported,
)
from celery_dflock.config import reset_config
from tests.interop.interop_helpers import ForeignServer, TlsFront
from tests.support.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]


def test_five_sequential_locks_reuse_one_pooled_connection(dflockd_050: ForeignServer) -> None:
    with ConnectionPool() as pool:
        for _ in range(5):
            with DistributedLock("interop:seq", servers=[dflockd_050.address], pool=pool) as lock:
                assert lock.locked()
        assert (pool.opened, pool.reused) == (1, 4)
        info = pool.server_info(*dflockd_050.address)
        assert info is not None and info.legacy and not info.fences
    # the server saw two: the one that asked `hello` (refused, closed by it), and the one reused
    assert dflockd_050.connections_accepted() == 2


def test_five_sequential_async_locks_reuse_one_pooled_connection(
    dflockd_050: ForeignServer,
) -> None:
    async def main() -> tuple[int, int]:
        async with AsyncConnectionPool() as pool:
            for _ in range(5):
                async with AsyncDistributedLock(
                    "interop:aseq", servers=[dflockd_050.address], pool=pool
                ) as lock:
                    assert lock.locked()
            return pool.opened, pool.reused

    assert asyncio.run(main()) == (1, 4)
    assert dflockd_050.connections_accepted() == 2


def test_fence_is_none_where_the_server_issues_no_fencing_tokens(
    dflockd_050: ForeignServer,
) -> None:
    servers = [dflockd_050.address]
    with DistributedLock("interop:fence", servers=servers) as lock:
        assert lock.token is not None and lock.fence is None
    with ConnectionPool() as pool:
        first = DistributedLock("interop:fence2", servers=servers, pool=pool)
        second = DistributedLock("interop:fence2", servers=servers, pool=pool)
        assert first.enqueue() == "acquired" and first.fence is None
        assert second.enqueue() == "queued"
        first.release()
        assert second.wait(5) is True
        assert second.token is not None and second.fence is None
        second.release()

    async def main() -> None:
        async with AsyncDistributedLock("interop:afence", servers=servers) as alock:
            assert alock.token is not None and alock.fence is None

    asyncio.run(main())


def test_locks_renew_exclude_and_hand_over_on_the_foreign_server(
    dflockd_050: ForeignServer,
) -> None:
    servers = [dflockd_050.address]
    with ConnectionPool() as pool:
        holder = DistributedLock("interop:x", lease_ttl_s=2, servers=servers, pool=pool)
        assert holder.acquire()
        # renewed (every second) past its 2 s lease while another client waits its turn
        assert not DistributedLock("interop:x", acquire_timeout_s=3, servers=servers).acquire()
        assert holder.locked() and not holder.lost
        got: list[bool] = []
        waiter = DistributedLock("interop:x", acquire_timeout_s=10, servers=servers, pool=pool)
        thread = threading.Thread(target=lambda: got.append(waiter.acquire()))
        thread.start()
        assert holder.release() is True
        thread.join(15)
        assert got == [True] and waiter.locked()
        assert waiter.release() is True


def test_the_fenced_example_task_refuses_to_write_without_fences(
    dflockd_050: ForeignServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The example's fenced write, called directly (it takes its lock on the foreign server).
    monkeypatch.setenv("EXAMPLE_LEDGER", str(tmp_path / "ledger.sqlite3"))
    from examples.proj.app import add_to_balance, app
    from examples.proj.ledger import NoFenceError

    monkeypatch.setitem(app.conf, "dflock_servers", f"{dflockd_050.host}:{dflockd_050.port}")
    reset_config(app)
    try:
        with pytest.raises(NoFenceError, match="issues no fencing tokens"):
            add_to_balance("acme", 5)  # pyright: ignore[reportCallIssue] - bound task
    finally:
        reset_config(app)


def test_pooled_tls_connections_are_reused_on_a_server_without_ping(
    dflockd_050: ForeignServer, tls_files: tuple[str, str]
) -> None:
    cert, key = tls_files
    context = ssl.create_default_context(cafile=cert)
    with TlsFront(dflockd_050.address, cert, key) as front, ConnectionPool() as pool:
        for _ in range(5):
            with DistributedLock(
                "interop:tls", servers=[front.address], ssl_context=context, pool=pool
            ) as lock:
                assert lock.locked() and lock.fence is None
        assert (pool.opened, pool.reused) == (1, 4)
    assert dflockd_050.connections_accepted() == 2  # the hello probe, and the one reused


@pytest.mark.dflockd_args("--read-timeout", "1")
def test_a_connection_the_foreign_server_dropped_is_not_reused(
    dflockd_050: ForeignServer,
) -> None:
    # dflockd 0.5.0 answers an idle connection's read timeout with `error`, then closes it:
    # neither the stray line nor the closed connection may reach the next lock.
    servers = [dflockd_050.address]

    def dropped() -> None:
        wait_until(
            lambda: dflockd_050.connections_closed() == dflockd_050.connections_accepted(),
            what="the server closing every connection (the idle pooled one too)",
        )

    with ConnectionPool() as pool:
        with DistributedLock("interop:idle", servers=servers, pool=pool):
            pass
        dropped()
        with DistributedLock("interop:idle", servers=servers, pool=pool) as lock:
            assert lock.locked()
        assert (pool.opened, pool.reused, pool.discarded) == (2, 0, 1)

    async def main() -> tuple[int, int, int]:
        async with AsyncConnectionPool() as apool:
            async with AsyncDistributedLock("interop:aidle", servers=servers, pool=apool):
                pass
            await asyncio.to_thread(dropped)
            async with AsyncDistributedLock("interop:aidle", servers=servers, pool=apool) as lk:
                assert lk.locked()
            return apool.opened, apool.reused, apool.discarded

    assert asyncio.run(main()) == (2, 0, 1)


def test_holds_are_refused_before_reaching_a_foreign_server(dflockd_050: ForeignServer) -> None:
    """dflockd 0.5.0 lists no ``holds`` (it answers no ``hello``): `Client.hold` raises
    `HoldsUnsupported` naming it, and a lock's note is left out (a plain ``l``)."""
    with Client([dflockd_050.address]) as client:
        with pytest.raises(HoldsUnsupported) as refused:
            client.hold("interop:hold", note="t1", lease_ttl=5)
        host, port = dflockd_050.address
        assert f"{host}:{port}" in str(refused.value)
        assert "the 'holds' feature" in str(refused.value)
        with client.lock("interop:hold", note="t1") as lock:
            assert lock.locked()
