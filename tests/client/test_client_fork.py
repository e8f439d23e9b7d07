"""fork(): a child never uses the parent's held lock or pooled connections, and can lock."""

from __future__ import annotations

from celery_dflock import ConnectionPool, DistributedLock, LockNotOwned
from dflockd_server.testing import ServerThread
from tests.support.processes import run_in_fork
from tests.support.wire import held_keys


def _child(
    parent_lock: DistributedLock, pool: ConnectionPool, servers: list[tuple[str, int]]
) -> dict[str, object]:
    """Runs in the forked child; returns what it saw."""
    seen: dict[str, object] = {
        "parent_lock_locked": parent_lock.locked(),
        "parent_lock_token_visible": parent_lock.token is not None,
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
    reused_before = pool.reused  # one connection pinned by the lock, one idle: inherited

    code, seen = run_in_fork(lambda: _child(parent_lock, pool, servers))

    assert code == 0, seen
    assert seen["parent_lock_locked"] is False  # not the child's to use
    assert "before a fork" in str(seen["renew"])
    assert seen["release"] is False
    assert seen["parent_lock_locked_after"] is False
    assert seen["steal"] is False
    assert seen["own_acquire"] is True and seen["own_release"] is True and seen["own_fence"]
    # the child's pool starts afresh, its inherited idle connection dropped: one new
    # connection, reused for its second lock
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
