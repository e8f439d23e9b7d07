"""Fenced writes to Redis (needs redis-py: ``celery-dflock[redis]``); how fences are kept and
compared is in [Fenced writes](../fencing.md#redis), the asyncio face is
`celery_dflock.fencing.redis_aio`.

Each write is one Lua script, which Redis runs atomically: it reads the highest fence kept
beside the value, refuses the write if that is higher than the write's, and otherwise writes
the value and the fence. An expiry or a ``DEL`` of the fence's key forgets it (the next write
is accepted), so give the fence's key no shorter life than the value's.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import redis
from redis.client import Pipeline
from redis.cluster import ClusterPipeline

from celery_dflock.client.errors import InvalidValueError
from celery_dflock.fencing._lua import ScriptCall, Value, fence_key_of, hset_call, set_call
from celery_dflock.fencing.fences import FENCE_COLUMN

__all__ = ["fence_key_of", "fenced_hset", "fenced_set", "highest_fence"]


def fenced_set(
    client: redis.Redis, key: str, value: Value, *, fence: int | None, fence_key: str | None = None
) -> None:
    """``SET key value`` if ``fence`` is at least the highest fence written to ``key``, and
    keep ``fence`` as the highest at ``fence_key`` (default ``key:dflock_fence``; in Redis
    Cluster, give both one hash tag); atomic. A lower fence raises `StaleFence` and None
    `FenceMissing`, both without writing."""
    _run(client, set_call(key, value, fence, fence_key))


def fenced_hset(
    client: redis.Redis,
    key: str,
    mapping: Mapping[str, Value],
    *,
    fence: int | None,
    fence_name: str = FENCE_COLUMN,
) -> None:
    """``HSET key field value ...`` if ``fence`` is at least the hash's ``fence_name`` field,
    and set that field to ``fence``; atomic (one script). Refusals as `fenced_set`."""
    _run(client, hset_call(key, mapping, fence, fence_name))


def highest_fence(raw: bytes | str | None) -> int | None:
    """A kept fence as an int (``GET`` of the fence's key, ``HGET`` of the fence field); one
    that is no fence (the scripts' rule: up to 20 decimal digits) raises `InvalidValueError`."""
    if raw is None:
        return None
    text = raw.decode("ascii", "replace") if isinstance(raw, bytes) else raw
    if isinstance(text, str) and 0 < len(text) <= 20 and text.isascii() and text.isdigit():  # pyright: ignore[reportUnnecessaryIsInstance]
        return int(text)
    raise InvalidValueError(
        f"highest_fence: the kept fence read from Redis is {raw!r}, not a fence of up to 20 "
        "digits; pass what GET of the fence's key (fence_key_of(key)) or HGET of the hash's "
        f"{FENCE_COLUMN!r} field returns, and set a kept fence to the highest fence written"
    )


def _run(client: redis.Redis, call: ScriptCall) -> None:
    if isinstance(client, Pipeline | ClusterPipeline):
        raise call.pipelined(client)
    script = getattr(client, "register_script", None)
    if script is None or inspect.iscoroutinefunction(getattr(client, "execute_command", None)):
        raise TypeError(_unsupported(call.helper, client))
    seen: object = script(call.script)(keys=call.keys, args=call.args)
    if inspect.isawaitable(seen):  # an asyncio client of another make: nothing was sent
        if callable(close := getattr(seen, "close", None)):
            close()
        raise TypeError(_unsupported(call.helper, client))
    call.refuse(seen)


def _unsupported(helper: str, client: object) -> str:
    kind = f"{type(client).__module__}.{type(client).__name__}"
    if kind.startswith("redis.asyncio"):
        return (
            f"{helper} is the blocking face and runs on redis.Redis, not {kind}: use "
            f"celery_dflock.fencing.redis_aio.{helper} (await it) for redis.asyncio"
        )
    return f"{helper} runs on a blocking redis-py client (redis.Redis), not {kind}"
