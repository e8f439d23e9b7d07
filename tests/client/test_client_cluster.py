"""Where keys live (issue 16), seen from the client: the codec of ``shards`` and the refusals,
the pure cluster map, a client against real static-members servers (agreeing and not), and
cluster routing against three real servers serving by a fixed cluster-style map (swapped
mid-test to make the client's cached map stale)."""

from __future__ import annotations

import asyncio
import threading
import time
import zlib
from collections.abc import Iterator

import pytest

from celery_dflock.client import _replies, _requests, wire
from celery_dflock.client._replies import Asked, ErrorReply, JsonReply, Moved, Ok
from celery_dflock.client._requests import Command
from celery_dflock.client.clients import AsyncClient, Client
from celery_dflock.client.cluster import ClusterMap, ShardsInfo, fnv1a_32
from celery_dflock.client.errors import (
    LockNotAcquired,
    ProtocolError,
    ServerUnavailable,
    ShardingMismatchError,
)
from celery_dflock.client.sharding import rendezvous_shard
from dflockd_server import protocol as server_protocol
from dflockd_server.cluster import shardmap
from dflockd_server.table import LockTable
from dflockd_server.testing import ServerThread
from tests.support.tables import key_state

KEYS = [f"job:{i}" for i in range(40)]
SHARDS = shardmap.SHARD_COUNT


# ------------------------------------------------------------------------------ codec, pure
def test_the_shards_request_and_the_new_replies_byte_by_byte() -> None:
    assert _requests.SHARDS_REQUEST == b"shards\n_\n_\n"
    assert _replies.decode_reply(Command.SHARDS, b'ok {"mode":"single"}') == JsonReply(
        {"mode": "single"}
    )
    for command in (Command.LOCK, Command.SEM_LOCK, Command.ENQUEUE, Command.SEM_WAIT):
        assert _replies.decode_reply(command, b"error_moved 10.0.0.2:6388") == Moved(
            "10.0.0.2:6388"
        )
        assert _replies.decode_reply(command, b"error_moved [::1]:6388") == Moved("[::1]:6388")
        assert _replies.decode_reply(command, b"error_unavailable") == ErrorReply(
            "error_unavailable"
        )
    with pytest.raises(ProtocolError, match="HOST:PORT"):
        _replies.decode_reply(Command.LOCK, b"error_moved nowhere")
    with pytest.raises(ProtocolError):
        _replies.decode_reply(Command.RENEW, b"error_moved a:1")  # renewals are never moved
    with pytest.raises(ProtocolError):
        _replies.decode_reply(Command.RELEASE, b"error_unavailable")


def test_the_key_level_move_replies_byte_by_byte() -> None:
    assert _requests.checked_asking("k", None) == b"asking\n_\n_\n"
    assert _replies.decode_reply(Command.ASKING, b"ok") == Ok()
    assert _replies.decode_reply(Command.ASKING, b"error") == ErrorReply("error")  # too old
    for command in (Command.LOCK, Command.HOLD, Command.ENQUEUE, Command.SEM_ENQUEUE):
        assert _replies.decode_reply(command, b"error_ask 10.0.0.7:6388") == Asked("10.0.0.7:6388")
    with pytest.raises(ProtocolError, match="HOST:PORT"):
        _replies.decode_reply(Command.LOCK, b"error_ask nowhere")
    with pytest.raises(ProtocolError):
        _replies.decode_reply(Command.RENEW, b"error_ask a:1")  # renewals are never asked
    # Issue 48: the member's ticket comes with the ask and goes back with `asking`, as is.
    ticket = "1f.6a0b1c2d.18eb8cfb560e7377." + "ab" * 16
    line = f"error_ask 10.0.0.7:6388 {ticket}".encode()
    assert _replies.decode_reply(Command.LOCK, line) == Asked("10.0.0.7:6388", ticket)
    assert _requests.checked_asking("job:7", ticket) == f"asking\njob:7\n{ticket}\n".encode()
    with pytest.raises(ProtocolError, match="ticket"):
        _replies.decode_reply(Command.LOCK, b"error_ask a:1 t1 t2")


