"""The Lua scripts of both Redis faces (`celery_dflock.fencing.redis` tells how they fence)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, cast

from celery_dflock.client.errors import InvalidValueError
from celery_dflock.fencing.fences import FENCE_COLUMN, refuse_below, require_fence

Value = str | bytes | bytearray | memoryview | int | float

_COMPARE: Final = """
if type(seen) == 'table' then return {} end
if seen and not (#seen <= 20 and string.find(seen, '^%d+$')) then return {seen} end
if seen and string.rep('0', 20 - #seen) .. seen > ARGV[1] then return seen end
"""
"""Nil if ``seen``, the kept fence, is none or not above ARGV[1], the padded fence; else the
fence that refuses the write, or, when it is no fence (20 digits at most), it in a list (an
empty list: the key read holds another type of value, ``seen`` its error). The kept fence is
padded as it is compared: one set by other means than these scripts
(``SET <key>:dflock_fence 12``) compares as the number it is."""

SET: Final = f"""local seen = redis.pcall('GET', KEYS[2]){_COMPARE}
redis.call('SET', KEYS[1], ARGV[2])
redis.call('SET', KEYS[2], ARGV[1])
return false
"""
"""KEYS: the value's key, the fence's key; ARGV: the padded fence, the value."""

HSET: Final = f"""local seen = redis.pcall('HGET', KEYS[1], ARGV[2]){_COMPARE}
redis.call('HSET', KEYS[1], ARGV[2], ARGV[1], unpack(ARGV, 3))
return false
"""
"""KEYS: the hash; ARGV: the padded fence, the fence's field, then field, value, ..."""


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

    @property
    def helper(self) -> str:
        """The function of each face that makes this call."""
        return "fenced_hset" if self.script == HSET else "fenced_set"

    def pipelined(self, client: object) -> TypeError:
        """The refusal of a pipeline, which answers only at ``execute()``."""
        kind = f"{type(client).__module__}.{type(client).__name__}"
        return TypeError(
            f"{self.helper} runs on a client, not a pipeline ({kind}): a pipeline answers at "
            "execute(), too late to tell a refused write; call it on the client itself"
        )

    def refuse(self, seen: object) -> None:
        """Raise what the script's answer ``seen`` says refused the write, if it did."""
        if not isinstance(seen, list):
            return refuse_below(self.label, self.fence, seen)
        hashed, where = self.script == HSET, f"the key {self.keys[-1]!r}"
        what = f"no {'hash' if hashed else 'string'}: write it with fenced_set or fenced_hset only"
        if seen:  # the kept fence, which is no fence
            raw = cast("list[bytes | str]", seen)[0]
            text = raw.decode(errors="replace") if isinstance(raw, bytes) else raw
            where = f"the field {self.args[1]!r} of {where}" if hashed else where
            what = f"{text!r}, not a fence of up to 20 digits: set it to the highest fence written"
        raise InvalidValueError(
            f"fenced write to {self.label} refused: {where} holds {what}; nothing was written"
        )


def set_call(key: str, value: Value, fence: int | None, fence_key: str | None) -> ScriptCall:
    label = f"Redis key {key!r}"
    checked = require_fence(fence, label)
    where = fence_key or fence_key_of(key)
    if where == key:
        raise ValueError(f"fenced write to {label}: fence_key is the value's own key; name another")
    return ScriptCall(
        SET, [key, where], [_padded(checked), _stored(label, "the value", value)], label, checked
    )


def hset_call(
    key: str, mapping: Mapping[str, Value], fence: int | None, fence_name: str
) -> ScriptCall:
    label = f"Redis hash {key!r}"
    checked = require_fence(fence, label)
    if not mapping:
        raise ValueError(f"fenced write to {label}: no fields to set")
    if fence_name in mapping or fence_name.encode() in mapping:
        raise ValueError(f"fenced write to {label}: the field {fence_name!r} holds the fence")
    args: list[Value] = [_padded(checked), fence_name]
    for field, value in mapping.items():
        args += [field, _stored(label, f"the field {field!r}", value)]
    return ScriptCall(HSET, [key], args, label, checked)


def _stored(label: str, what: str, value: object) -> Value:
    """``value`` if Redis stores it as it is (redis-py refuses the rest, naming nothing)."""
    if isinstance(value, Value) and not isinstance(value, bool):
        return cast("Value", value)
    raise InvalidValueError(
        f"fenced write to {label}: {what} is {type(value).__name__} {value!r}, which Redis "
        "does not store: give a str, bytes (or bytes-like), int or float (json.dumps a "
        "structure)"
    )


def _padded(fence: int) -> str:
    return f"{fence:020d}"
