"""`celery_dflock.fencing.redis` against a real Redis (keys named per test)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from celery_dflock.client.errors import InvalidValueError
from celery_dflock.fencing import FenceMissing, StaleFence
from celery_dflock.fencing.redis import fence_key_of, fenced_hset, fenced_set, highest_fence


@pytest.fixture
def key(store_redis: redis.Redis) -> Iterator[str]:
    name = f"fencing-test:{uuid.uuid4().hex}"
    try:
        yield name
    finally:
        store_redis.delete(name, fence_key_of(name))


def test_fenced_set_keeps_the_highest_fence_and_refuses_a_lower_one(
    store_redis: redis.Redis, key: str
) -> None:
    fenced_set(store_redis, key, "a", fence=100)
    fenced_set(store_redis, key, "b", fence=100)  # the same holder writes again: accepted
    assert store_redis.get(key) == b"b"
    fenced_set(store_redis, key, "c", fence=250)
    with pytest.raises(StaleFence, match=r"fence 249 is lower than 250") as refused:
        fenced_set(store_redis, key, "stale", fence=249)
    assert refused.value.highest == 250 and key in str(refused.value)
    assert store_redis.get(key) == b"c"
    assert highest_fence(store_redis.get(fence_key_of(key))) == 250


def test_fences_one_apart_at_todays_size_compare_exactly(
    store_redis: redis.Redis, key: str
) -> None:
    """A dflockd-server fence is about 1.8e18 (nanoseconds): as Lua numbers (doubles) two fences
    1 apart would be equal; the script compares them as padded strings."""
    fence = 1_800_000_000_000_000_001
    fenced_set(store_redis, key, "later", fence=fence)
    with pytest.raises(StaleFence):
        fenced_set(store_redis, key, "earlier", fence=fence - 1)
    assert store_redis.get(key) == b"later"


def test_a_write_without_a_fence_is_refused_and_nothing_is_written(
    store_redis: redis.Redis, key: str
) -> None:
    """``lock.fence`` is None on a lock server without fencing tokens: refused, not applied."""
    with pytest.raises(FenceMissing, match="carries no fence"):
        fenced_set(store_redis, key, "x", fence=None)
    with pytest.raises(FenceMissing):
        fenced_hset(store_redis, key, {"x": 1}, fence=None)
    assert store_redis.exists(key, fence_key_of(key)) == 0


def test_fenced_hset_keeps_the_fence_in_the_hash(store_redis: redis.Redis, key: str) -> None:
    fenced_hset(store_redis, key, {"total": 3, "by": "run-a"}, fence=10)
    fenced_hset(store_redis, key, {"total": 4}, fence=10)
    with pytest.raises(StaleFence, match=r"fence 9 is lower than 10"):
        fenced_hset(store_redis, key, {"total": 0, "by": "stale"}, fence=9)
    assert store_redis.hgetall(key) == {
        b"total": b"4",
        b"by": b"run-a",
        b"dflock_fence": b"00000000000000000010",
    }
    with pytest.raises(ValueError, match="holds the fence"):
        fenced_hset(store_redis, key, {"dflock_fence": 99}, fence=11)


def test_a_fence_kept_unpadded_compares_as_the_number_it_is(
    store_redis: redis.Redis, key: str
) -> None:
    """A fence set by other means than these scripts (``SET <key>:dflock_fence 7``, copied from
    a SQL row's fence) is a plain decimal. The script compared it as a string ("7" above
    "00000000000000000010") and refused the write, while the Python side saw 7 below 10 and
    raised nothing: the write was lost without a word."""
    store_redis.set(fence_key_of(key), "7")
    fenced_set(store_redis, key, "written", fence=10)
    assert store_redis.get(key) == b"written"
    store_redis.set(fence_key_of(key), "12")
    with pytest.raises(StaleFence, match=r"fence 10 is lower than 12"):
        fenced_set(store_redis, key, "stale", fence=10)
    assert store_redis.get(key) == b"written"

    store_redis.delete(key)
    store_redis.hset(key, "dflock_fence", "7")
    fenced_hset(store_redis, key, {"total": 1}, fence=10)
    assert store_redis.hget(key, "total") == b"1"
    store_redis.hset(key, "dflock_fence", "12")
    with pytest.raises(StaleFence, match=r"fence 10 is lower than 12"):
        fenced_hset(store_redis, key, {"total": 2}, fence=10)
    assert store_redis.hget(key, "total") == b"1"


def test_a_write_that_would_overwrite_its_own_fence_is_refused(
    store_redis: redis.Redis, key: str
) -> None:
    """``fence_key`` naming the value's own key wrote the fence over the value; a bytes field
    named as the fence field wrote the value over the fence. Both are refused, unwritten."""
    with pytest.raises(ValueError, match="fence_key is the value's own key"):
        fenced_set(store_redis, key, "value", fence=5, fence_key=key)
    with pytest.raises(ValueError, match="holds the fence"):
        fenced_hset(store_redis, key, {b"dflock_fence": "x"}, fence=5)  # pyright: ignore[reportArgumentType]
    assert store_redis.exists(key, fence_key_of(key)) == 0


@pytest.mark.parametrize("kept", ["junk", "1.5", "-5", "", "000000000000000000000300"])
def test_a_kept_fence_that_is_no_fence_is_refused_saying_so(
    store_redis: redis.Redis, key: str, kept: str
) -> None:
    """The script compared whatever the fence's key held as a padded string: "1.5", "-5" and ""
    let any write through, a 24-digit "...300" let fence 200 through, and "junk" refused the
    write with Python's ``invalid literal for int()``."""
    store_redis.set(fence_key_of(key), kept)
    with pytest.raises(InvalidValueError, match=re.escape(f"holds {kept!r}, not a fence of")):
        fenced_set(store_redis, key, "value", fence=200)
    assert store_redis.get(key) is None
    store_redis.delete(fence_key_of(key))
    store_redis.hset(key, mapping={"dflock_fence": kept, "total": 1})
    with pytest.raises(
        InvalidValueError, match=rf"the field 'dflock_fence' of the key '{key}' holds"
    ):
        fenced_hset(store_redis, key, {"total": 2}, fence=200)
    assert store_redis.hget(key, "total") == b"1"
    # highest_fence reads it as the scripts do ("junk" raised int()'s bare ValueError, "-5"
    # and the 24-digit "...300" were taken for fences).
    said = f"highest_fence: the kept fence read from Redis is {kept.encode()!r}, not a fence of"
    with pytest.raises(InvalidValueError, match=re.escape(said)):
        highest_fence(store_redis.hget(key, "dflock_fence"))


