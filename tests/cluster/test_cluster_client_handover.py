"""The client through a cluster's hand-overs (issue 27, acceptance 4), against real ``dflockd``
member processes on a real etcd: acquires with a ``lock_timeout`` of some seconds keep running,
on both faces, while shards move between the members (a member joins and `rebalance` moves
shards to it, shards are pinned onto another member, a member leaves gracefully): none fails
with `ServerUnavailable` (the client waits through each hand-over, with backoff); and a member
that stops answering (SIGSTOP) makes the client read the shard map again, so the next acquire
goes to the member that serves the key now."""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from celery_dflock.client import AsyncDistributedLock, DistributedLock
from celery_dflock.client.clients import AsyncClient, Client
from celery_dflock.client.errors import DflockError, ServerUnavailable
from dflockd_server.cluster.shardmap import shard_id
from tests.support.etcd import EtcdServer
from tests.support.fleet import Fleet
from tests.support.shards import pin
from tests.support.waiting import wait_until

WAIT_S = 60.0
LOCK_TIMEOUT_S = 30
HELD = "handover:held"
SIBLING = next(
    f"handover:sibling{i}"
    for i in range(10**6)
    if shard_id(f"handover:sibling{i}") == shard_id(HELD)
)
"""Another key of the held key's shard."""
KEYS = [*(f"handover:{i}" for i in range(24)), HELD, SIBLING]
HOLD_S = 8.0
"""How long the held key is held while its shard is moved (its move waits for the release)."""
PACE_S = 0.02
"""Each acquirer's pause between two acquires: hand-overs last far longer, and acquirers
without one kept both of CI's cores busy for the whole test."""


@pytest.fixture
def fleet(etcd_server: EtcdServer, etcd_prefix: str, tmp_path: Path) -> Iterator[Fleet]:
    """Members as users start them: defaults as shipped, but no restart grace."""
    with Fleet.on(etcd_server, etcd_prefix, tmp_path, "--restart-grace", "0") as made:
        yield made


def why_not(lock: DistributedLock | AsyncDistributedLock, began: float) -> str:
    """An acquire's key, and if it was not granted, where, after how long and why."""
    why = lock.handover or "timed out there: busy"
    return f"{lock.key} on {lock.server[1]} after {time.monotonic() - began:.1f} s: {why}"


class Workload:
    """Acquirers on both faces, each taking and releasing the keys in turn with a
    ``lock_timeout`` of `LOCK_TIMEOUT_S`, until told to stop; every outcome is counted."""

    def __init__(self, seeds: list[tuple[str, int]], threads: int, tasks: int) -> None:
        self.seeds = seeds
        self.stop = threading.Event()
        self.guard = threading.Lock()
        self.granted = 0
        self.not_granted: list[str] = []
        """Each acquire not granted: its key, where, after how long and why (`why_not`)."""
        self.errors: list[BaseException] = []
        self.progress = threading.Condition(self.guard)
        self.workers = [
            threading.Thread(target=self.blocking, args=(i,), daemon=True) for i in range(threads)
        ]
        self.workers.append(threading.Thread(target=self.asyncio, args=(tasks,), daemon=True))

    def record(self, key: str, granted: bool | None, error: BaseException | None = None) -> None:
        with self.progress:
            if error is not None:
                self.errors.append(error)
            elif granted:
                self.granted += 1
            else:
                self.not_granted.append(key)
            self.progress.notify_all()

    def blocking(self, index: int) -> None:
        with Client(
            self.seeds, sharding_strategy="cluster", acquire_timeout_s=LOCK_TIMEOUT_S
        ) as client:
            turn = index
            while not self.stop.is_set():
                key = KEYS[turn % len(KEYS)]
                turn += 1
                lock = client.lock(key)
                began = time.monotonic()
                try:
                    granted = lock.acquire()
                    if granted:
                        lock.release()
                except DflockError as exc:
                    self.record(key, None, exc)
                else:
                    self.record(key if granted else why_not(lock, began), granted)
                self.stop.wait(PACE_S)

    def asyncio(self, tasks: int) -> None:
        async def one(client: AsyncClient, index: int) -> None:
            turn = index * 5
            while not self.stop.is_set():
                key = KEYS[turn % len(KEYS)]
                turn += 1
                lock = client.lock(key)
                began = time.monotonic()
                try:
                    granted = await lock.acquire()
                    if granted:
                        await lock.release()
                except DflockError as exc:
                    self.record(key, None, exc)
                else:
                    self.record(key if granted else why_not(lock, began), granted)
                await asyncio.sleep(PACE_S)

        async def run() -> None:
            async with AsyncClient(
                self.seeds, sharding_strategy="cluster", acquire_timeout_s=LOCK_TIMEOUT_S
            ) as client:
                await asyncio.gather(*(one(client, i) for i in range(tasks)))

        asyncio.run(run())

    def __enter__(self) -> Workload:
        for worker in self.workers:
            worker.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for worker in self.workers:
            worker.join(LOCK_TIMEOUT_S + 30)

    def stop_for(self, seconds: float) -> None:
        """Let the workload run ``seconds`` (a stop that does not come)."""
        assert not self.stop.wait(seconds)

    def advance(self, count: int) -> None:
        """Wait until ``count`` more acquires have ended (granted or not)."""
        with self.progress:
            goal = self.granted + len(self.not_granted) + len(self.errors) + count
            ok = self.progress.wait_for(
                lambda: self.granted + len(self.not_granted) + len(self.errors) >= goal,
                timeout=WAIT_S,
            )
        assert ok, f"the acquirers did not go on: {self.granted} granted, errors {self.errors}"


