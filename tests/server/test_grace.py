"""Restart grace: the table's rule on an injected clock, the start-up decision, and the record
of the longest lease kept beside the fence state file (issue 14, point 1)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from dflockd_server.config import Config, ConfigError
from dflockd_server.fence import FenceStateError
from dflockd_server.grace import (
    LeaseRecord,
    decide_grace,
    grace_path,
    read_longest_lease,
    write_longest_lease,
)
from dflockd_server.leasebound import LeaseBound
from dflockd_server.table import Holder, LockTable, Waiter
from dflockd_server.testing import ServerThread
from tests.support.clock import FakeClock as Clock
from tests.support.wire import Wire

LEASE = 10
GRACE = 5.0


def make_table(clock: Clock, grace_s: float, noted: list[int] | None = None) -> LockTable:
    serial = itertools.count(1)

    def note(lease: int) -> int:
        if noted is not None:
            noted.append(lease)
        return lease

    return LockTable(
        clock=clock,
        new_token=lambda: f"{next(serial):032x}",
        max_locks=100,
        grace_s=grace_s,
        note_lease=note,
    )


def test_no_key_is_granted_during_the_grace_and_waiters_go_in_fifo_order_after() -> None:
    clock = Clock(100.0)
    table = make_table(clock, GRACE)
    woken: list[str] = []
    assert table.acquire(table.open_client(), "k", LEASE, None, queue=False) is None  # try once
    first = table.acquire(table.open_client(), "k", LEASE, None, queue=True)
    second = table.acquire(table.open_client(), "k", LEASE, None, queue=True)
    sem = table.acquire(table.open_client(), "s", LEASE, 2, queue=True)
    assert isinstance(first, Waiter) and isinstance(second, Waiter) and isinstance(sem, Waiter)
    first.wake = lambda w: woken.append("first")
    second.wake = lambda w: woken.append("second")
    sem.wake = lambda w: woken.append("sem")
    assert table.stats(0)["grace_remaining_s"] == GRACE
    clock.now += GRACE - 0.001
    assert table.expire() == 0
    assert woken == [] and table.grants.in_grace
    assert table.stats(0)["grace_remaining_s"] == pytest.approx(0.001)
    clock.now += 0.001
    table.expire()
    assert not table.grants.in_grace
    assert sorted(woken) == ["first", "sem"]
    assert first.holder is not None and second.holder is None  # FIFO: the first in line
    assert table.stats(0)["grace_remaining_s"] == 0.0
    assert table.grants.counts.timeouts == [1, 0]


def test_an_acquire_arriving_as_the_grace_ends_queues_behind_the_earlier_waiters() -> None:
    clock = Clock(100.0)
    table = make_table(clock, GRACE)
    waiter = table.acquire(table.open_client(), "k", LEASE, None, queue=True)
    assert isinstance(waiter, Waiter)
    clock.now += GRACE  # no sweep yet: the acquire itself ends the grace
    late = table.acquire(table.open_client(), "k", LEASE, None, queue=False)
    assert late is None
    assert waiter.holder is not None
    assert len(waiter.state.holders) == 1


def test_two_phase_enqueue_during_the_grace_is_queued() -> None:
    clock = Clock(100.0)
    table = make_table(clock, GRACE)
    waiter = table.enqueue(table.open_client(), "k", LEASE, None)
    assert waiter.holder is None and waiter.active
    clock.now += GRACE
    got = table.acquire(table.open_client(), "other", LEASE, None, queue=False)
    assert isinstance(got, Holder)
    assert waiter.holder is not None


def test_renew_and_release_of_unknown_tokens_fail_during_the_grace() -> None:
    table = make_table(Clock(100.0), GRACE)
    assert table.renew("k", "0" * 32, LEASE) is None
    assert not table.release("k", "0" * 32)


def test_a_disconnected_waiter_is_not_granted_at_the_end_of_the_grace() -> None:
    clock = Clock(100.0)
    table = make_table(clock, GRACE)
    gone = table.open_client()
    table.acquire(gone, "k", LEASE, None, queue=True)
    stays = table.acquire(table.open_client(), "k", LEASE, None, queue=True)
    assert isinstance(stays, Waiter)
    table.disconnect(gone)
    assert stays.holder is None  # still in the grace
    clock.now += GRACE
    table.expire()
    assert stays.holder is not None


@pytest.mark.parametrize("kind", ["lock", "hold", "semaphore"])
def test_a_try_once_acquire_in_the_grace_leaves_no_key_that_gc_cannot_prune(kind: str) -> None:
    """A try-once acquire of a new key in the grace is refused (``timeout``); the key it made
    is idle, so gc prunes it once it has been idle long enough (it used to stay for good,
    and a table filled so refused every new key)."""
    clock = Clock(100.0)
    table = make_table(clock, GRACE)
    client = table.open_client()
    for i in range(3):
        key = f"probe{i}"
        if kind == "hold":
            got = table.acquire(client, key, LEASE, None, "note", queue=False)
        else:
            got = table.acquire(client, key, LEASE, 2 if kind == "semaphore" else None, queue=False)
        assert got is None
    clock.now += GRACE
    assert table.grace_remaining() == 0
    assert table.gc(GRACE) == 3
    assert not table.grants.keys


def test_no_grace_grants_at_once() -> None:
    table = make_table(Clock(100.0), 0.0)
    assert not table.grants.in_grace
    assert isinstance(table.acquire(table.open_client(), "k", LEASE, None, queue=False), Holder)
    assert table.stats(0)["grace_remaining_s"] == 0.0


def test_a_longer_lease_is_noted_before_it_is_granted_or_renewed() -> None:
    noted: list[int] = []
    table = make_table(Clock(100.0), 0.0, noted)
    holder = table.acquire(table.open_client(), "k", LEASE, None, queue=False)
    assert isinstance(holder, Holder)
    table.acquire(table.open_client(), "j", LEASE, None, queue=False)
    assert table.renew("k", holder.token, 20) == 20
    assert table.renew("k", holder.token, 15) == 15
    assert noted == [LEASE, 20]


def test_a_failed_note_grants_nothing() -> None:
    def refuse(lease: int) -> int:
        raise FenceStateError("disk full")

    table = LockTable(
        clock=Clock(100.0), new_token=lambda: "0" * 32, max_locks=10, note_lease=refuse
    )
    with pytest.raises(FenceStateError):
        table.acquire(table.open_client(), "k", LEASE, None, queue=False)
    assert table.held == 0 and not table.is_busy("k")


def test_a_recording_overtaken_by_a_longer_bound_on_the_loop_is_no_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A parked lease's recording that ends after ``note_now`` recorded a longer bound on the
    loop has nothing to raise: its lease is covered, and nothing failed (it logged "recording
    the lease bound failed", with no error to show)."""

    async def scenario() -> list[bytes | None]:
        gate = threading.Event()
        executor = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        executor.submit(gate.wait)  # the recording waits behind it
        bound = LeaseBound(LeaseRecord(None, 10.0, cap=300), asyncio.get_running_loop(), executor)
        table = make_table(Clock(100.0), 0.0)
        bound.table = table
        answers: list[bytes | None] = []
        bound.wait_for(20, answers.append)
        table.grants.lease_noted = bound.note_now(40)  # as the table does, on the loop
        gate.set()
        for _ in range(500):
            if answers:
                break
            await asyncio.sleep(0.01)
        executor.shutdown()
        return answers

    with caplog.at_level("ERROR", logger="dflockd_server"):
        assert asyncio.run(scenario()) == [None]
    assert not caplog.records


