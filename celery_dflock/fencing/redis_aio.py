"""Fenced writes to Redis through ``redis.asyncio``: the blocking face's functions
(`celery_dflock.fencing.redis`), awaited, with the same arguments and answers. A client is bound
to the loop it first connected on: make and close it inside the coroutine ``asyncio.run`` runs.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping

import redis.asyncio
from redis.asyncio.client import Pipeline
from redis.asyncio.cluster import ClusterPipeline

from celery_dflock.fencing._lua import ScriptCall, Value, fence_key_of, hset_call, set_call
from celery_dflock.fencing.fences import FENCE_COLUMN

__all__ = ["fence_key_of", "fenced_hset", "fenced_set"]


async def fenced_set(
    client: redis.asyncio.Redis,
    key: str,
    value: Value,
    *,
    fence: int | None,
    fence_key: str | None = None,
) -> None:
    """The blocking face's `~celery_dflock.fencing.redis.fenced_set`, awaited."""
    await _run(client, set_call(key, value, fence, fence_key))


async def fenced_hset(
    client: redis.asyncio.Redis,
    key: str,
    mapping: Mapping[str, Value],
    *,
    fence: int | None,
    fence_name: str = FENCE_COLUMN,
) -> None:
    """The blocking face's `~celery_dflock.fencing.redis.fenced_hset`, awaited."""
    await _run(client, hset_call(key, mapping, fence, fence_name))


async def _run(client: redis.asyncio.Redis, call: ScriptCall) -> None:
    if isinstance(client, Pipeline | ClusterPipeline):
        raise call.pipelined(client)
    if not inspect.iscoroutinefunction(getattr(client, "execute_command", None)):
        kind = f"{type(client).__module__}.{type(client).__name__}"
        raise TypeError(
            f"{call.helper} is the asyncio face and runs on redis.asyncio.Redis, not {kind}: use "
            f"celery_dflock.fencing.redis.{call.helper} for a blocking client"
        )
    seen = await client.register_script(call.script)(keys=call.keys, args=call.args)
    call.refuse(seen)