@pytest.mark.timeout(400)
def test_no_acquire_fails_with_server_unavailable_during_hand_overs(fleet: Fleet) -> None:
    """Issue 27, acceptance 4: a join + rebalance, pins of the hot keys' shards onto the other
    member and back, and a graceful leave, all under load: every acquire is granted (the keys
    are only ever held for a moment), none raises. (Before: ``ServerUnavailable: the cluster
    redirected this acquire 8 times``.)"""
    first = fleet.start()
    fleet.wait_settled("the first member serving every shard")
    with Workload(fleet.seeds(), threads=3, tasks=4) as load:
        load.advance(50)
        second = fleet.start()  # joins with no shard
        fleet.even_out()
        load.advance(50)
        for round_ in range(2):
            for key in KEYS[round_::2]:
                target = second if fleet.owner(key) == first.advertise else first
                pin(fleet.etcd, fleet.prefix, shard_id(key), target.advertise)
            fleet.wait_settled(f"pin round {round_} done")
            load.advance(50)
        # A held key's shard is moved: the move waits for its release, while the acquirers
        # of that key (queued on the old member, answered error_moved when the move begins)
        # and of the other keys of that shard are sent between the two members meanwhile.
        with (
            Client(fleet.seeds(), sharding_strategy="cluster") as holder,
            holder.lock(HELD) as held,
        ):
            target = second if fleet.owner(HELD) == first.advertise else first
            pin(fleet.etcd, fleet.prefix, shard_id(HELD), target.advertise)
            wait_until(
                lambda: shard_id(HELD) in fleet.view().shard_map.moves_in_progress(),
                timeout=WAIT_S,
                what="the held key's shard moving",
            )
            load.stop_for(HOLD_S)  # the workload goes on meanwhile
            assert held.owned()
        fleet.wait_settled("the held key's shard moved after its release")
        load.advance(50)
        third = fleet.start()
        fleet.even_out()
        load.advance(50)
        third.proc.send_signal(signal.SIGTERM)  # a graceful leave: it hands its shards over
        assert third.proc.wait(WAIT_S) == 0
        wait_until(
            lambda: fleet.settled() and third.advertise not in fleet.view().shard_map.counts(),
            timeout=WAIT_S,
            what="the third member's shards taken over",
        )
        load.advance(100)
    unavailable = [e for e in load.errors if isinstance(e, ServerUnavailable)]
    assert unavailable == [], unavailable[:3]
    assert load.errors == []
    assert load.not_granted == []
    assert load.granted >= 350


@pytest.mark.timeout(300)
def test_a_member_that_stops_answering_makes_the_client_read_the_map_again(
    fleet: Fleet,
) -> None:
    """A member is SIGSTOPped: the acquire sent to it gets no reply and times out; the client
    reads the shard map again (it kept the stale one before, and every later acquire of the
    key went to the stopped member and timed out too), so once another member has taken the
    shard over, the next acquire of the key is granted there."""
    a = fleet.start()
    fleet.wait_settled("the first member serving every shard")
    b = fleet.start()
    fleet.even_out()
    key = fleet.key_of(a, "frozen:")
    # A short lease: b takes the shard over once a's etcd lease and the longest lease a granted
    # ran out, and the test is about what the client does after that, not about the wait.
    with Client(
        [b.address], sharding_strategy="cluster", acquire_timeout_s=0, lease_ttl_s=3
    ) as client:
        with client.lock(key) as lock:
            assert lock.server == a.address  # the map cached: the key on a
        with a.paused():
            # b takes a's shards over once a's etcd lease and its longest lease ran out
            wait_until(
                lambda: fleet.owner(key) == b.advertise,
                timeout=WAIT_S,
                what="b taking the stopped member's shards over",
            )
            outcomes: list[object] = []
            for _ in range(2):
                lock = client.lock(key)
                try:
                    outcomes.append(lock.acquire())
                except ServerUnavailable as exc:
                    outcomes.append(exc)
                    continue
                if outcomes[-1] is True:
                    assert lock.server == b.address
                    lock.release()
                    break
            assert outcomes[-1] is True, outcomes
