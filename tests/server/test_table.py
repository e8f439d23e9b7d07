"""The pure lock table, step by step on a fake clock: one resource per key (a lock is a
semaphore of limit 1). The model-based test (test_table_model.py) covers random interleavings;
these name the rules one by one."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import pytest

from dflockd_server.fence import FenceStateError
from dflockd_server.recorded import RecordedGrant
from dflockd_server.table import (
    AlreadyEnqueued,
    Entry,
    Holder,
    KeyState,
    LimitMismatch,
    LockTable,
    MaxLocks,
    MaxWaiters,
    Waiter,
)
from tests.support.clock import FakeClock as Clock
from tests.support.tables import key_state

LEASE = 10


def make_table(clock: Clock, max_locks: int = 100) -> LockTable:
    serial = itertools.count(1)
    return LockTable(
        clock=clock, new_token=lambda: f"{next(serial):032x}", max_locks=max_locks, max_waiters=0
    )


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def table(clock: Clock) -> LockTable:
    return make_table(clock)


def grant(table: LockTable, key: str, limit: int | None) -> Holder:
    got = table.acquire(table.open_client(), key, LEASE, limit, queue=False)
    assert isinstance(got, Holder), got
    return got


def test_a_lock_refuses_a_semaphore_and_the_other_way_round(table: LockTable) -> None:
    grant(table, "k", None)
    with pytest.raises(LimitMismatch) as info:
        table.acquire(table.open_client(), "k", LEASE, 2, queue=True)
    assert (info.value.key, info.value.limit) == ("k", 1)
    grant(table, "s", 2)
    for limit in (None, 1, 3):
        with pytest.raises(LimitMismatch) as info:
            table.acquire(table.open_client(), "s", LEASE, limit, queue=True)
        assert info.value.limit == 2
    state = key_state(table, "s")
    assert state is not None
    assert len(state.holders) == 1
    assert state.n_waiting == 0  # a refused request never queues


def test_a_held_lock_nobody_waits_for_is_its_holder_alone(table: LockTable, clock: Clock) -> None:
    """A held lock keeps no key state until someone waits for it (the state would cost more
    than the rest of the held key); released, its holder stays the idle key's entry, listed,
    swept and pruned as an idle key with a state is."""
    held = grant(table, "k", None)
    assert table.grants.keys["k"] is held
    waiter = table.acquire(table.open_client(), "k", LEASE, None, queue=True)
    assert isinstance(waiter, Waiter)
    state = table.grants.keys["k"]
    assert isinstance(state, KeyState) and state.one is held and state.n_waiting == 1
    assert table.release("k", held.token)
    assert waiter.holder is not None and state.one is waiter.holder
    assert table.release("k", waiter.holder.token)
    again = grant(table, "k", None)  # the idle state gives way to the holder alone
    assert table.grants.keys["k"] is again
    assert table.renew("k", again.token, 2 * LEASE) == 2 * LEASE
    assert not table.release("k", held.token)  # a stale token
    assert table.release("k", again.token)
    assert table.grants.keys["k"] is again and not again.live
    assert again.token == ""  # the idle key keeps no token alive
    assert table.stats(0)["idle_locks"] == [{"key": "k", "idle_s": 0.0}]
    assert table.acquire(table.open_client(), "k", LEASE, 2, queue=False) is not None
    assert isinstance(table.grants.keys["k"], KeyState)  # an idle key takes any kind
    expiring = grant(table, "e", None)
    clock.now += LEASE
    assert table.expire() == 2  # the semaphore's slot and the lock alone, by the sweep
    assert table.grants.counts.expiries == [1, 1]
    assert table.grants.keys["e"] is expiring and not expiring.live
    clock.now += 1
    assert table.stats(0)["idle_locks"] == [{"key": "e", "idle_s": 1.0}]
    assert table.gc(1.0) == 2
    assert not table.grants.keys


def test_a_try_once_acquire_of_a_held_lock_leaves_it_its_holder_alone(table: LockTable) -> None:
    """``timeout`` to a try-once ``l`` or ``hl`` on a held lock nobody waits for makes no key
    state (a task polling a busy key would otherwise cost the key one for good)."""
    held = grant(table, "k", None)
    other = table.open_client()
    assert table.acquire(other, "k", LEASE, None, queue=False) is None
    assert table.acquire(other, "k", LEASE, None, "n", queue=False) is None
    assert table.grants.keys["k"] is held
    assert table.grants.counts.timeouts == [2, 0]
    with pytest.raises(LimitMismatch):
        table.acquire(other, "k", LEASE, 2, queue=False)
    assert table.release("k", held.token)


def test_a_refused_enqueue_leaves_nothing_behind(table: LockTable) -> None:
    grant(table, "s", 3)
    client = table.open_client()
    with pytest.raises(LimitMismatch):
        table.enqueue(client, "s", LEASE, None)
    assert client.enqueued == {}
    assert table.enqueue(client, "s", LEASE, 3).holder is not None


def test_limit_one_is_the_same_resource_as_a_lock(table: LockTable) -> None:
    lock = grant(table, "k", None)
    waiter = table.acquire(table.open_client(), "k", LEASE, 1, queue=True)
    assert isinstance(waiter, Waiter)
    assert table.acquire(table.open_client(), "k", LEASE, None, queue=False) is None
    assert table.release("k", lock.token)
    assert waiter.holder is not None
    state = key_state(table, "k")
    assert state is not None and state.is_sem is False  # the kind stays what fixed the key
    assert table.stats(0)["locks"][0]["key"] == "k"


def test_a_key_stays_busy_while_a_waiter_inherits_it(table: LockTable) -> None:
    first, second = grant(table, "s", 2), grant(table, "s", 2)
    waiter = table.acquire(table.open_client(), "s", LEASE, 2, queue=True)
    assert isinstance(waiter, Waiter)
    with pytest.raises(LimitMismatch):  # held and queued
        table.acquire(table.open_client(), "s", LEASE, None, queue=True)
    assert table.release("s", first.token)
    assert table.release("s", second.token)
    assert waiter.holder is not None
    with pytest.raises(LimitMismatch):  # the waiter holds it now
        table.acquire(table.open_client(), "s", LEASE, None, queue=True)
    assert table.release("s", waiter.holder.token)
    grant(table, "s", None)
    state = key_state(table, "s")
    assert state is not None and state.limit == 1


def test_an_idle_key_takes_the_limit_and_kind_of_its_next_acquire(
    table: LockTable, clock: Clock
) -> None:
    sem = grant(table, "k", 2)
    assert table.release("k", sem.token)
    grant(table, "k", None)
    state = key_state(table, "k")
    assert state is not None and (state.limit, state.is_sem) == (1, False)
    assert table.stats(0)["locks"][0]["key"] == "k"
    assert table.stats(0)["semaphores"] == []
    clock.now += LEASE  # the lease runs out: idle again, checked on the next acquire
    grant(table, "k", 3)
    state = key_state(table, "k")
    assert state is not None and (state.limit, state.is_sem) == (3, True)
    assert table.stats(0)["semaphores"] == [{"key": "k", "limit": 3, "holders": 1, "waiters": 0}]
    assert table.census() == ((0, 0, 0), (1, 1, 0), 1)  # locks, semaphores, busy keys


def test_renew_and_release_take_any_token_of_the_key(table: LockTable) -> None:
    sem = grant(table, "s", 2)
    lock = grant(table, "k", None)
    assert table.renew("s", sem.token, 5) == 5
    assert table.renew("k", lock.token, 5) == 5
    assert table.renew("k", sem.token, 5) is None  # a token of another key
    assert table.release("s", sem.token)
    assert table.release("k", lock.token)
    assert table.grants.counts.releases == [1, 1]  # counted by the key's kind


def test_one_two_phase_enqueue_per_connection_and_key(table: LockTable) -> None:
    client = table.open_client()
    first = table.enqueue(client, "k", LEASE, None)
    assert first.holder is not None
    with pytest.raises(AlreadyEnqueued):
        table.enqueue(client, "k", LEASE, 1)  # se after e on the same key
    assert table.find_enqueued(client, "k") is first  # w and sw alike find it
    table.forget_enqueued(first)
    assert table.find_enqueued(client, "k") is None


def test_max_locks_counts_every_key_once(clock: Clock) -> None:
    serial = itertools.count(1)
    table = LockTable(clock=clock, new_token=lambda: f"{next(serial):032x}", max_locks=2)
    grant(table, "a", None)
    grant(table, "b", 2)
    assert len(table.grants.keys) == 2


def test_a_full_table_makes_room_by_forgetting_the_longest_idle_key(clock: Clock) -> None:
    serial = itertools.count(1)
    table = LockTable(clock=clock, new_token=lambda: f"{next(serial):032x}", max_locks=3)
    client = table.open_client()
    held = {}
    for key in ("a", "b", "c"):
        grant = table.acquire(client, key, LEASE, None, queue=False)
        assert isinstance(grant, Holder)
        held[key] = grant
        clock.now += 1
    assert table.release("b", held["b"].token)  # idle first
    clock.now += 1
    assert table.release("a", held["a"].token)  # idle second
    clock.now += 1
    assert isinstance(table.acquire(client, "d", LEASE, None, queue=False), Holder)
    assert set(table.grants.keys) == {"a", "c", "d"}  # b, idle the longest, made room
    assert isinstance(table.acquire(client, "e", LEASE, None, queue=False), Holder)
    assert set(table.grants.keys) == {"c", "d", "e"}
    with pytest.raises(MaxLocks):  # nothing idle left: refused
        table.acquire(client, "f", LEASE, None, queue=False)


def test_gc_forgets_only_keys_idle_long_enough_and_not_keys_used_again(clock: Clock) -> None:
    table = make_table(clock)
    client = table.open_client()
    for key in ("old", "reused", "recent"):
        grant = table.acquire(client, key, LEASE, None, queue=False)
        assert isinstance(grant, Holder)
        assert table.release(key, grant.token)
        if key == "old":
            clock.now += 10
    again = table.acquire(client, "reused", LEASE, None, queue=False)  # busy again
    assert isinstance(again, Holder)
    clock.now += 5
    assert table.gc(8) == 1
    assert set(table.grants.keys) == {"reused", "recent"}
    assert table.release("reused", again.token)  # at 15
    clock.now += 7
    assert table.gc(8) == 1  # recent, idle since 10; reused only since 15
    assert set(table.grants.keys) == {"reused"}
    clock.now += 1
    assert table.gc(8) == 1
    assert not table.grants.keys


def test_a_full_table_forgets_idle_keys_oldest_first_over_many_turns(clock: Clock) -> None:
    """Past the idle log's compaction (keys used again, logged again) and its cut-off of the
    entries it has dropped: making room and gc still forget exactly the longest-idle keys."""
    serial = itertools.count(1)
    table = LockTable(clock=clock, new_token=lambda: f"{next(serial):032x}", max_locks=500)
    client = table.open_client()

    def use(key: str) -> None:
        got = table.acquire(client, key, LEASE, None, queue=False)
        assert isinstance(got, Holder)
        assert table.release(key, got.token)
        clock.now += 0.01

    for _ in range(3):  # each key logged three times: the log compacts
        for i in range(500):
            use(f"k{i}")
    for i in range(300):  # each new key makes room: the oldest idle key goes
        use(f"new{i}")
        assert f"k{i}" not in table.grants.keys and f"k{i + 1}" in table.grants.keys, i
    assert len(table.grants.keys) == 500
    clock.now += 100
    use("last")  # makes room for itself too: k300 goes
    assert table.gc(50) == 499  # every key idle for 50 s, not the one just used
    assert set(table.grants.keys) == {"last"}


def capped_table(clock: Clock, *, locks: int = 0, waits: int = 0) -> LockTable:
    serial = itertools.count(1)
    return LockTable(
        clock=clock,
        new_token=lambda: f"{next(serial):032x}",
        max_locks=100,
        max_locks_per_connection=locks,
        max_waits_per_connection=waits,
    )


def test_max_locks_per_connection_counts_holds_and_queued_waits(clock: Clock) -> None:
    table = capped_table(clock, locks=3)
    client, other = table.open_client(), table.open_client()
    lock = table.acquire(client, "a", LEASE, None, queue=False)
    slot = table.acquire(client, "s", LEASE, 2, queue=False)
    assert isinstance(lock, Holder) and isinstance(slot, Holder)
    blocker = grant(table, "busy", None)
    waiter = table.acquire(client, "busy", LEASE, None, queue=True)  # may be granted: counts
    assert isinstance(waiter, Waiter)
    with pytest.raises(MaxLocks):
        table.acquire(client, "new", LEASE, None, queue=False)
    with pytest.raises(MaxLocks):
        table.acquire(client, "s", LEASE, 2, queue=True)
    with pytest.raises(MaxLocks):
        table.enqueue(client, "e", LEASE, None)
    assert client.enqueued == {}
    assert isinstance(table.acquire(other, "new", LEASE, None, queue=False), Holder)  # per client
    assert table.release("busy", blocker.token)  # the waiter is granted: 3 held, still full
    assert waiter.holder is not None
    with pytest.raises(MaxLocks):
        table.acquire(client, "new2", LEASE, None, queue=False)
    assert table.renew("a", lock.token, LEASE) == LEASE  # what it holds is untouched
    assert table.release("a", lock.token)
    assert isinstance(table.acquire(client, "new2", LEASE, None, queue=False), Holder)
    assert table.held == 4


def test_a_per_connection_refusal_leaves_no_unprunable_key(clock: Clock) -> None:
    table = capped_table(clock, locks=1)
    client = table.open_client()
    grant_ = table.acquire(client, "a", LEASE, None, queue=False)
    assert isinstance(grant_, Holder)
    with pytest.raises(MaxLocks):
        table.acquire(client, "b", LEASE, None, queue=False)
    with pytest.raises(MaxLocks):
        table.acquire(client, "s", LEASE, 2, queue=False)
    assert table.release("a", grant_.token)
    clock.now += 1
    # A lock's key is made only with its grant; a semaphore's was made before the refusal...
    assert set(table.grants.keys) == {"a", "s"}
    assert table.gc(0) == 2  # ...and is pruned with "a", as an idle key
    assert not table.grants.keys


def test_max_waits_per_connection_counts_queued_acquires_and_pending_enqueues(
    clock: Clock,
) -> None:
    table = capped_table(clock, waits=2)
    client = table.open_client()
    blockers = {key: grant(table, key, None) for key in ("x", "y", "z")}
    waiter = table.acquire(client, "x", LEASE, None, queue=True)
    assert isinstance(waiter, Waiter)
    parked = table.enqueue(client, "free", LEASE, None)  # granted at once, pending until `w`
    assert parked.holder is not None
    with pytest.raises(MaxWaiters):
        table.acquire(client, "y", LEASE, None, queue=True)
    with pytest.raises(MaxWaiters):
        table.enqueue(client, "z", LEASE, None)
    assert table.acquire(client, "y", LEASE, None, queue=False) is None  # try-once: no wait
    assert isinstance(table.acquire(client, "w", LEASE, None, queue=False), Holder)
    y = key_state(table, "y")
    assert y is not None and y.n_waiting == 0 and "z" not in client.enqueued
    table.forget_enqueued(parked)  # `w` collected it
    queued = table.enqueue(client, "y", LEASE, None)
    assert queued.holder is None and queued.active
    with pytest.raises(MaxWaiters):  # a queued enqueue counts once, not twice
        table.enqueue(client, "z", LEASE, None)
    assert table.release("x", blockers["x"].token)  # the waiter is granted: one wait left
    assert waiter.holder is not None
    assert table.enqueue(client, "z", LEASE, None).active


class NoScan(dict[str, Entry]):
    """A key table that fails the test if anything walks it."""

    def _scanned(self) -> AssertionError:
        return AssertionError("the key table was walked")

    def __iter__(self) -> Iterator[str]:
        raise self._scanned()

    def keys(self) -> Any:
        raise self._scanned()

    def values(self) -> Any:
        raise self._scanned()

    def items(self) -> Any:
        raise self._scanned()


def test_a_sweep_touches_only_what_expired(clock: Clock) -> None:
    table = make_table(clock, max_locks=2000)
    client = table.open_client()
    for i in range(1000):
        assert isinstance(table.acquire(client, f"long{i}", 100, None, queue=False), Holder)
    short = [grant(table, f"short{i}", 2 if i else None) for i in range(3)]  # LEASE s
    waiter = table.acquire(table.open_client(), "short0", LEASE, None, queue=True)
    assert isinstance(waiter, Waiter)
    entries = table.grants.leases.count
    assert entries == 1003
    full = table.grants.keys
    table.grants.keys = NoScan(full)
    assert table.expire() == 0  # nothing due: nothing walked, nothing popped
    assert table.grants.leases.count == entries
    clock.now += LEASE
    assert table.expire() == 3  # the three due leases, found without walking the table
    assert not any(holder.live for holder in short)
    assert waiter.holder is not None  # the waiter got the expired lock at the sweep
    assert table.grants.leases.count == entries - 3 + 1  # popped the due ones; the waiter's grant
    table.grants.keys = full
    assert len(table.stats(0)["locks"]) == 1001


def test_the_expiry_index_stays_bounded_under_churn_and_renewals(
    table: LockTable, clock: Clock
) -> None:
    held = [grant(table, f"held{i}", None) for i in range(10)]
    clients = [table.open_client() for _ in range(4)]
    for round_ in range(2500):
        grants = [
            table.acquire(c, f"churn{i}", LEASE, None, queue=False) for i, c in enumerate(clients)
        ]
        for i, got in enumerate(grants):  # released oldest first: not only the latest entry
            assert isinstance(got, Holder)
            assert table.release(f"churn{i}", got.token)
        for holder in held:
            assert table.renew(holder.key, holder.token, LEASE + round_ % 3) is not None
        clock.now += 0.001
        assert table.grants.leases.count <= 2 * table.held + 64
    clock.now += LEASE + 3
    assert table.expire() == 10
    assert table.held == 0


def test_sweeps_in_turns_expire_every_lease_once_and_keep_none_alive(clock: Clock) -> None:
    """Leases of one length run out a few at a time, many sweeps over one run of the index:
    the sweep takes them from the front, and cuts the taken ones off once they are an
    eighth of it. Each lease expires once, at its time, and none is held on to by the index
    afterwards (a taken entry keeps its holder, and its token, alive until cut off)."""
    table = make_table(clock, max_locks=5000)
    client = table.open_client()
    holders: list[Holder] = []
    for i in range(2000):
        got = table.acquire(client, f"k{i}", LEASE, None, queue=False)
        assert isinstance(got, Holder)
        holders.append(got)
        clock.now += 0.01
    start = clock.now - 2000 * 0.01
    for step in range(1, 201):  # ten leases run out at each step
        clock.now = start + LEASE + step * 0.1 - 0.005
        assert table.expire() == 10
        assert [h.live for h in holders] == [i >= 10 * step for i in range(2000)], step
        assert table.grants.leases.count == 2000 - 10 * step
        taken = sum(run.head for run in table.grants.leases.by_ttl.values())
        assert taken <= max(64, (2000 - 10 * step + taken) // 8 + 1), (step, taken)
    assert table.held == 0
    assert not table.grants.leases.by_ttl


@pytest.mark.parametrize("renewals", range(1, 140))
def test_a_sweep_that_compacts_the_index_loses_no_lease(clock: Clock, renewals: int) -> None:
    # Renewals leave stale index entries; with some count of them, the grants a sweep makes
    # to waiters (three slots expire at once) compact the index in the middle of the sweep.
    table = make_table(clock)
    slots = [grant(table, "s", 3) for _ in range(3)]  # expire at LEASE
    waiters = [table.acquire(table.open_client(), "s", LEASE, 3, queue=True) for _ in range(3)]
    other = grant(table, "b", None)
    for _ in range(renewals):
        clock.now += 0.0001
        assert table.renew("b", other.token, 2 * LEASE) == 2 * LEASE
    clock.now = LEASE
    assert table.expire() == 3
    assert not any(slot.live for slot in slots)
    assert all(isinstance(w, Waiter) and w.holder is not None for w in waiters)
    clock.now = 10 * LEASE
    assert table.expire() == 4  # b's lease and the three granted at the first sweep
    assert table.held == 0


def test_a_connection_keeps_few_released_holders_and_loses_only_live_ones(
    table: LockTable,
) -> None:
    client = table.open_client()
    previous = table.acquire(client, "k0", LEASE, None, queue=False)
    assert isinstance(previous, Holder)
    for i in range(1, 500):  # hand over to the next key: each release is not the latest grant
        got = table.acquire(client, f"k{i % 50}", LEASE, None, queue=False)
        assert isinstance(got, Holder)
        assert table.release(previous.key, previous.token)
        previous = got
        assert client.n_held == 1
        assert len(client.held) <= 2 * client.n_held + 8
    table.disconnect(client)
    assert table.grants.counts.lost_by_disconnect == [1, 0]
    assert not previous.live
    assert table.held == 0


def test_a_waiter_is_promoted_only_while_the_ownership_serves_its_key(table: LockTable) -> None:
    """A cluster member that fenced itself (or lost the key's shard) after queueing a waiter
    never grants it: the table asks the ownership at the moment of the promotion. Once the key
    is served again, the next lease sweep promotes it (nothing else would: the key is free)."""
    holder_client, waiting_client = table.open_client(), table.open_client()
    held = table.acquire(holder_client, "k", 10, None, queue=False)
    assert isinstance(held, Holder)
    waiter = table.acquire(waiting_client, "k", 10, None, queue=True)
    assert isinstance(waiter, Waiter)
    table.grants.grant_check = lambda key: b"error_unavailable\n"
    assert table.release("k", held.token)
    table.expire()
    assert waiter.holder is None and waiter.active  # still queued: the node answers it
    table.grants.grant_check = None
    table.expire()  # the sweep
    assert waiter.holder is not None and not waiter.active


@pytest.mark.parametrize("limit", [None, 3])
def test_a_long_queue_with_given_up_waiters_grants_in_order_and_stays_bounded(
    table: LockTable, limit: int | None
) -> None:
    """Hundreds of waiters, most giving up (a timeout, a closed connection): the rest
    are granted one after another in arrival order, and the queue cuts off its granted front
    as it goes; once the last waiter is granted the key holds no queue."""
    slots = 1 if limit is None else limit
    holders = [grant(table, "k", limit) for _ in range(slots)]
    clients = [table.open_client() for _ in range(600)]
    waiters: list[Waiter] = []
    for client in clients:
        got = table.acquire(client, "k", LEASE, limit, queue=True)
        assert isinstance(got, Waiter)
        waiters.append(got)
    state = key_state(table, "k")
    assert state is not None
    for i, waiter in enumerate(waiters):
        if i % 3 == 1:
            table.cancel_wait(waiter)
        elif i % 3 == 2 and i % 4:
            table.disconnect(waiter.client)
    expected = [w for i, w in enumerate(waiters) if i % 3 == 0 or (i % 3 == 2 and not i % 4)]
    assert state.n_waiting == len(expected) < len(waiters) // 2
    assert state.queue is not None
    # Given-up entries, once they are most of the queue, were dropped (not one per give-up).
    assert len(state.queue.items) < len(waiters)
    granted: list[Waiter] = []
    lengths: list[int] = []
    while holders:
        holder = holders.pop(0)
        assert table.release("k", holder.token)
        for waiter in expected:
            if waiter.holder is not None and waiter not in granted:
                granted.append(waiter)
                holders.append(waiter.holder)
        if state.queue is not None:
            lengths.append(len(state.queue.items))
    assert granted == expected  # FIFO: each grant is the earliest still waiting
    assert state.queue is None and state.n_waiting == 0  # gone with the last waiter
    assert max(lengths) <= len(waiters)  # never grows past what was queued
    assert min(lengths) < len(waiters) // 2  # its granted front is cut off as it goes


def test_held_for_counts_from_the_grant_across_renewals_and_a_sessions_end(
    table: LockTable, clock: Clock
) -> None:
    """``held_s`` from the grant, whatever its lease did since: a grant keeps no time of its
    own until its lease moves (``Holder.held_since``), so each move (a renewal with a longer
    or shorter lease, a session's close cutting it) keeps the grant's time first."""
    client = table.open_client()
    client.session = True
    renewed = table.acquire(client, "renewed", LEASE, None, queue=False)
    assert isinstance(renewed, Holder)
    clock.now += 1.0
    cut = table.acquire(client, "cut", LEASE, None, queue=False)
    assert isinstance(cut, Holder)
    clock.now += 3.0
    assert table.renew("renewed", renewed.token, 3 * LEASE, client) == 3 * LEASE
    clock.now += 2.0
    assert table.renew("renewed", renewed.token, LEASE // 2, client) == LEASE // 2
    clock.now += 1.0
    table.disconnect(client)  # a session's grants end within session_ttl_s: cut, still held
    clock.now += 1.0
    held = {entry["key"]: entry["held_s"] for entry in table.stats(0)["locks"]}
    assert held == {"renewed": 8.0, "cut": 7.0}


def test_held_for_counts_from_the_grant_across_a_take_over_and_a_detach(
    table: LockTable, clock: Clock
) -> None:
    """``stats``' ``held_s``: from the grant, not from the last move of the grant (a queued
    message's hold taken over by its run is held since the publish)."""
    held = table.acquire(table.open_client(), "q", LEASE, None, "t1", True, queue=False)
    assert isinstance(held, Holder)
    clock.now += 4.0
    taken = table.take(table.open_client(), "q", held.token, LEASE, note="t1/h", on_close=None)
    assert taken is not None and taken.held_since() == held.held_since()
    clock.now += 3.0
    assert table.hand_down("q", held.token, LEASE)
    (entry,) = table.stats(0)["locks"]
    assert entry["held_s"] == 7.0 and entry["fence"] == int(held.token[:16], 16)


def test_a_lease_granted_after_a_restore_is_swept_at_its_end(
    table: LockTable, clock: Clock
) -> None:
    """A grant restored from the journal may run longer than its lease (the journal covers a
    lease ahead; a restart across a boot gives each the longest lease recorded). A lease of the
    same length granted after it still expires at the sweep after its own end: its waiter is
    granted then, not once the restored one's longer time is over."""
    recorded = RecordedGrant("0" * 31 + "1", "restored", 1, False, LEASE, 0, False, None, None)
    recorded.left = 3 * LEASE
    assert table.restore_all([recorded])[0] == 1
    holder = grant(table, "k", None)  # a lease of the same length, never renewed
    waiter = table.acquire(table.open_client(), "k", LEASE, None, queue=True)
    assert isinstance(waiter, Waiter)
    clock.now += LEASE + 1
    assert table.expire() == 1
    assert not holder.live
    assert waiter.holder is not None and waiter.holder.live
    clock.now += 2 * LEASE
    assert table.expire() == 2  # the restored grant's end; the waiter's own lease


class FailingTokens:
    """Tokens that cannot be issued while ``failing`` (a fence ceiling that cannot be stored)."""

    def __init__(self) -> None:
        self.failing = False
        self.serial = itertools.count(1)

    def __call__(self) -> str:
        if self.failing:
            raise FenceStateError("the next fence ceiling is not stored yet")
        return f"{next(self.serial):032x}"


def test_a_waiter_no_token_can_be_issued_for_is_granted_at_a_later_sweep(clock: Clock) -> None:
    """A release, or a close, that frees a key while no token can be issued is done all the
    same (the release answered as such, every grant of the closed connection freed); the
    waiter stays at the head of the queue and is granted at the first sweep that can issue
    its token."""
    tokens = FailingTokens()
    table = LockTable(clock=clock, new_token=tokens, max_locks=100)
    holder_client = table.open_client()
    first = table.acquire(holder_client, "k", LEASE, None, queue=False)
    second = table.acquire(holder_client, "other", LEASE, None, queue=False)
    assert isinstance(first, Holder) and isinstance(second, Holder)
    woken: list[Waiter] = []
    waiters: list[Waiter] = []
    for _ in range(2):
        waiter = table.acquire(table.open_client(), "k", LEASE, None, queue=True)
        assert isinstance(waiter, Waiter)
        waiter.wake = woken.append
        waiters.append(waiter)
    tokens.failing = True
    assert table.release("k", first.token)
    assert waiters[0].active and waiters[0].holder is None  # still first in line
    table.expire()  # still no token: nothing granted, nothing raised
    tokens.failing = False
    table.expire()
    assert woken == [waiters[0]] and waiters[0].holder is not None
    tokens.failing = True
    table.disconnect(table.open_client())  # a close that frees nothing
    table.disconnect(waiters[0].client)  # frees "k" (its waiter gets no token yet)
    table.disconnect(holder_client)  # frees "other"
    assert not table.is_busy("other")
    tokens.failing = False
    table.expire()
    assert woken == waiters