def cluster_map_of(
    nodes: list[str], current: list[int], target: list[int] | None = None
) -> ClusterMap:
    """A map from its parts: ``current``/``target`` index ``nodes``."""
    target = current if target is None else target
    return ClusterMap.parse(
        {
            "mode": wire.MODE_CLUSTER,
            "hash": wire.HASH_FNV1A32,
            "shard_count": len(current),
            "nodes": nodes,
            "current": current,
            "target": target,
            "moving": [s for s, (c, t) in enumerate(zip(current, target, strict=True)) if c != t],
        }
    )


def test_the_client_hash_is_the_servers() -> None:
    keys = [*KEYS, "", "ключ", "🔒", "a" * 250, "orders:{42}"]
    for key in keys:
        assert fnv1a_32(key.encode()) == shardmap.fnv1a_32(key.encode())
    cluster_map = cluster_map_of(["a:1"], [0] * SHARDS)
    for key in [*keys, *(f"k{i}" for i in range(2000))]:
        assert cluster_map.shard_of(key) == shardmap.shard_id(key)


def test_a_cluster_map_routes_to_current_then_target() -> None:
    nodes = ["a:1", "b:2", "c:3"]
    current = [s % 3 for s in range(SHARDS)]
    key = "orders:1"
    shard = shardmap.shard_id(key)
    current[shard] = -1
    target = list(current)
    target[shard] = 2
    cluster_map = cluster_map_of(nodes, current, target)
    assert cluster_map.owner(key) == "c:3"
    assert cluster_map.moving == (shard,)
    target[shard] = -1
    assert cluster_map_of(nodes, current, target).owner(key) is None
    info = ShardsInfo.parse(
        {
            "mode": "cluster",
            "self": "a:1",
            "leader": "b:2",
            "members": nodes,
            "shard_count": SHARDS,
            "hash": "fnv1a32",
            "nodes": nodes,
            "current": [s % 3 for s in range(SHARDS)],
            "target": [s % 3 for s in range(SHARDS)],
            "pinned": [],
            "moving": [],
        }
    )
    assert info.leader == "b:2"
    assert sum(info.shards_per_member().values()) == SHARDS
    with pytest.raises(ProtocolError, match="hashes keys"):
        ClusterMap.parse({"mode": "cluster", "hash": "md5", "shard_count": 1})


# ------------------------------------------------------------------------------ static members
def test_a_client_whose_list_agrees_spreads_keys_and_all_are_served(
    static_fleet: list[ServerThread],
) -> None:
    servers = [s.address for s in static_fleet]
    with Client(servers, acquire_timeout_s=0) as client:
        used: set[tuple[str, int]] = set()
        for key in KEYS:
            with client.lock(key) as lock:
                assert lock.server == servers[zlib.crc32(key.encode()) % 3]
                used.add(lock.server)
            with client.semaphore(key + ":sem", 2) as sem:
                assert sem.server == servers[zlib.crc32((key + ":sem").encode()) % 3]
        assert used == set(servers)


@pytest.mark.parametrize("order", ["reversed", "subset", "rendezvous"])
def test_a_client_whose_list_disagrees_gets_an_error_naming_both_lists(
    static_fleet: list[ServerThread], order: str
) -> None:
    servers = [s.address for s in static_fleet]
    theirs = ",".join(f"{h}:{p}" for h, p in servers)
    strategy = rendezvous_shard if order == "rendezvous" else None
    ours = servers[::-1] if order == "reversed" else servers[:2] if order == "subset" else servers
    client = (
        Client(ours, acquire_timeout_s=0)
        if strategy is None
        else Client(ours, acquire_timeout_s=0, sharding_strategy=strategy)
    )
    with client:
        failures = 0
        for key in KEYS:
            lock = client.lock(key)
            try:
                with lock:
                    pass
            except ShardingMismatchError as exc:
                failures += 1
                message = str(exc)
                assert f"--members {theirs}" in message
                assert ",".join(f"{h}:{p}" for h, p in ours) in message
                assert "dflock_servers" in message
            # the connection stays in step: the pool's connection answers the next key
        assert failures > 0