def test_a_key_of_another_type_is_named(store_redis: redis.Redis, key: str) -> None:
    """Redis's ``WRONGTYPE Operation against a key holding the wrong kind of value`` named no
    key and said nothing of what to do."""
    store_redis.set(key, "a string")
    said = f"the key '{key}' holds no hash: write it with fenced_set or fenced_hset only"
    with pytest.raises(InvalidValueError, match=re.escape(said)):
        fenced_hset(store_redis, key, {"total": 1}, fence=5)
    assert store_redis.get(key) == b"a string"
    store_redis.delete(key)
    store_redis.hset(fence_key_of(key), "a", 1)
    said = f"the key '{fence_key_of(key)}' holds no string"
    with pytest.raises(InvalidValueError, match=re.escape(said)):
        fenced_set(store_redis, key, "value", fence=5)
    assert store_redis.get(key) is None


def test_a_value_redis_cannot_store_is_named_with_its_key(
    store_redis: redis.Redis, key: str
) -> None:
    """None, a dict or a bool raised redis-py's ``DataError: Invalid input of type:
    'NoneType'``, naming no key or field."""
    bad: list[Any] = [None, {"a": 1}, True]
    for value in bad:
        said = f"fenced write to Redis key {key!r}: the value is {type(value).__name__} {value!r}"
        with pytest.raises(InvalidValueError, match=re.escape(said)):
            fenced_set(store_redis, key, value, fence=5)
        said = f"fenced write to Redis hash {key!r}: the field 'total' is {type(value).__name__}"
        with pytest.raises(InvalidValueError, match=re.escape(said)):
            fenced_hset(store_redis, key, {"total": value}, fence=5)
    assert store_redis.exists(key, fence_key_of(key)) == 0


def test_a_bytes_like_value_redis_py_sends_is_written(store_redis: redis.Redis, key: str) -> None:
    """redis-py sends a bytearray or a memoryview as it sends bytes; the check of what Redis
    stores refused them, saying Redis does not store them."""
    for fence, value in enumerate([bytearray(b"ba"), memoryview(b"mv")], start=5):
        fenced_set(store_redis, key, value, fence=fence)
        assert store_redis.get(key) == bytes(value)
        fenced_hset(store_redis, f"{key}:h", {"total": value}, fence=fence)
        assert store_redis.hget(f"{key}:h", "total") == bytes(value)
    store_redis.delete(f"{key}:h")
