"""Client sessions across a cluster's moves, against real ``dflockd --cluster`` member
processes on a real etcd: a key held by a session alone (its keep-alives are its only
renewals) while its shard moves and its member is paused, resumed or restarted. Whatever
happens, the rival that gets the key finds the old holder already knowing its loss."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from celery_dflock.client.clients import Client
from dflockd_server.cluster.etcd import EtcdClient
from dflockd_server.cluster.membership import read_view
from dflockd_server.cluster.ops import pin, unpin
from dflockd_server.cluster.shardmap import SHARD_COUNT, shard_id
from tests.support.etcd import EtcdServer
from tests.support.ports import free_port
from tests.support.processes import paused
from tests.support.servers import clean_env, dflockd_executable
from tests.support.waiting import wait_until

WAIT_S = 60.0
LEASE_S = 9
"""The holder's lease: longer than three of its session's keep-alives, so they alone keep it."""
SESSION_S = 3
MEMBER_LEASE_S = 2
"""The members' etcd lease: a paused member is seen gone after about this."""


class Member:
    """A ``dflockd --cluster`` member process with short leases."""

    def __init__(self, etcd_url: str, prefix: str, state: Path) -> None:
        port = free_port()
        self.advertise = f"127.0.0.1:{port}"
        self.address = ("127.0.0.1", port)
        self.log_path = state / f"member-{port}.log"
        self.args = [
            dflockd_executable(), "--host", "127.0.0.1", "--port", str(port),
            "--advertise", self.advertise,
            "--cluster", f"etcd://{etcd_url.removeprefix('http://')}{prefix}",
            "--cluster-lease-ttl", str(MEMBER_LEASE_S), "--max-lease-ttl", str(LEASE_S + 1),
            "--default-lease-ttl", str(LEASE_S),
            "--state-dir", str(state / f"state-{port}"), "--restart-grace", "0",
        ]  # fmt: skip
        self.proc = self._start()

    def _start(self) -> subprocess.Popen[bytes]:
        with self.log_path.open("ab") as log:
            return subprocess.Popen(
                self.args,
                env=clean_env({}),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
        self.proc.wait(30)


@dataclass
class Fleet:
    etcd: EtcdClient
    prefix: str
    state: Path
    etcd_url: str
    members: list[Member] = field(default_factory=list[Member])

    def start(self) -> Member:
        member = Member(self.etcd_url, self.prefix, self.state)
        self.members.append(member)
        wait_until(
            lambda: member.advertise in read_view(self.etcd, self.prefix).members,
            timeout=WAIT_S,
            what=f"{member.advertise} registered",
        )
        return member

    def settled(self) -> bool:
        shard_map = read_view(self.etcd, self.prefix).shard_map
        return len(shard_map) == SHARD_COUNT and not shard_map.moves_in_progress()

    def owner(self, key: str) -> str:
        return read_view(self.etcd, self.prefix).shard_map[shard_id(key)].current

    def split_of(self, key: str) -> str:
        """The node ``key``'s shard is split to ("" when none)."""
        return read_view(self.etcd, self.prefix).shard_map[shard_id(key)].split

    def seeds(self) -> list[tuple[str, int]]:
        return [m.address for m in self.members]


@pytest.fixture
def fleet(etcd_server: EtcdServer, etcd_prefix: str, tmp_path: Path) -> Iterator[Fleet]:
    made = Fleet(etcd_server.client(), etcd_prefix.rstrip("/"), tmp_path, etcd_server.url)
    yield made
    for member in made.members:
        member.stop()


def two_members(fleet: Fleet) -> tuple[Member, Member]:
    a, b = fleet.start(), fleet.start()
    wait_until(fleet.settled, timeout=WAIT_S, what="the map settled over two members")
    return a, b


def key_of(fleet: Fleet, member: Member, stem: str) -> str:
    return next(f"{stem}{i}" for i in range(10**6) if fleet.owner(f"{stem}{i}") == member.advertise)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pause_s", [SESSION_S + 2, MEMBER_LEASE_S + LEASE_S + 6])
def test_a_member_paused_past_the_session_mid_move_gives_the_key_to_no_one_before_its_holder_knows(
    fleet: Fleet, pause_s: float
) -> None:
    """A holds a key by its session alone; its shard is pinned to B (the move waits for the
    key); A is stopped past the session's time (shorter than the failover, then longer), then
    resumed. The rival that gets the key (from B) finds the holder knowing its loss."""
    a, b = two_members(fleet)
    key = key_of(fleet, a, "paused:")
    seeds = fleet.seeds()
    with (
        Client(seeds, sharding_strategy="cluster", session_ttl_s=SESSION_S) as holding,
        Client(seeds, sharding_strategy="cluster", acquire_timeout_s=WAIT_S) as rival,
    ):
        held = holding.lock(key, lease_ttl_s=LEASE_S)
        assert held.acquire() and held.server == a.address
        pin(fleet.etcd, fleet.prefix, shard_id(key), b.advertise)
        time.sleep(SESSION_S)  # kept by keep-alives only meanwhile (no rival asks yet)
        assert held.owned()
        with paused(a.proc.pid):
            time.sleep(pause_s)
        taken = rival.lock(key, lease_ttl_s=LEASE_S)
        assert taken.acquire(), "the rival never got the key"
        try:
            assert not held.owned(), f"two holders: {held!r} still owns it, {taken!r} got it"
            assert held.lost
            assert taken.server == b.address
        finally:
            taken.release()
            held.release()  # lost: closes its connection
    unpin(fleet.etcd, fleet.prefix, shard_id(key))


@pytest.mark.timeout(300)
def test_etcd_paused_during_a_sessions_life_gives_the_key_to_no_one_before_its_holder_knows(
    fleet: Fleet, etcd_server: EtcdServer
) -> None:
    """etcd stopped (SIGSTOP) past the members' lease while a key is held by a session alone:
    the members are cut off, so they keep nothing alive; once etcd is back, the rival that
    gets the key finds the holder knowing its loss (or the holder still holds it, renewed, and
    the rival waits)."""
    a, _ = two_members(fleet)
    key = key_of(fleet, a, "stalled:")
    seeds = fleet.seeds()
    with (
        Client(seeds, sharding_strategy="cluster", session_ttl_s=SESSION_S) as holding,
        Client(seeds, sharding_strategy="cluster", acquire_timeout_s=WAIT_S) as rival,
    ):
        held = holding.lock(key, lease_ttl_s=LEASE_S)
        assert held.acquire() and held.server == a.address
        with paused(etcd_server.pid):
            time.sleep(MEMBER_LEASE_S + SESSION_S + 1)
        taken = rival.lock(key, lease_ttl_s=LEASE_S)
        assert taken.acquire(), "the rival never got the key"
        try:
            assert not held.owned(), f"two holders: {held!r} still owns it, {taken!r} got it"
        finally:
            taken.release()
            held.release()  # lost: closes its connection


@pytest.mark.timeout(300)
def test_a_member_killed_and_restarted_with_its_journal_gives_a_session_key_to_no_one_early(
    fleet: Fleet,
) -> None:
    """A member killed (SIGKILL) and restarted in place, its lease journal kept, while a key is
    held on it by a session alone: the holder either keeps it (renewed by token on the new
    run) or knows its loss before any rival is granted it."""
    a, _ = two_members(fleet)
    key = key_of(fleet, a, "restarted:")
    seeds = fleet.seeds()
    with (
        Client(seeds, sharding_strategy="cluster", session_ttl_s=SESSION_S) as holding,
        Client(seeds, sharding_strategy="cluster", acquire_timeout_s=WAIT_S) as rival,
    ):
        held = holding.lock(key, lease_ttl_s=LEASE_S)
        assert held.acquire() and held.server == a.address
        time.sleep(SESSION_S)  # kept by keep-alives only
        a.proc.kill()
        a.proc.wait(30)
        a.proc = a._start()  # pyright: ignore[reportPrivateUsage]
        taken = rival.lock(key, lease_ttl_s=LEASE_S, acquire_timeout_s=LEASE_S * 2)
        if not taken.acquire():  # the holder kept it: renewed by token on the new run
            assert held.owned() and held.renew(), "nobody holds the key, yet the rival waited"
            held.release()
            assert taken.acquire(), "the rival never got the key"
        try:
            assert not held.owned(), f"two holders: {held!r} still owns it, {taken!r} got it"
        finally:
            taken.release()
            held.release()  # lost: closes its connection


def sibling_of(key: str, stem: str) -> str:
    """Another key of ``key``'s shard."""
    return next(f"{stem}{i}" for i in range(10**6) if shard_id(f"{stem}{i}") == shard_id(key))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pause_s", [SESSION_S + 2, MEMBER_LEASE_S + LEASE_S + 6])
def test_the_splits_target_paused_past_the_session_gives_its_asked_key_to_no_one_early(
    fleet: Fleet, pause_s: float
) -> None:
    """A shard split from A to B (A holds one of its keys); B grants another key of it on A's
    ticket to a session holder, then is stopped past the session's time (shorter than the
    wait for its leases, then longer) and resumed. The rival that gets that key (from B, or
    from A once it dropped the split) finds the holder knowing its loss."""
    a, b = two_members(fleet)
    pinned = key_of(fleet, a, "split:")
    crossed = sibling_of(pinned, "crossed:")
    seeds = fleet.seeds()
    with (
        Client(seeds, sharding_strategy="cluster", acquire_timeout_s=WAIT_S) as keeper,
        Client(seeds, sharding_strategy="cluster", session_ttl_s=SESSION_S) as holding,
        Client(seeds, sharding_strategy="cluster", acquire_timeout_s=WAIT_S) as rival,
        keeper.lock(pinned, lease_ttl_s=LEASE_S),
    ):
        pin(fleet.etcd, fleet.prefix, shard_id(pinned), b.advertise)
        wait_until(
            lambda: fleet.split_of(pinned) == b.advertise,
            timeout=WAIT_S,
            what="a splits the shard towards b",
        )
        held = holding.lock(crossed, lease_ttl_s=LEASE_S, acquire_timeout_s=WAIT_S)
        assert held.acquire() and held.server == b.address
        time.sleep(SESSION_S)  # kept by keep-alives only
        assert held.owned()
        with paused(b.proc.pid):
            time.sleep(pause_s)
        taken = rival.lock(crossed, lease_ttl_s=LEASE_S)
        assert taken.acquire(), "the rival never got the key"
        try:
            assert not held.owned(), f"two holders: {held!r} still owns it, {taken!r} got it"
            assert held.lost
        finally:
            taken.release()
            held.release()  # lost: closes its connection
    unpin(fleet.etcd, fleet.prefix, shard_id(pinned))


@pytest.mark.timeout(300)
def test_a_member_leaving_gracefully_gives_a_session_key_to_no_one_before_its_holder_knows(
    fleet: Fleet,
) -> None:
    """A member told to stop (SIGTERM: drain, then leave) while a key is held on it by a
    session alone: the rival that gets the key (from the heir) finds the holder knowing its
    loss, and a fence above the holder's."""
    a, b = two_members(fleet)
    key = key_of(fleet, a, "leaving:")
    seeds = fleet.seeds()
    with (
        Client(seeds, sharding_strategy="cluster", session_ttl_s=SESSION_S) as holding,
        Client(seeds, sharding_strategy="cluster", acquire_timeout_s=WAIT_S) as rival,
    ):
        held = holding.lock(key, lease_ttl_s=LEASE_S)
        assert held.acquire() and held.server == a.address
        fence = held.fence
        assert fence is not None
        time.sleep(SESSION_S)  # kept by keep-alives only
        a.proc.terminate()
        taken = rival.lock(key, lease_ttl_s=LEASE_S)
        assert taken.acquire(), "the rival never got the key"
        try:
            assert not held.owned(), f"two holders: {held!r} still owns it, {taken!r} got it"
            assert taken.server == b.address
            assert (taken.fence or 0) > fence
        finally:
            taken.release()
            held.release()  # lost: closes its connection


@dataclass
class Belief:
    """One grant as its holder saw it: when asked and granted, the last moment it still
    believed it owned the key (``owned()`` True), and when it sent its release."""

    key: str
    who: str
    fence: int
    asked_t: float
    granted_t: float
    owned_t: float
    released_t: float


def overlapping_beliefs(beliefs: list[Belief]) -> list[str]:
    """Pairs where a holder certainly granted first (its grant was in before the other asked)
    still believed it owned the key after the other's grant arrived, before the other let go:
    two holders at that moment, each told by the servers."""
    found: list[str] = []
    for first in beliefs:
        for second in beliefs:
            if (
                first.key == second.key
                and first.granted_t < second.asked_t
                and second.granted_t < first.owned_t < second.released_t
            ):
                found.append(f"{first} still owned after {second}'s grant")
    return found


def fences_out_of_order(beliefs: list[Belief]) -> list[str]:
    """Pairs of grants of one key in certain order (the first was in before the second was
    asked for) whose fences do not rise: across every transfer of the key's shard."""
    return [
        f"{second} after {first}"
        for first in beliefs
        for second in beliefs
        if first.key == second.key
        and first.granted_t < second.asked_t
        and first.fence >= second.fence
    ]


@pytest.mark.timeout(600)
def test_session_holders_under_random_moves_pauses_and_restarts_never_overlap(
    fleet: Fleet, etcd_server: EtcdServer
) -> None:
    """Holders keeping their keys by their sessions alone, while shards are pinned and
    unpinned, members paused past the session's time or killed and restarted with their
    journals, and etcd paused: no holder still believes it owns a key after another was
    granted it."""
    rng = random.Random(int(os.environ.get("RED_SEED", "7")))
    members = [fleet.start() for _ in range(3)]
    wait_until(fleet.settled, timeout=WAIT_S, what="the map settled over three members")
    keys = [f"mixed:{i}" for i in range(6)]
    beliefs: list[Belief] = []
    errors: list[BaseException] = []
    guard = threading.Lock()
    stop = threading.Event()

    def holder(index: int) -> None:
        local = random.Random(index)
        with Client(
            fleet.seeds(),
            sharding_strategy="cluster",
            session_ttl_s=SESSION_S,
            acquire_timeout_s=20,
        ) as client:
            while not stop.is_set():
                key = local.choice(keys)
                lock = client.lock(key, lease_ttl_s=LEASE_S)
                asked = time.monotonic()
                try:
                    if not lock.acquire():
                        continue
                except Exception as exc:  # a refusal while the cluster moves: try again
                    with guard:
                        errors.append(exc)
                    stop.wait(0.2)
                    continue
                granted = time.monotonic()
                fence = lock.fence or 0
                owned_t = granted
                until = granted + local.uniform(0.2, 2.5)
                while time.monotonic() < until and not stop.is_set():
                    sampled = time.monotonic()
                    if lock.owned():
                        owned_t = sampled
                    stop.wait(0.05)
                released = time.monotonic()
                lock.release()
                with guard:
                    beliefs.append(
                        Belief(key, f"h{index}", fence, asked, granted, owned_t, released)
                    )

    threads = [threading.Thread(target=holder, args=(i,), daemon=True) for i in range(4)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(14):
            choice = rng.choice(["pin", "unpin", "pause", "kill", "etcd"])
            member = rng.choice(members)
            if choice == "pin":
                pin(fleet.etcd, fleet.prefix, shard_id(rng.choice(keys)), member.advertise)
            elif choice == "unpin":
                shard = shard_id(rng.choice(keys))
                if shard in read_view(fleet.etcd, fleet.prefix).shard_map.pinned_shards():
                    unpin(fleet.etcd, fleet.prefix, shard)
            elif choice == "pause":
                with paused(member.proc.pid):
                    time.sleep(rng.uniform(1, MEMBER_LEASE_S + LEASE_S + 3))
            elif choice == "kill":
                member.proc.kill()
                member.proc.wait(30)
                time.sleep(rng.uniform(0, 3))
                member.proc = member._start()  # pyright: ignore[reportPrivateUsage]
            else:
                with paused(etcd_server.pid):
                    time.sleep(rng.uniform(1, MEMBER_LEASE_S + SESSION_S))
            print(f"{time.monotonic():.2f} {choice} {member.advertise}")
            time.sleep(rng.uniform(1, 4))
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    print(f"{len(beliefs)} grants, {len(errors)} refused acquires")
    assert len(beliefs) > 20
    overlaps = overlapping_beliefs(beliefs)
    assert not overlaps, "\n".join(overlaps[:10])
    disordered = fences_out_of_order(beliefs)
    assert not disordered, "\n".join(disordered[:10])


@pytest.mark.timeout(300)
def test_the_splits_target_killed_and_restarted_keeps_or_tells_its_asked_key(
    fleet: Fleet,
) -> None:
    """A shard split from A to B (A holds one of its keys); B grants another key of it on A's
    ticket to a session holder, is killed (SIGKILL) and restarted in place with its journal.
    The holder keeps the key (renewed by token on B's new run) or knows its loss before a
    rival is granted it; once it lets go, the rival gets it with a higher fence."""
    a, b = two_members(fleet)
    pinned = key_of(fleet, a, "split:")
    crossed = sibling_of(pinned, "crossed:")
    seeds = fleet.seeds()
    with (
        Client(seeds, sharding_strategy="cluster", acquire_timeout_s=WAIT_S) as keeper,
        Client(seeds, sharding_strategy="cluster", session_ttl_s=SESSION_S) as holding,
        Client(seeds, sharding_strategy="cluster", acquire_timeout_s=WAIT_S) as rival,
        keeper.lock(pinned, lease_ttl_s=LEASE_S),
    ):
        pin(fleet.etcd, fleet.prefix, shard_id(pinned), b.advertise)
        wait_until(
            lambda: fleet.split_of(pinned) == b.advertise,
            timeout=WAIT_S,
            what="a splits the shard towards b",
        )
        held = holding.lock(crossed, lease_ttl_s=LEASE_S, acquire_timeout_s=WAIT_S)
        assert held.acquire() and held.server == b.address
        fence = held.fence
        assert fence is not None
        time.sleep(SESSION_S)  # kept by keep-alives only
        b.proc.kill()
        b.proc.wait(30)
        b.proc = b._start()  # pyright: ignore[reportPrivateUsage]
        taken = rival.lock(crossed, lease_ttl_s=LEASE_S, acquire_timeout_s=LEASE_S * 2)
        try:
            if not taken.acquire():  # the holder kept it
                assert held.owned() and held.renew(), "nobody holds the key, yet the rival waited"
                held.release()
                assert taken.acquire(), "the rival never got the key"
            assert not held.owned(), f"two holders: {held!r} still owns it, {taken!r} got it"
            assert (taken.fence or 0) > fence
        finally:
            taken.release()
            held.release()  # lost: closes its connection
    unpin(fleet.etcd, fleet.prefix, shard_id(pinned))