def test_the_async_client_gets_the_mismatch_too(static_fleet: list[ServerThread]) -> None:
    servers = [s.address for s in static_fleet][::-1]

    async def run() -> int:
        failures = 0
        async with AsyncClient(servers, acquire_timeout_s=0) as client:
            for key in KEYS[:10]:
                try:
                    async with client.lock(key):
                        pass
                except ShardingMismatchError:
                    failures += 1
        return failures

    assert asyncio.run(run()) > 0


# ------------------------------------------------------------------------------ cluster routing


def _held_here(table: LockTable, key: str) -> bool:
    state = key_state(table, key)
    return state is not None and state.n_held > 0


class MapOwnership:
    """What a cluster member decides from a fixed shard map (test stand-in for the cluster
    node): serve the shards whose current node is this member; a shard with no current node
    is unavailable; any other is moved to its current node."""

    def __init__(self, me: str, nodes: list[str], current: list[int]) -> None:
        self.me = me
        self.nodes = nodes
        self.current = current
        self._moved = [server_protocol.reply_moved(node) for node in nodes]

    def check(self, key: str) -> bytes | None:
        index = self.current[shardmap.shard_id(key)]
        if index < 0:
            return server_protocol.REPLY_ERROR_UNAVAILABLE
        return None if self.nodes[index] == self.me else self._moved[index]

    def check_asked(self, key: str) -> bytes | None:
        return self.check(key)

    def admit_ask(self, key: str, ticket: str) -> bytes | None:
        return None

    def may_hold(self, key: str) -> bool:
        # A real member whose shard moves keeps being its current member (moving out) until
        # its holders are done: the grants held here may still be renewed and released.
        return True

    def describe(self) -> dict[str, object]:
        return {
            "mode": "cluster",
            "self": self.me,
            "leader": self.nodes[0],
            "members": sorted(self.nodes),
            "shard_count": SHARDS,
            "hash": "fnv1a32",
            "nodes": self.nodes,
            "current": self.current,
            "target": self.current,
            "pinned": [],
            "moving": [],
        }


class Cluster:
    """Three real servers, each serving by the same fixed map (swappable)."""

    def __init__(self) -> None:
        self.servers = [ServerThread().start() for _ in range(3)]
        self.nodes = [f"{s.host}:{s.port}" for s in self.servers]

    def set_map(self, current: list[int]) -> None:
        for server, node in zip(self.servers, self.nodes, strict=True):
            server.server.set_ownership(MapOwnership(node, self.nodes, current))

    def node_of(self, current: list[int], key: str) -> tuple[str, int]:
        server = self.servers[current[shardmap.shard_id(key)]]
        return server.address

    def held_on(self, key: str) -> list[int]:
        return [
            i
            for i, s in enumerate(self.servers)
            if s.call(lambda s=s: _held_here(s.server.table, key))
        ]

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


ROUND_ROBIN = [s % 3 for s in range(SHARDS)]
ROTATED = [(s + 1) % 3 for s in range(SHARDS)]


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    made = Cluster()
    made.set_map(ROUND_ROBIN)
    yield made
    made.stop()


@pytest.mark.parametrize("kind", ["lock", "semaphore"])
def test_cluster_routing_sends_each_key_to_its_node(cluster: Cluster, kind: str) -> None:
    seed = cluster.servers[1].address
    with Client([seed], sharding_strategy="cluster", acquire_timeout_s=2) as client:
        for key in KEYS[:15]:
            lock = client.lock(key) if kind == "lock" else client.semaphore(key, 2)
            with lock:
                assert lock.server == cluster.node_of(ROUND_ROBIN, key)
                assert cluster.held_on(key) == [ROUND_ROBIN[shardmap.shard_id(key)]]
        assert client.router is not None and client.router.map is not None
        assert client.server_for(KEYS[0]) == cluster.node_of(ROUND_ROBIN, KEYS[0])


