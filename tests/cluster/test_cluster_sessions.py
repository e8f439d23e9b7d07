"""Client sessions across a cluster's moves, against real ``dflockd --cluster`` member
processes on a real etcd: a key held by a session alone (its keep-alives are its only
renewals) while its shard moves and its member is paused, resumed or restarted. Whatever
happens, the rival that gets the key finds the old holder already knowing its loss."""

from __future__ import annotations

import base64
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import pytest

from celery_dflock.client import DistributedLock
from celery_dflock.client.clients import Client
from celery_dflock.client.errors import ServerUnavailable
from dflockd_server.cluster.etcd import EtcdError
from dflockd_server.cluster.ops import ClusterOpError
from dflockd_server.cluster.shardmap import shard_id
from tests.support.etcd import EtcdServer
from tests.support.fleet import Fleet, Member, cluster_url
from tests.support.processes import paused
from tests.support.proxy import FaultProxy
from tests.support.shards import pin, unpin
from tests.support.waiting import wait_until

WAIT_S = 60.0
LEASE_S = 9
"""The holder's lease: longer than three of its session's keep-alives, so they alone keep it."""
SESSION_S = 3
MEMBER_LEASE_S = 2
"""The members' etcd lease: a paused member is seen gone after about this."""
MEMBER_ARGS = (
    "--cluster-lease-ttl", str(MEMBER_LEASE_S), "--max-lease-ttl", str(LEASE_S + 1),
    "--default-lease-ttl", str(LEASE_S), "--restart-grace", "0",
)  # fmt: skip
"""Each member's arguments beyond the shared ones: short leases, no restart grace."""


@pytest.fixture
def fleet(etcd_server: EtcdServer, etcd_prefix: str, tmp_path: Path) -> Iterator[Fleet]:
    with Fleet.on(etcd_server, etcd_prefix, tmp_path, *MEMBER_ARGS) as made:
        yield made


def two_members(fleet: Fleet) -> tuple[Member, Member]:
    a, b = fleet.start(), fleet.start()
    fleet.even_out()
    return a, b


@pytest.mark.timeout(300)
@pytest.mark.parametrize("pause_s", [SESSION_S + 2, MEMBER_LEASE_S + LEASE_S + 6])
def test_a_member_paused_past_the_session_mid_move_gives_the_key_to_no_one_before_its_holder_knows(
    fleet: Fleet, pause_s: float
) -> None:
    """A holds a key by its session alone; its shard is pinned to B (the move waits for the
    key); A is stopped past the session's time (shorter than the failover, then longer), then
    resumed. The rival that gets the key (from B) finds the holder knowing its loss."""
    a, b = two_members(fleet)
    key = fleet.key_of(a, "paused:")
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
        with a.paused():
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
    key = fleet.key_of(a, "stalled:")
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


def rival_once_let_go(held: DistributedLock, rival: Client, key: str) -> DistributedLock:
    """The rival's lock of ``key``, taken after a restart of the member that granted ``held``.
    The holder either keeps the key (renewed by token on the new run: the rival waits two
    leases in vain, then the holder lets go) or knows its loss. Then the grant the journal
    restored runs out by itself: up to two leases after the kill (a keep-alive's renewal is
    journaled a lease ahead), later still when the new run was slow to start."""
    taken = rival.lock(key, lease_ttl_s=LEASE_S, acquire_timeout_s=LEASE_S * 2)
    if taken.acquire():
        return taken
    if held.owned():
        assert held.renew(), f"{held!r} owned the key, yet the server refused its renewal"
        held.release()
    taken = rival.lock(key, lease_ttl_s=LEASE_S, acquire_timeout_s=WAIT_S)
    assert taken.acquire(), "the rival never got the key"
    return taken


