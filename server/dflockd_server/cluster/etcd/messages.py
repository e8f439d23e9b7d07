"""etcd v3's messages as its JSON gateway takes and gives them (pure: no I/O): keys and
values in base64, 64-bit integers as strings, fields at their zero value left out of replies
(a failed transaction has no ``succeeded``, a put event no ``type``).
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import Any, Literal, cast

MAX_TXN_OPS = 128  # etcd's default limit of operations in one transaction (--max-txn-ops)


def as_dict(value: Any) -> dict[str, Any] | None:
    """A decoded JSON object, or None for any other JSON value."""
    return cast("dict[str, Any]", value) if isinstance(value, dict) else None


def b64(text: str) -> str:
    return base64.b64encode(text.encode("utf-8")).decode("ascii")


def unb64(data: str) -> str:
    return base64.b64decode(data).decode("utf-8")


def prefix_end(prefix: str) -> str:
    """The ``range_end`` covering every key starting with ``prefix`` (empty: all). UTF-8 has
    no byte 0xff, so the last byte can always be raised."""
    raw = bytearray(prefix.encode("utf-8"))
    if not raw:
        return "\0"
    raw[-1] += 1
    # The result may not be valid UTF-8: it travels as base64 of raw bytes (see b64_raw).
    return raw.decode("utf-8", errors="surrogateescape")


def b64_raw(text: str) -> str:
    return base64.b64encode(text.encode("utf-8", errors="surrogateescape")).decode("ascii")


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    value: str
    create_revision: int
    mod_revision: int
    version: int
    lease: int

    @classmethod
    def from_json(cls, kv: dict[str, Any]) -> KeyValue:
        return cls(
            key=unb64(kv.get("key", "")),
            value=unb64(kv.get("value", "")),
            create_revision=int(kv.get("create_revision", 0)),
            mod_revision=int(kv.get("mod_revision", 0)),
            version=int(kv.get("version", 0)),
            lease=int(kv.get("lease", 0)),
        )


@dataclass(frozen=True, slots=True)
class RangeResult:
    kvs: list[KeyValue]
    revision: int  # the store's revision at the read (a watch from revision + 1 misses nothing)


@dataclass(frozen=True, slots=True)
class RangeStat:
    """What one read of a range says without its keys' values (``EtcdClient.stat``)."""

    count: int
    modified: bool  # some key of the range was put after the revision asked about
    revision: int


@dataclass(frozen=True, slots=True)
class Lease:
    id: int
    ttl: int


@dataclass(frozen=True, slots=True)
class Compare:
    """One condition of a transaction, e.g. ``Compare(key, "CREATE", "EQUAL", 0)``."""

    key: str
    target: Literal["VERSION", "CREATE", "MOD", "VALUE", "LEASE"]
    result: Literal["EQUAL", "GREATER", "LESS", "NOT_EQUAL"]
    value: int | str

    @classmethod
    def unchanged(cls, key: str, revision: int) -> Compare:
        """``key`` still at ``mod_revision`` ``revision`` (0: still absent)."""
        if revision == 0:
            return cls(key, "CREATE", "EQUAL", 0)
        return cls(key, "MOD", "EQUAL", revision)

    def to_json(self) -> dict[str, Any]:
        name = {"CREATE": "create_revision", "MOD": "mod_revision"}.get(self.target)
        value = b64(self.value) if isinstance(self.value, str) else str(self.value)
        return {
            "key": b64(self.key),
            "target": self.target,
            "result": self.result,
            name or self.target.lower(): value,
        }


@dataclass(frozen=True, slots=True)
class Put:
    key: str
    value: str
    lease: int = 0

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"key": b64(self.key), "value": b64(self.value)}
        if self.lease:
            body["lease"] = str(self.lease)
        return {"request_put": body}


def key_range(key: str, prefix: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"key": b64(key)}
    if prefix:
        body["range_end"] = b64_raw(prefix_end(key))
    return body


@dataclass(frozen=True, slots=True)
class Delete:
    key: str
    prefix: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"request_delete_range": key_range(self.key, self.prefix)}


@dataclass(frozen=True, slots=True)
class Get:
    key: str
    prefix: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"request_range": key_range(self.key, self.prefix)}


Op = Put | Delete | Get


@dataclass(frozen=True, slots=True)
class TxnResult:
    succeeded: bool
    revision: int
    ranges: list[list[KeyValue]] = field(default_factory=lambda: [])
    """The key-values of each ``Get`` of the branch that ran, in order."""


@dataclass(frozen=True, slots=True)
class WatchEvent:
    type: Literal["put", "delete"]
    kv: KeyValue  # for a delete: the key and the deletion's revision (mod_revision), no value


def error_detail(error: Any) -> tuple[str, int]:
    """etcd's error as text and its HTTP code (a stream's error is an object with both)."""
    data = as_dict(error)
    if data is None:
        return str(error), 0
    return str(data.get("message") or data.get("error") or data), int(data.get("http_code", 0))