# ------------------------------------------------------------------ the start-up decision
def test_decision_without_a_state_file(tmp_path: Path) -> None:
    fixed = Config(port=7000, max_lease_ttl_s=40)
    assert decide_grace(fixed, None, False).seconds == 40
    assert "max_lease_ttl_s" in decide_grace(fixed, None, False).why
    assert decide_grace(Config(port=0), None, False).seconds == 0
    assert decide_grace(Config(port=7000, restart_grace_s=0.0), None, False).seconds == 0


def test_decision_with_a_state_file(tmp_path: Path) -> None:
    assert decide_grace(Config(fence_state_file=str(tmp_path / "f"), port=0), 33, True).seconds == 0
    cfg = Config(port=7000, fence_state_file=str(tmp_path / "fence"), max_lease_ttl_s=60)
    assert decide_grace(cfg, None, False).seconds == 0  # first start with this file
    assert decide_grace(cfg, None, True).seconds == 60  # fence file without a record
    assert decide_grace(cfg, 0, True).seconds == 0  # the previous run granted nothing
    assert decide_grace(cfg, 33, True).seconds == 33
    assert decide_grace(cfg, 90, True).seconds == 90  # an earlier, higher cap still binds


def test_the_record_rises_in_few_writes_and_survives_a_restart(tmp_path: Path) -> None:
    path = grace_path(str(tmp_path / "fence"))
    record = LeaseRecord(path, 0.0, cap=300)
    assert read_longest_lease(path) == 0
    assert record.note(33) == 33
    assert read_longest_lease(path) == 33
    assert record.note(34) == 66  # doubling: a run writes the record only a few times
    assert record.note(50) == 66
    assert record.note(299) == 299
    assert record.note(300) == 300
    assert read_longest_lease(path) == 300
    # A start in its grace carries the obligation forward before granting anything.
    again = LeaseRecord(path, 12.5, cap=10)
    assert again.longest == 13 and read_longest_lease(path) == 13