@pytest.mark.timeout(300)
def test_a_member_killed_and_restarted_with_its_journal_gives_a_session_key_to_no_one_early(
    fleet: Fleet,
) -> None:
    """A member killed (SIGKILL) and restarted in place, its lease journal kept, while a key is
    held on it by a session alone: the holder either keeps it (renewed by token on the new
    run) or knows its loss before any rival is granted it."""
    a, _ = two_members(fleet)
    key = fleet.key_of(a, "restarted:")
    seeds = fleet.seeds()
    with (
        Client(seeds, sharding_strategy="cluster", session_ttl_s=SESSION_S) as holding,
        Client(seeds, sharding_strategy="cluster", acquire_timeout_s=WAIT_S) as rival,
    ):
        held = holding.lock(key, lease_ttl_s=LEASE_S)
        assert held.acquire() and held.server == a.address
        time.sleep(SESSION_S)  # kept by keep-alives only
        a.restart()
        taken = rival_once_let_go(held, rival, key)
        try:
            assert not held.owned(), f"two holders: {held!r} still owns it, {taken!r} got it"
        finally:
            taken.release()
            held.release()  # lost: closes its connection


UNDECIDED_LEASE_S = 40
"""Longer than a restart and an etcd stall together, even on a loaded machine."""


@pytest.mark.timeout(300)
def test_a_restarted_split_target_that_cannot_yet_tell_its_shards_keeps_the_holders_key(
    etcd_server: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> None:
    """B, the target of a shard split from A, grants a key of it, is killed and restarted in
    place, and listens before it has raised its fencing counter for the split (etcd stalled
    from its first read of the ceilings): until then it may not renew that key, yet the grant
    its journal restored may well be the holder's. It answers the holder's renewal by token
    ``error_unavailable``, not ``error`` (which would tell a loss that did not happen, and
    leave the key held for nobody until its lease ends): the holder asks again within its
    lease, and holds on once B decides."""
    args = (*MEMBER_ARGS[:2], "--max-lease-ttl", str(2 * UNDECIDED_LEASE_S), *MEMBER_ARGS[4:])
    with (
        FaultProxy(("127.0.0.1", etcd_server.client_port)) as proxy,
        Fleet.on(etcd_server, etcd_prefix, tmp_path, *args) as fleet,
    ):
        a = fleet.start()
        proxied = cluster_url(f"http://127.0.0.1:{proxy.address[1]}", fleet.prefix)
        b = fleet.start(proxied)  # its etcd through the proxy, A's not
        fleet.even_out()
        pinned = fleet.key_of(a, "split:")
        crossed = sibling_of(pinned, "crossed:")
        seeds = fleet.seeds()
        with (
            Client(seeds, sharding_strategy="cluster", acquire_timeout_s=WAIT_S) as keeper,
            Client(seeds, sharding_strategy="cluster", session_ttl_s=SESSION_S) as holding,
            keeper.lock(pinned, lease_ttl_s=UNDECIDED_LEASE_S),
        ):
            split_towards(fleet, pinned, b)
            held = holding.lock(crossed, lease_ttl_s=UNDECIDED_LEASE_S, acquire_timeout_s=WAIT_S)
            assert held.acquire() and held.server == b.address
            b.kill()
            # What a member's new run does first once it decides: read every ceiling.
            ceilings_end = base64.b64encode(f"{fleet.prefix}/fence0".encode())
            reading = proxy.hold_reply_after(ceilings_end)
            b.start()
            assert reading.wait(WAIT_S), "b's new run never read the fence ceilings"
            # Its retries too: it cannot raise its counter meanwhile (shorter than the members'
            # 5 s etcd timeout, past which its start would wait for its lease bound's publish:
            # test_lease_publish).
            proxy.stall(SESSION_S + 1)
            time.sleep(SESSION_S)  # the holder asks b's new run again, every second at most
            assert not held.lost, f"{held!r} was told a loss while its grant was restored"
            proxy.release_replies()
            wait_until(held.renew, timeout=WAIT_S, what="the holder renews on b's new run")
            assert held.owned() and not held.lost
            assert held.release()
        unpin(fleet.etcd, fleet.prefix, shard_id(pinned))


CUT_OFF_SESSION_S = 24
"""A session that outlives a member's etcd stall (its lease, then a keep-alive's third of the
session) and its return, even on CI; the members' longest lease, a little more, is what a
failover of a member whose etcd lease lapsed under load then waits (under ``WAIT_S``)."""


@pytest.mark.timeout(300)
def test_a_member_cut_off_from_etcd_within_a_session_keeps_its_session_holders_keys(
    etcd_server: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> None:
    """A, cut off from etcd past its own etcd lease, cannot tell whether it still serves its
    shards, so it renews nothing. It answered its session holders' keep-alives ``error``, and
    each client took its session as over and its locks as lost at once, though nobody could
    take A's keys before its longest lease and etcd came back long before (a renewal by token
    asked again: ``error_unavailable``). A keep-alive is now answered ``error_unavailable``
    too: the client asks again while its session runs, and holds on once A decides again."""
    lease = CUT_OFF_SESSION_S + 6  # kept by its session's keep-alives alone
    args = (*MEMBER_ARGS[:2], "--max-lease-ttl", str(lease), *MEMBER_ARGS[4:])
    with (
        FaultProxy(("127.0.0.1", etcd_server.client_port)) as proxy,
        Fleet.on(etcd_server, etcd_prefix, tmp_path, *args) as fleet,
    ):
        fleet.start()
        a = fleet.start(cluster_url(f"http://127.0.0.1:{proxy.address[1]}", fleet.prefix))
        fleet.even_out()
        key = fleet.key_of(a, "cut-off:")
        session = CUT_OFF_SESSION_S
        with Client(fleet.seeds(), sharding_strategy="cluster", session_ttl_s=session) as holding:
            held = holding.lock(key, lease_ttl_s=lease)  # its session's keep-alives renew it
            assert held.acquire() and held.server == a.address
            said = len(a.log())
            proxy.stall(WAIT_S)
            wait_until(
                lambda: any("fenced, granting nothing" in line for line in a.log()[said:]),
                timeout=WAIT_S,
                what="a fenced, cut off from etcd",
            )
            time.sleep(session / 3 + 1)  # a keep-alive (every third of the session) comes
            assert not held.lost, f"{held!r} was told a loss while no one could take its key"
            proxy.resume()
            wait_until(held.renew, timeout=WAIT_S, what="the holder renews at a, back on etcd")
            assert held.owned() and not held.lost
            assert held.release()


def adopted(lock: DistributedLock, token: str) -> bool:
    try:
        return lock.adopt(token)
    except ServerUnavailable:
        return False


@pytest.mark.timeout(300)
def test_a_hold_on_a_member_cut_off_from_etcd_is_not_told_gone_to_its_take_over_or_detach(
    etcd_server: EtcdServer, etcd_prefix: str, tmp_path: Path
) -> None:
    """A, cut off from etcd past its own etcd lease, cannot tell whether it still serves its
    shards, so it renews nothing, yet its hold may well still be there. It answered a take-over
    (``ht``: `adopt`) and a hand-down (``hd``: `detach`) ``error``, which the client reads as
    the hold gone (a queue-once run then took its key as a run-time lock, behind its own hold,
    and a publisher warned that its hold was gone). They are answered as a renewal is,
    ``error_unavailable``: `ServerUnavailable` (a run waits it out as an outage), and the hold
    is adopted, with its fence, once A decides again."""
    lease = 2 * int(WAIT_S)  # the hold outlives the stall and A's return
    args = (*MEMBER_ARGS[:2], "--max-lease-ttl", str(lease), *MEMBER_ARGS[4:])
    with (
        FaultProxy(("127.0.0.1", etcd_server.client_port)) as proxy,
        Fleet.on(etcd_server, etcd_prefix, tmp_path, *args) as fleet,
    ):
        a = fleet.start(cluster_url(f"http://127.0.0.1:{proxy.address[1]}", fleet.prefix))
        fleet.wait_settled("a serves every shard")
        key = "cut-off-hold:1"
        with Client(fleet.seeds(), sharding_strategy="cluster") as client:
            hold = client.hold(key, note="publisher", lease_ttl=lease)
            said = len(a.log())
            proxy.stall(WAIT_S)
            wait_until(
                lambda: any("fenced, granting nothing" in line for line in a.log()[said:]),
                timeout=WAIT_S,
                what="a fenced, cut off from etcd",
            )
            run = client.lock(key, lease_ttl_s=lease, note="run")
            with pytest.raises(ServerUnavailable, match="error_unavailable"):
                run.adopt(hold.token)
            with pytest.raises(ServerUnavailable, match="error_unavailable"):
                client.detach(key, hold.token, lease_ttl=lease)
            proxy.resume()
            wait_until(lambda: adopted(run, hold.token), timeout=WAIT_S, what="a hands it over")
            assert run.fence == hold.fence and run.server == a.address
            assert run.release()


def split_towards(fleet: Fleet, pinned: str, b: Member) -> None:
    """Pin ``pinned``'s shard to ``b``; return once its member (holding ``pinned``) has split
    the shard towards ``b``."""
    pin(fleet.etcd, fleet.prefix, shard_id(pinned), b.advertise)
    wait_until(
        lambda: fleet.split_of(pinned) == b.advertise,
        timeout=WAIT_S,
        what="a splits the shard towards b",
    )


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
    pinned = fleet.key_of(a, "split:")
    crossed = sibling_of(pinned, "crossed:")
    seeds = fleet.seeds()
    with (
        Client(seeds, sharding_strategy="cluster", acquire_timeout_s=WAIT_S) as keeper,
        Client(seeds, sharding_strategy="cluster", session_ttl_s=SESSION_S) as holding,
        Client(seeds, sharding_strategy="cluster", acquire_timeout_s=WAIT_S) as rival,
        keeper.lock(pinned, lease_ttl_s=LEASE_S),
    ):
        split_towards(fleet, pinned, b)
        held = holding.lock(crossed, lease_ttl_s=LEASE_S, acquire_timeout_s=WAIT_S)
        assert held.acquire() and held.server == b.address
        time.sleep(SESSION_S)  # kept by keep-alives only
        assert held.owned()
        with b.paused():
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
    key = fleet.key_of(a, "leaving:")
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
    fleet.even_out()
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

    def operate(change: Callable[[], object]) -> None:
        """An operator's pin or unpin, tried again as an operator would while etcd catches up
        after a pause, a member re-registers after its own, or a member writes the map."""

        def tried() -> bool:
            try:
                change()
            except (EtcdError, ClusterOpError) as exc:
                print(f"{time.monotonic():.2f} the operator tries again: {exc}")
                return False
            return True

        wait_until(tried, timeout=WAIT_S, what="the operator's change written")

    threads = [threading.Thread(target=holder, args=(i,), daemon=True) for i in range(4)]
    for thread in threads:
        thread.start()
    try:
        for _ in range(14):
            choice = rng.choice(["pin", "unpin", "pause", "kill", "etcd"])
            member = rng.choice(members)
            if choice == "pin":
                shard = shard_id(rng.choice(keys))
                operate(partial(pin, fleet.etcd, fleet.prefix, shard, member.advertise))
            elif choice == "unpin":
                shard = shard_id(rng.choice(keys))
                if shard in fleet.view().shard_map.pinned_shards():
                    operate(partial(unpin, fleet.etcd, fleet.prefix, shard))
            elif choice == "pause":
                with member.paused():
                    time.sleep(rng.uniform(1, MEMBER_LEASE_S + LEASE_S + 3))
            elif choice == "kill":
                member.kill()
                time.sleep(rng.uniform(0, 3))
                member.start()
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
    pinned = fleet.key_of(a, "split:")
    crossed = sibling_of(pinned, "crossed:")
    seeds = fleet.seeds()
    with (
        Client(seeds, sharding_strategy="cluster", acquire_timeout_s=WAIT_S) as keeper,
        Client(seeds, sharding_strategy="cluster", session_ttl_s=SESSION_S) as holding,
        Client(seeds, sharding_strategy="cluster", acquire_timeout_s=WAIT_S) as rival,
        keeper.lock(pinned, lease_ttl_s=LEASE_S),
    ):
        split_towards(fleet, pinned, b)
        held = holding.lock(crossed, lease_ttl_s=LEASE_S, acquire_timeout_s=WAIT_S)
        assert held.acquire() and held.server == b.address
        fence = held.fence
        assert fence is not None
        time.sleep(SESSION_S)  # kept by keep-alives only
        b.restart()
        taken = rival_once_let_go(held, rival, crossed)
        try:
            assert not held.owned(), f"two holders: {held!r} still owns it, {taken!r} got it"
            assert (taken.fence or 0) > fence
        finally:
            taken.release()
            held.release()  # lost: closes its connection
    unpin(fleet.etcd, fleet.prefix, shard_id(pinned))