@pytest.mark.parametrize("kind", ["lock", "semaphore"])
def test_a_stale_map_follows_error_moved(cluster: Cluster, kind: str) -> None:
    seed = cluster.servers[0].address
    with Client([seed], sharding_strategy="cluster", acquire_timeout_s=2) as client:
        with client.lock("warm-up"):
            pass
        cluster.set_map(ROTATED)  # every shard moves to the next node; the cache is stale
        for key in KEYS[:10]:
            lock = client.lock(key) if kind == "lock" else client.semaphore(key, 3)
            with lock:
                assert lock.server == cluster.node_of(ROTATED, key)
                assert cluster.held_on(key) == [ROTATED[shardmap.shard_id(key)]]
                assert lock.renew()  # renewals go to the server that granted
        time.sleep(0.25)
        with client.lock("after-refresh") as lock:
            assert lock.server == cluster.node_of(ROTATED, "after-refresh")
        assert client.router is not None and client.router.map is not None
        assert list(client.router.map.current) == ROTATED  # refreshed on a redirect


def test_a_force_release_goes_to_the_key_s_member_even_with_a_stale_map(cluster: Cluster) -> None:
    seed = cluster.servers[0].address
    with Client([seed], sharding_strategy="cluster") as client:
        with client.lock("warm-up"):
            pass
        cluster.set_map(ROTATED)  # the client's cached map is stale now
        with Client([seed], sharding_strategy="cluster") as holder:
            locks = [holder.lock(key) for key in KEYS[:5]]
            for lock in locks:
                assert lock.acquire() and lock.server == cluster.node_of(ROTATED, lock.key)
            # The first is answered error_moved by the stale map's member and followed; the
            # map is read again for the others.
            for lock in locks:
                assert client.force_release(lock.key) == 1
                assert cluster.held_on(lock.key) == []
                assert not lock.renew()
                lock.release()


def test_a_held_lock_renews_and_releases_where_it_was_granted_after_its_shard_moved(
    cluster: Cluster,
) -> None:
    key = "stays"
    with Client([cluster.servers[2].address], sharding_strategy="cluster") as client:
        lock = client.lock(key)
        assert lock.acquire()
        granted_on = lock.server
        cluster.set_map(ROTATED)
        assert lock.renew()
        assert lock.release()
        assert lock.server == granted_on


def test_error_unavailable_is_retried_until_the_timeout(cluster: Cluster) -> None:
    """A hand-over that outlasts the acquire's time: not acquired (try-once too, after a short
    bounded wait), and the lock says why, naming the key and the member (the `with` form's
    `LockNotAcquired` too); one that ends in time: granted by the key's member."""
    key = "waiting-for-a-handover"
    nobody = list(ROUND_ROBIN)
    nobody[shardmap.shard_id(key)] = -1
    cluster.set_map(nobody)
    member = f"{cluster.node_of(ROUND_ROBIN, key)[0]}:{cluster.node_of(ROUND_ROBIN, key)[1]}"
    with Client([cluster.servers[0].address], sharding_strategy="cluster") as client:
        for timeout in (0, 1):
            lock = client.lock(key, acquire_timeout_s=timeout)
            assert lock.acquire() is False
            assert lock.handover is not None
            assert "hand-over" in lock.handover
            assert repr(key) in lock.handover
            assert f"{member} answered error_unavailable" in lock.handover
            assert lock.holder is None
        with (
            pytest.raises(LockNotAcquired, match="hand-over of its shard"),
            client.lock(key, acquire_timeout_s=0),
        ):
            pass
        # enqueue: neither held nor queued (it answered "queued" before, and wait() then
        # said the lock was not enqueued)
        with pytest.raises(LockNotAcquired, match="hand-over of its shard"):
            client.lock(key, acquire_timeout_s=0).enqueue()
        threading.Timer(0.4, cluster.set_map, args=(ROUND_ROBIN,)).start()
        lock = client.semaphore(key, 2, acquire_timeout_s=5)
        assert lock.acquire()
        assert lock.server == cluster.node_of(ROUND_ROBIN, key)
        lock.release()