def test_a_damaged_record_is_an_error_that_says_what_to_do(tmp_path: Path) -> None:
    path = tmp_path / "fence.grace"
    path.write_text("garbage")
    with pytest.raises(FenceStateError, match="fix or remove it") as exc:
        read_longest_lease(str(path))
    assert "a grace of --max-lease-ttl / DFLOCKD_MAX_LEASE_TTL_S" in str(exc.value)
    write_longest_lease(str(path), 7)
    assert read_longest_lease(str(path)) == 7


def test_the_default_lease_must_fit_under_the_max_lease() -> None:
    with pytest.raises(ConfigError, match="max-lease-ttl"):
        Config(default_lease_ttl_s=40, max_lease_ttl_s=30)


# ------------------------------------------------------------------ on a real socket
SOCKET_GRACE_S = 3.0
"""The restart grace of the server started below (from its start)."""


def test_a_waiter_queued_in_the_grace_is_granted_when_it_ends(
    dflock_server_factory: Callable[..., ServerThread],
) -> None:
    # Two connections and four requests must land inside the grace, counted from the server's
    # start: 3 s leaves room for a loaded CI machine (1 s did not always). The test waits the
    # grace out (about 3 s, was 1 s), and no longer: the sweep that ends it runs every 0.1 s,
    # so it ends within 0.1 s of its time whatever the sweeps' phase (with 1 s sweeps, up to
    # a second late).
    server = dflock_server_factory(restart_grace_s=SOCKET_GRACE_S, lease_sweep_interval_s=0.1)
    with Wire(server.address) as w, Wire(server.address) as other:
        assert w.req("l", "k", "0") == "timeout"  # try once: busy during the grace
        stats = json.loads(w.req("stats").split(" ", 1)[1])
        assert 0 < stats["grace_remaining_s"] <= SOCKET_GRACE_S
        assert w.req("n", "k", "0" * 32) == "error"  # unknown tokens, as ever
        assert other.req("e", "k", "5") == "queued"
        reply = w.req("l", "k2", "30").split()  # waits out the grace, then granted
        assert reply[0] == "ok"
        assert other.req("w", "k", "30").split()[0] == "ok"
        assert json.loads(w.req("stats").split(" ", 1)[1])["grace_remaining_s"] == 0
