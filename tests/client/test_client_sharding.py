"""Sharding: crc32 compatibility with every dflockd client, rendezvous movement, validation."""

from __future__ import annotations

import zlib
from collections.abc import Callable

import pytest
from hypothesis import given, settings, strategies as st

from celery_dflock import DistributedLock, rendezvous_shard, stable_hash_shard
from celery_dflock.client.sharding import select_server, validate_servers
from dflockd_server.testing import ServerThread
from tests.support.wire import held_keys

# key -> crc32(key) % 3, written out so that a change in the formula fails this table.
CRC32_MOD_3 = {
    "job-0": 1,
    "job-1": 2,
    "job-2": 0,
    "job-3": 0,
    "job-7": 1,
    "job-8": 1,
    "job-11": 0,
    "user:1": 0,
    "user:2": 1,
    "beat:scheduler": 1,
    "report:42": 2,
    "ключ": 0,
    "🔒lock": 1,
}


def test_stable_hash_shard_is_crc32_mod_n() -> None:
    assert len(CRC32_MOD_3) >= 10
    for key, index in CRC32_MOD_3.items():
        assert zlib.crc32(key.encode("utf-8")) % 3 == index
        assert stable_hash_shard(key, 3) == index
    # a few raw values, independent of zlib
    assert zlib.crc32(b"job-2") == 3578489733
    assert stable_hash_shard("job-2", 7) == 3578489733 % 7 == 0
    assert stable_hash_shard("user:2", 1) == 0
    for key in CRC32_MOD_3:
        for n in range(1, 9):
            assert stable_hash_shard(key, n) == zlib.crc32(key.encode("utf-8")) % n


def test_keys_route_to_servers_by_crc32(
    dflock_server_factory: Callable[..., ServerThread],
) -> None:
    servers = [dflock_server_factory() for _ in range(3)]
    addresses = [s.address for s in servers]
    locks = [DistributedLock(key, acquire_timeout_s=0, servers=addresses) for key in CRC32_MOD_3]
    try:
        for lock in locks:
            assert lock.acquire()
            assert lock.server == addresses[CRC32_MOD_3[lock.key]]
        for index, server in enumerate(servers):
            expected = {key for key, i in CRC32_MOD_3.items() if i == index}
            assert held_keys(server.address) == expected
    finally:
        for lock in locks:
            lock.release()


def test_rendezvous_routes_on_server_identity_not_order(
    dflock_server_factory: Callable[..., ServerThread],
) -> None:
    servers = [dflock_server_factory() for _ in range(2)]
    addresses = [s.address for s in servers]
    keys = [f"tenant:{i}" for i in range(12)]
    for key in keys:
        forward = DistributedLock(key, servers=addresses, sharding_strategy=rendezvous_shard)
        backward = DistributedLock(key, servers=addresses[::-1], sharding_strategy=rendezvous_shard)
        assert forward.server == backward.server
    locks = [
        DistributedLock(k, 0, servers=addresses, sharding_strategy=rendezvous_shard) for k in keys
    ]
    try:
        for lock in locks:
            assert lock.acquire()
        by_server = [held_keys(a) for a in addresses]
        assert set().union(*by_server) == set(keys)
        for lock in locks:
            assert lock.key in by_server[addresses.index(lock.server)]
    finally:
        for lock in locks:
            lock.release()


server_ids = st.lists(
    st.tuples(st.from_regex(r"[a-z][a-z0-9-]{0,12}", fullmatch=True), st.integers(1, 65535)).map(
        lambda hp: f"{hp[0]}:{hp[1]}"
    ),
    min_size=3,
    max_size=9,
    unique=True,
)


@settings(max_examples=15)
@given(
    ids=server_ids,
    prefix=st.text(alphabet="abcdefghij:_-", min_size=0, max_size=8),
    position=st.integers(0, 100),
)
def test_adding_a_server_moves_few_keys_with_rendezvous(
    ids: list[str], prefix: str, position: int
) -> None:
    new, old = ids[0], ids[1:]
    n = len(old)
    grown = list(old)
    grown.insert(position % (n + 1), new)  # anywhere: rendezvous hashes identities
    keys = [f"{prefix}{i}" for i in range(2000)]

    rendezvous_moved = 0
    crc_moved = 0
    for key in keys:
        before = old[select_server(key, old, rendezvous_shard)]
        after = grown[select_server(key, grown, rendezvous_shard)]
        if before != after:
            rendezvous_moved += 1
            assert after == new  # a key only ever moves to the added server
        crc_moved += stable_hash_shard(key, n) != stable_hash_shard(key, n + 1)

    assert rendezvous_moved < 1.6 / (n + 1) * len(keys)
    assert rendezvous_moved > 0.4 / (n + 1) * len(keys)
    assert crc_moved > 0.5 * len(keys)


def test_rendezvous_called_with_a_count_hashes_indexes() -> None:
    keys = [f"k{i}" for i in range(500)]
    for key in keys:
        index = rendezvous_shard(key, 4)
        assert 0 <= index < 4
        assert index == select_server(key, ["0", "1", "2", "3"], rendezvous_shard)
    assert len({rendezvous_shard(k, 4) for k in keys}) == 4
    assert repr(rendezvous_shard) == "rendezvous_shard"


def _always(value: object) -> Callable[[str, int], int]:
    def strategy(key: str, n: int) -> int:
        return value  # type: ignore[return-value]  # pyright: ignore[reportReturnType]

    return strategy


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (3, r"returned 3 for key 'k', outside \[0, 3\)"),
        (-1, r"returned -1 for key 'k', outside \[0, 3\)"),
        ("1", "returned '1' for key 'k': it must return an int"),
        (1.0, "returned 1.0"),
        (True, "returned True"),
        (None, "returned None"),
    ],
)
def test_custom_strategy_results_are_validated(value: object, match: str) -> None:
    servers = [("h", 1), ("h", 2), ("h", 3)]
    with pytest.raises(ValueError, match=match) as info:
        select_server("k", servers, _always(value))
    assert "strategy" in str(info.value) and "_always.<locals>.strategy" in str(info.value)
    with pytest.raises(ValueError, match=match):
        DistributedLock("k", servers=servers, sharding_strategy=_always(value))


def test_custom_strategy_is_used() -> None:
    servers = [("a", 1), ("b", 2), ("c", 3)]
    assert DistributedLock("any", servers=servers, sharding_strategy=_always(2)).server == ("c", 3)


@pytest.mark.parametrize(
    ("servers", "match"),
    [
        ([], "servers is empty"),
        ("localhost:6388", "list of .host, port. tuples"),
        ([("h",)], r"\(host, port\) tuple"),
        ([("h", 1, 2)], r"\(host, port\) tuple"),
        ([("", 1)], "non-empty string"),
        ([("h", "6388")], "port must be an int"),
        ([("h", 0)], "port must be an int in 1..65535"),
        ([("h", 70000)], "1..65535"),
        # a URL's scheme or path, or a space, is no host: it failed at every connect instead
        ([("tcp://127.0.0.1", 6388)], r"server host 'tcp://127.0.0.1' is not a host name"),
        ([("my host", 6388)], r"server host 'my host' is not a host name"),
    ],
)
def test_bad_server_lists_are_refused_clearly(servers: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate_servers(servers)  # type: ignore[arg-type]  # pyright: ignore[reportArgumentType]


def test_bad_server_count() -> None:
    with pytest.raises(ValueError, match="number of servers"):
        stable_hash_shard("k", 0)
    with pytest.raises(ValueError, match="number of servers"):
        rendezvous_shard("k", 0)