class CountingOwnership(MapOwnership):
    """`MapOwnership` that counts the ``shards`` requests answered."""

    def __init__(self, me: str, nodes: list[str], current: list[int]) -> None:
        super().__init__(me, nodes, current)
        self.described = threading.Semaphore(0)

    def describe(self) -> dict[str, object]:
        self.described.release()
        return super().describe()


@pytest.mark.parametrize("face", ["blocking", "asyncio"])
def test_a_redirect_loop_is_waited_through_reading_the_map_again(
    cluster: Cluster, face: str
) -> None:
    """Two members whose views of a shard differ (as for a moment during a hand-over) send
    an acquire back and forth: the client pauses and reads the map again instead of giving up
    (it raised `ServerUnavailable` after 8 hops, within milliseconds, before), and once the
    members agree the acquire is granted, within its timeout."""
    key = next(k for k in KEYS if ROUND_ROBIN[shardmap.shard_id(k)] == 0)
    to_b = list(ROUND_ROBIN)
    to_b[shardmap.shard_id(key)] = 1
    a, _, c = cluster.servers
    views = [
        CountingOwnership(cluster.nodes[0], cluster.nodes, to_b),  # a: "moved to b"
        CountingOwnership(cluster.nodes[1], cluster.nodes, ROUND_ROBIN),  # b: "moved to a"
        CountingOwnership(cluster.nodes[2], cluster.nodes, ROUND_ROBIN),
    ]
    for server, view in zip(cluster.servers, views, strict=True):
        server.server.set_ownership(view)
    seeds = [c.address]  # the map comes from c (it names a)
    outcome: list[object] = []

    def acquire() -> None:
        try:
            if face == "blocking":
                with Client(seeds, sharding_strategy="cluster", acquire_timeout_s=60) as client:
                    lock = client.lock(key)
                    outcome.append(lock.acquire() and lock.server)
                    lock.release()
                return

            async def run() -> None:
                async with AsyncClient(
                    seeds, sharding_strategy="cluster", acquire_timeout_s=60
                ) as client:
                    lock = client.lock(key)
                    outcome.append(await lock.acquire() and lock.server)
                    await lock.release()

            asyncio.run(run())
        except BaseException as exc:  # the test's thread reports it
            outcome.append(exc)

    worker = threading.Thread(target=acquire)
    worker.start()
    for _ in range(3):  # the first map, then two more read after redirect loops
        assert views[2].described.acquire(timeout=30), outcome
    assert outcome == []  # still trying
    cluster.set_map(ROUND_ROBIN)  # the members agree: a serves the key
    worker.join(90)
    assert outcome == [a.address]


def test_the_asyncio_face_routes_follows_and_retries(cluster: Cluster) -> None:
    key = "async-key"

    async def run() -> None:
        seed = cluster.servers[0].address
        async with AsyncClient([seed], sharding_strategy="cluster", acquire_timeout_s=2) as client:
            async with client.lock(key) as lock:
                assert lock.server == cluster.node_of(ROUND_ROBIN, key)
            cluster.set_map(ROTATED)
            async with client.semaphore(key, 2) as sem:
                assert sem.server == cluster.node_of(ROTATED, key)
                assert await sem.renew()
            nobody = list(ROTATED)
            nobody[shardmap.shard_id(key)] = -1
            cluster.set_map(nobody)
            asyncio.get_running_loop().call_later(0.4, cluster.set_map, ROUND_ROBIN)
            lock = client.lock(key, acquire_timeout_s=5)
            assert await lock.acquire()
            assert lock.server == cluster.node_of(ROUND_ROBIN, key)
            await lock.release()

    asyncio.run(run())


def test_shards_through_the_client_in_each_mode(
    cluster: Cluster, static_fleet: list[ServerThread]
) -> None:
    with Client([cluster.servers[0].address], sharding_strategy="cluster") as client:
        (answer,) = client.shards()
    assert answer.shards is not None and answer.shards.mode == "cluster"
    assert answer.shards.leader == cluster.nodes[0]
    assert answer.shards.shards_per_member() == {
        node: len(range(i, SHARDS, 3)) for i, node in enumerate(cluster.nodes)
    }
    with Client([s.address for s in static_fleet]) as client:
        answers = client.shards()
    assert [a.shards.mode if a.shards else None for a in answers] == ["static"] * 3
    with ServerThread() as single, Client([single.address]) as client:
        (answer,) = client.shards()
    assert answer.shards == ShardsInfo(mode="single")


