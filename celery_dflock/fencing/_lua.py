"""The Lua scripts of both Redis faces (`celery_dflock.fencing.redis` tells how they fence)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from celery_dflock.fencing.fences import FENCE_COLUMN, require_fence

__all__ = [
    "HSET",
    "SET",
    "ScriptCall",
    "Value",
    "fence_key_of",
    "hset_call",
    "pipelined",
    "set_call",
]

Value = str | bytes | int | float

SET: Final = """
local seen = redis.call('GET', KEYS[2])
if seen and string.rep('0', #ARGV[1] - #seen) .. seen > ARGV[1] then return seen end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('SET', KEYS[2], ARGV[1])
return false
"""
"""KEYS: the value's key, the fence's key; ARGV: the padded fence, the value. Nil if written,
else the fence that refused it. The kept fence is padded as it is compared: one set by other
means than these scripts (``SET <key>:dflock_fence 12``) compares as the number it is."""

HSET: Final = """
local seen = redis.call('HGET', KEYS[1], ARGV[1])
if seen and string.rep('0', #ARGV[2] - #seen) .. seen > ARGV[2] then return seen end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2], unpack(ARGV, 3))
return false
"""
"""KEYS: the hash; ARGV: the fence's field, the padded fence, then field, value, ... Nil if
written, else the fence that refused it."""


def fence_key_of(key: str) -> str:
    """Where ``fenced_set`` keeps ``key``'s fence by default: ``<key>:dflock_fence``."""
    return f"{key}:{FENCE_COLUMN}"


@dataclass(frozen=True, slots=True)
class ScriptCall:
    """One call of a script: its text, keys and arguments, and what names its target."""

    script: str
    keys: list[str]
    args: list[Value]
    label: str
    fence: int


def set_call(key: str, value: Value, fence: int | None, fence_key: str | None) -> ScriptCall:
    label = f"Redis key {key!r}"
    checked = require_fence(fence, label)
    where = fence_key or fence_key_of(key)
    if where == key:
        raise ValueError(f"fenced write to {label}: fence_key is the value's own key; name another")
    return ScriptCall(SET, [key, where], [_padded(checked), value], label, checked)


def hset_call(
    key: str, mapping: Mapping[str, Value], fence: int | None, fence_name: str
) -> ScriptCall:
    label = f"Redis hash {key!r}"
    checked = require_fence(fence, label)
    if not mapping:
        raise ValueError(f"fenced write to {label}: no fields to set")
    if fence_name in mapping or fence_name.encode() in mapping:
        raise ValueError(f"fenced write to {label}: the field {fence_name!r} holds the fence")
    args: list[Value] = [fence_name, _padded(checked)]
    for field, value in mapping.items():
        args += [field, value]
    return ScriptCall(HSET, [key], args, label, checked)


def pipelined(helper: str, client: object) -> TypeError:
    """The refusal of a pipeline, which answers only at ``execute()``."""
    kind = f"{type(client).__module__}.{type(client).__name__}"
    return TypeError(
        f"{helper} runs on a client, not a pipeline ({kind}): a pipeline answers at "
        "execute(), too late to tell a refused write; call it on the client itself"
    )


def _padded(fence: int) -> str:
    return f"{fence:020d}"
