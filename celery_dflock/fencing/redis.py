"""Fenced writes to Redis (needs redis-py: ``celery-dflock[redis]``).

Each write is one Lua script, which Redis runs atomically: it reads the highest fence kept
beside the value, refuses the write if that is higher than the write's, and otherwise writes
the value and the fence. Fences are kept as 20-digit zero-padded decimal strings and compared
as strings (Lua's numbers are doubles, which cannot tell two fences 1 apart).

* `fenced_set`: a string value at ``key``, its fence at ``key:dflock_fence`` (``fence_key``).
  In Redis Cluster both must hash to one slot: give ``key`` a hash tag (``{account:7}``), or
  name a ``fence_key`` with the same tag.
* `fenced_hset`: fields of the hash at ``key``, its fence in the hash's own ``dflock_fence``
  field (``fence_name``).

The fence is kept for as long as the value: an expiry or a ``DEL`` of the fence's key forgets
it (the next write, whatever its fence, is accepted), so give the fence's key no shorter life
than the value's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import redis

from celery_dflock.fencing.errors import StaleFence
from celery_dflock.fencing.fences import FENCE_COLUMN, require_fence

__all__ = ["fence_key_of", "fenced_hset", "fenced_set", "highest_fence"]

Value = str | bytes | int | float

_SET: Final = """
local seen = redis.call('GET', KEYS[2])
if seen and seen > ARGV[1] then return seen end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('SET', KEYS[2], ARGV[1])
return false
"""
"""KEYS: the value's key, the fence's key; ARGV: the padded fence, the value. Nil if written,
else the fence that refused it."""

_HSET: Final = """
local seen = redis.call('HGET', KEYS[1], ARGV[1])
if seen and seen > ARGV[2] then return seen end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2], unpack(ARGV, 3))
return false
"""
"""KEYS: the hash; ARGV: the fence's field, the padded fence, then field, value, ... Nil if
written, else the fence that refused it."""


def fence_key_of(key: str) -> str:
    """Where `fenced_set` keeps ``key``'s fence by default: ``<key>:dflock_fence``."""
    return f"{key}:{FENCE_COLUMN}"


def fenced_set(
    client: redis.Redis,
    key: str,
    value: Value,
    *,
    fence: int | None,
    fence_key: str | None = None,
) -> None:
    """``SET key value`` if ``fence`` is at least the highest fence written to ``key``, and
    keep ``fence`` as the highest; atomic (one script).

    A fence equal to the highest is accepted (one holder writes several times); a lower one
    raises `StaleFence` and None raises `FenceMissing`, both without writing.
    """
    where = fence_key or fence_key_of(key)
    label = f"Redis key {key!r}"
    checked = require_fence(fence, label)
    seen = client.register_script(_SET)(keys=[key, where], args=[_padded(checked), value])
    _refused_if(seen, label, checked)


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
    label = f"Redis hash {key!r}"
    checked = require_fence(fence, label)
    if not mapping:
        raise ValueError(f"fenced write to {label}: no fields to set")
    if fence_name in mapping:
        raise ValueError(f"fenced write to {label}: the field {fence_name!r} holds the fence")
    args: list[Value] = [fence_name, _padded(checked)]
    for field, value in mapping.items():
        args += [field, value]
    seen = client.register_script(_HSET)(keys=[key], args=args)
    _refused_if(seen, label, checked)


def highest_fence(raw: bytes | str | None) -> int | None:
    """A kept fence as an int (``GET`` of the fence's key, ``HGET`` of the fence field)."""
    return None if raw is None else int(raw)


def _padded(fence: int) -> str:
    return f"{fence:020d}"


def _refused_if(seen: object, label: str, fence: int) -> None:
    if seen is None:
        return
    highest = highest_fence(seen if isinstance(seen, bytes | str) else str(seen))
    raise StaleFence.refused(label, fence, highest or 0)