def test_release_by_token_goes_to_the_keys_node(cluster: Cluster) -> None:
    key = "released-elsewhere"
    with Client([cluster.servers[0].address], sharding_strategy="cluster") as holder:
        lock = holder.lock(key)
        assert lock.acquire()
        token = lock.token
        assert token is not None
        with Client([cluster.servers[2].address], sharding_strategy="cluster") as other:
            assert other.release(key, token)
        assert cluster.held_on(key) == []
        # The holder finds it gone (and stops renewing: left running, it reported the lock
        # lost after the cluster stopped, in whichever test ran then).
        assert lock.release() is False


@pytest.mark.parametrize("face", ["blocking", "asyncio"])
def test_a_member_that_died_is_routed_around_by_a_fresh_map(cluster: Cluster, face: str) -> None:
    """The cached map still names a member that is gone: the acquire asks the map again and
    goes to the key's new member, within its timeout (it raised at once before)."""
    key = next(k for k in KEYS if ROUND_ROBIN[shardmap.shard_id(k)] == 1)
    survivors = [2 if node == 1 else node for node in ROUND_ROBIN]
    seeds = [server.address for server in cluster.servers]

    def fail_over() -> None:
        cluster.servers[1].stop()
        cluster.set_map(survivors)

    if face == "blocking":
        with Client(seeds, sharding_strategy="cluster", acquire_timeout_s=5) as client:
            with client.lock("warm-up"):
                pass  # the map is cached: it names member 1 for the key
            fail_over()
            with client.lock(key) as lock:
                assert lock.server == cluster.servers[2].address
        return

    async def run() -> None:
        async with AsyncClient(seeds, sharding_strategy="cluster", acquire_timeout_s=5) as client:
            async with client.lock("warm-up"):
                pass
            fail_over()
            async with client.lock(key) as lock:
                assert lock.server == cluster.servers[2].address

    asyncio.run(run())


def test_an_unreachable_cluster_raises_once_the_acquire_timeout_ran_out(cluster: Cluster) -> None:
    key = next(k for k in KEYS if ROUND_ROBIN[shardmap.shard_id(k)] == 0)
    with Client([cluster.servers[0].address], sharding_strategy="cluster") as client:
        with client.lock("warm-up"):
            pass
        cluster.stop()  # every member, the only seed too
        started = time.monotonic()
        with pytest.raises(ServerUnavailable, match="cannot reach"):
            client.lock(key, acquire_timeout_s=1).acquire()
        assert time.monotonic() - started >= 0.9  # retried until its timeout, not at once


def test_stats_and_ping_of_a_cluster_ask_every_member_not_only_the_seeds(cluster: Cluster) -> None:
    """`celery dflock locks` lists what every member holds: a lock on a member that is not a
    seed shows (only the one seed was asked before)."""
    key = next(k for k in KEYS if ROUND_ROBIN[shardmap.shard_id(k)] == 2)
    seed = cluster.servers[0].address
    everyone = {f"{host}:{port}" for host, port in (s.address for s in cluster.servers)}
    with Client([seed], sharding_strategy="cluster") as client, client.lock(key):
        statuses = client.stats()
        assert {s.address for s in statuses} == everyone
        held = {s.address: [lock["key"] for lock in (s.stats or {})["locks"]] for s in statuses}
        assert held[f"{cluster.servers[2].host}:{cluster.servers[2].port}"] == [key]
        assert {s.address for s in client.ping()} == everyone

    async def run() -> None:
        async with AsyncClient([seed], sharding_strategy="cluster") as client:
            assert {s.address for s in await client.stats()} == everyone
            assert {s.address for s in await client.ping()} == everyone

    asyncio.run(run())
