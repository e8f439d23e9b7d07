"""fork(): a child never uses the parent's held lock or pooled connections, and can lock."""

from __future__ import annotations

import json
import os
import select
import time
import warnings

import pytest
from client_helpers import held_keys

from celery_dflock import ConnectionPool, DistributedLock, LockNotOwned
from dflockd_server.testing import ServerThread

CHILD_TIMEOUT_S = 20.0


def _child(
    parent_lock: DistributedLock, pool: ConnectionPool, servers: list[tuple[str, int]]
) -> dict[str, object]:
    """Runs in the forked child; returns what it saw."""
    seen: dict[str, object] = {
        "parent_lock_locked": parent_lock.locked(),
        "parent_lock_token_visible": parent_lock.token is not None,
        "pool_idle_inherited": pool.idle_count(),
    }
    try:
        parent_lock.renew()
        seen["renew"] = "renewed?!"
    except LockNotOwned as exc:
        seen["renew"] = str(exc)
    seen["release"] = parent_lock.release()
    seen["parent_lock_locked_after"] = parent_lock.locked()
    # the parent still holds it: the child's attempt must fail, not steal or release it
    seen["steal"] = DistributedLock("parent-held", 0, servers=servers, pool=pool).acquire()
    own = DistributedLock("child-key", servers=servers, pool=pool)
    seen["own_acquire"] = own.acquire()
    seen["own_fence"] = own.fence is not None
    seen["own_release"] = own.release()
    seen["pool_opened"] = pool.opened
    seen["pool_reused"] = pool.reused
    pool.close()
    return seen


def _fork_and_report(
    parent_lock: DistributedLock, pool: ConnectionPool, servers: list[tuple[str, int]]
) -> tuple[int, dict[str, object]]:
    read_fd, write_fd = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork with threads
        pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child, reported through the pipe
        code = 1
        try:
            os.close(read_fd)
            report = _child(parent_lock, pool, servers)
            code = 0
        except BaseException as exc:
            report = {"error": repr(exc)}
        try:
            os.write(write_fd, json.dumps(report).encode())
        finally:
            os._exit(code)
    os.close(write_fd)
    data = b""
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([read_fd], [], [], deadline - time.monotonic())
            if not ready:
                break
            chunk = os.read(read_fd, 65536)
            if not chunk:
                break
            data += chunk
        while (waited := os.waitpid(pid, os.WNOHANG)) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail("the forked child did not finish")
            time.sleep(0.01)
    finally:
        os.close(read_fd)
    return os.waitstatus_to_exitcode(waited[1]), json.loads(data or b"{}")


def test_fork_child_leaves_parent_lock_and_pool_alone(
    dflock_server: ServerThread, pool: ConnectionPool
) -> None:
    servers = [dflock_server.address]
    warm = [DistributedLock(f"warm-{i}", servers=servers, pool=pool) for i in range(2)]
    for lock in warm:
        assert lock.acquire()
    for lock in warm:
        assert lock.release()
    parent_lock = DistributedLock("parent-held", lease_ttl_s=30, servers=servers, pool=pool)
    assert parent_lock.acquire()
    assert pool.idle_count() == 1  # one pinned by the lock, one idle, both inherited
    reused_before = pool.reused

    code, seen = _fork_and_report(parent_lock, pool, servers)

    assert code == 0, seen
    assert seen["parent_lock_locked"] is False  # not the child's to use
    assert "before a fork" in str(seen["renew"])
    assert seen["release"] is False
    assert seen["parent_lock_locked_after"] is False
    assert seen["pool_idle_inherited"] == 0  # inherited idle connections dropped
    assert seen["steal"] is False
    assert seen["own_acquire"] is True and seen["own_release"] is True and seen["own_fence"]
    # the child's pool starts afresh: one new connection, reused for its second lock
    assert (seen["pool_opened"], seen["pool_reused"]) == (1, 1)

    # the parent's lock and its connection survived the child closing its copies
    assert parent_lock.owned()
    assert parent_lock.renew() is True
    assert held_keys(dflock_server.address) == {"parent-held"}
    again = DistributedLock("after-fork", servers=servers, pool=pool)
    assert again.acquire()
    assert pool.reused == reused_before + 1  # the idle connection was still good
    assert again.release()
    assert parent_lock.release() is True
    assert held_keys(dflock_server.address) == set()
