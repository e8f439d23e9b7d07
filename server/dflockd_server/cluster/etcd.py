"""A small etcd v3 client over etcd's JSON gateway (HTTP/1.1, standard library only).

etcd serves its gRPC API as JSON at ``POST /v3/<service>/<method>`` on the client URL, with keys
and values in base64 and 64-bit integers as strings; fields at their zero value are left out of
replies (a failed transaction has no ``succeeded``, a put event no ``type``). This module covers
what the lock cluster needs: ranges (one key or a prefix), put (optionally under a lease),
delete, transactions (with create-if-absent and value-equals helpers), leases (grant, one
keep-alive, revoke, time to live) and watching a key or prefix from a thread.

Every call opens its own connection, so one ``EtcdClient`` may be used from several threads.
Failures raise ``EtcdError`` naming the etcd URL and the operation.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import queue
import socket
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast
from urllib.parse import urlsplit

MAX_TXN_OPS = 128
"""etcd's default limit of operations in one transaction (``--max-txn-ops``)."""


class EtcdError(Exception):
    """An etcd request failed (the message names the etcd URL and the operation)."""


class DuplicateMember(EtcdError):
    """Another live process is registered in the cluster under this member's address."""


def _as_dict(value: Any) -> dict[str, Any] | None:
    """A decoded JSON object, or None for any other JSON value."""
    return cast("dict[str, Any]", value) if isinstance(value, dict) else None


def _b64(text: str) -> str:
    return base64.b64encode(text.encode("utf-8")).decode("ascii")


def _unb64(data: str) -> str:
    return base64.b64decode(data).decode("utf-8")


def prefix_end(prefix: str) -> str:
    """The ``range_end`` that makes a range cover every key starting with ``prefix``.

    The prefix's UTF-8 bytes with the last byte below 0xff incremented (and what follows it
    dropped); an empty prefix, or one of only 0xff bytes, means "every key" (``"\\0"``).
    """
    raw = bytearray(prefix.encode("utf-8"))
    while raw and raw[-1] == 0xFF:
        raw.pop()
    if not raw:
        return "\0"
    raw[-1] += 1
    # The result may not be valid UTF-8: it travels as base64 of raw bytes (see _b64_raw).
    return raw.decode("utf-8", errors="surrogateescape")


def _b64_raw(text: str) -> str:
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
            key=_unb64(kv.get("key", "")),
            value=_unb64(kv.get("value", "")),
            create_revision=int(kv.get("create_revision", 0)),
            mod_revision=int(kv.get("mod_revision", 0)),
            version=int(kv.get("version", 0)),
            lease=int(kv.get("lease", 0)),
        )


@dataclass(frozen=True, slots=True)
class RangeResult:
    kvs: list[KeyValue]
    revision: int
    """The store's revision when the range was read (watching from ``revision + 1`` misses
    nothing)."""


@dataclass(frozen=True, slots=True)
class Lease:
    id: int
    ttl: int


# -- transactions -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Compare:
    """One condition of a transaction, e.g. ``Compare(key, "CREATE", "EQUAL", 0)``."""

    key: str
    target: Literal["VERSION", "CREATE", "MOD", "VALUE", "LEASE"]
    result: Literal["EQUAL", "GREATER", "LESS", "NOT_EQUAL"]
    value: int | str

    def to_json(self) -> dict[str, Any]:
        field_name = {
            "VERSION": "version",
            "CREATE": "create_revision",
            "MOD": "mod_revision",
            "VALUE": "value",
            "LEASE": "lease",
        }[self.target]
        value = _b64(self.value) if isinstance(self.value, str) else str(self.value)
        return {
            "key": _b64(self.key),
            "target": self.target,
            "result": self.result,
            field_name: value,
        }


@dataclass(frozen=True, slots=True)
class Put:
    key: str
    value: str
    lease: int = 0

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {"key": _b64(self.key), "value": _b64(self.value)}
        if self.lease:
            body["lease"] = str(self.lease)
        return {"request_put": body}


def _key_range(key: str, prefix: bool) -> dict[str, Any]:
    """One key, or every key under ``key`` as a prefix, as etcd's JSON gateway takes them."""
    body: dict[str, Any] = {"key": _b64(key)}
    if prefix:
        body["range_end"] = _b64_raw(prefix_end(key))
    return body


@dataclass(frozen=True, slots=True)
class Delete:
    key: str
    prefix: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"request_delete_range": _key_range(self.key, self.prefix)}


@dataclass(frozen=True, slots=True)
class Get:
    key: str
    prefix: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"request_range": _key_range(self.key, self.prefix)}


Op = Put | Delete | Get


@dataclass(frozen=True, slots=True)
class TxnResult:
    succeeded: bool
    revision: int
    ranges: list[list[KeyValue]] = field(default_factory=lambda: [])
    """The key-values of each ``Get`` of the branch that ran, in order."""


# -- watching -----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class WatchEvent:
    type: Literal["put", "delete"]
    kv: KeyValue
    """For a delete: the key and the deletion's revision (``mod_revision``), value empty."""


class Watch:
    """A running watch of a key or prefix (a thread reading etcd's event stream).

    Events go to ``on_event`` when given (called in the watch's thread), else to a queue read
    with ``next_event``. ``stop`` closes the stream and joins the thread. If the stream fails,
    ``error`` says why and ``next_event`` raises it once the queued events are read.
    """

    def __init__(
        self,
        client: EtcdClient,
        key: str,
        *,
        prefix: bool,
        start_revision: int,
        on_event: Callable[[WatchEvent], None] | None,
    ) -> None:
        self._client = client
        self._key = key
        self._prefix = prefix
        self._start_revision = start_revision
        self._on_event = on_event
        self._events: queue.Queue[WatchEvent | None] = queue.Queue()
        self._stopping = threading.Event()
        self._created = threading.Event()
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()
        self.error: EtcdError | None = None
        self.last_revision = 0
        """The revision of the last event delivered (resume from ``last_revision + 1``)."""
        self._thread = threading.Thread(target=self._run, name=f"etcd-watch {key!r}", daemon=True)

    def start(self, timeout: float) -> Watch:
        """Start, and return once etcd confirmed the watch (later changes are all seen)."""
        self._thread.start()
        if not self._created.wait(timeout):
            self.stop()
            raise EtcdError(
                f"etcd at {self._client.url}: watch of {self._key!r} not confirmed in {timeout} s"
            )
        if self.error is not None:
            self._thread.join(timeout)
            raise self.error
        return self

    def next_event(self, timeout: float) -> WatchEvent | None:
        """The next event, or ``None`` after ``timeout`` seconds without one."""
        try:
            event = self._events.get(timeout=timeout)
        except queue.Empty:
            return None
        if event is None:
            self._events.put(None)  # keep the end marker for later calls
            if self.error is not None:
                raise self.error
            return None
        return event

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        with self._lock:
            conn = self._conn
        if conn is not None and conn.sock is not None:
            sock: socket.socket = conn.sock
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _run(self) -> None:
        create: dict[str, Any] = {"key": _b64(self._key)}
        if self._prefix:
            create["range_end"] = _b64_raw(prefix_end(self._key))
        if self._start_revision:
            create["start_revision"] = str(self._start_revision)
        what = f"watch of {self._key!r}"
        try:
            conn = self._client.connect(timeout=None)
            with self._lock:
                self._conn = conn
            if self._stopping.is_set():
                return
            response = self._client.send(conn, "/v3/watch", {"create_request": create}, what)
            while not self._stopping.is_set():
                line = response.readline()
                if not line:
                    if not self._stopping.is_set():
                        raise EtcdError(f"etcd at {self._client.url}: {what} ended by etcd")
                    return
                if line.strip():
                    message = _as_dict(json.loads(line))
                    if message is None:
                        raise EtcdError(f"etcd at {self._client.url}: {what}: bad line {line!r}")
                    self._handle(message, what)
        except (OSError, http.client.HTTPException, ValueError, EtcdError) as exc:
            if not self._stopping.is_set():
                self.error = (
                    exc
                    if isinstance(exc, EtcdError)
                    else EtcdError(f"etcd at {self._client.url}: {what} failed: {exc!r}")
                )
        finally:
            with self._lock:
                conn = self._conn
                self._conn = None
            if conn is not None:
                conn.close()
            self._created.set()
            self._events.put(None)

    def _handle(self, message: dict[str, Any], what: str) -> None:
        if "error" in message:
            raise EtcdError(f"etcd at {self._client.url}: {what} failed: {message['error']}")
        result: dict[str, Any] = message.get("result", {})
        if result.get("created"):
            self._created.set()
        if result.get("canceled"):
            reason = result.get("cancel_reason") or (
                f"compacted at revision {result.get('compact_revision')}"
            )
            raise EtcdError(f"etcd at {self._client.url}: {what} canceled: {reason}")
        for raw in result.get("events", []):
            event = WatchEvent(
                "delete" if raw.get("type") == "DELETE" else "put",
                KeyValue.from_json(raw.get("kv", {})),
            )
            self.last_revision = event.kv.mod_revision
            if self._on_event is not None:
                self._on_event(event)
            else:
                self._events.put(event)


# -- the client ---------------------------------------------------------------------------------


class EtcdClient:
    """etcd v3 over its JSON gateway at ``url`` (``http://HOST:PORT``)."""

    def __init__(self, url: str, *, timeout: float = 5.0) -> None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname or parts.port is None:
            raise ValueError(f"etcd URL {url!r}: expected http://HOST:PORT")
        self.url = url.rstrip("/")
        self._host = parts.hostname
        self._port = parts.port
        self.timeout = timeout

    def __repr__(self) -> str:
        return f"EtcdClient({self.url!r})"

    # -- plumbing --------------------------------------------------------------------------------

    def connect(self, timeout: float | None) -> http.client.HTTPConnection:
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout)

    def send(
        self, conn: http.client.HTTPConnection, path: str, body: dict[str, Any], what: str
    ) -> http.client.HTTPResponse:
        """POST ``body`` to ``path``; the response once its status is 200 (else ``EtcdError``)."""
        payload = json.dumps(body).encode("ascii")
        conn.request("POST", path, payload, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            detail = response.read(4096).decode("utf-8", errors="replace").strip()
            with contextlib.suppress(ValueError):
                parsed = _as_dict(json.loads(detail))
                if parsed is not None and "message" in parsed:
                    detail = str(parsed["message"])
            raise EtcdError(
                f"etcd at {self.url}: {what} failed: HTTP {response.status} {detail}".rstrip()
            )
        return response

    def call(self, path: str, body: dict[str, Any], what: str) -> dict[str, Any]:
        """One request and its JSON reply."""
        conn = self.connect(self.timeout)
        try:
            response = self.send(conn, path, body, what)
            reply: Any = json.loads(response.read())
        except EtcdError:
            raise
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise EtcdError(f"etcd at {self.url}: {what} failed: {exc!r}") from exc
        finally:
            conn.close()
        data = _as_dict(reply)
        if data is None:
            raise EtcdError(f"etcd at {self.url}: {what} failed: unexpected reply {reply!r}")
        if "error" in data:
            raise EtcdError(f"etcd at {self.url}: {what} failed: {data['error']}")
        # A keep-alive streams {"result": ...}; unary calls answer the message itself.
        result = _as_dict(data.get("result", data))
        if result is None:
            raise EtcdError(f"etcd at {self.url}: {what} failed: unexpected reply {reply!r}")
        return result

    def healthy(self) -> bool:
        """etcd's ``/health`` says it is (False when it cannot be reached)."""
        conn = self.connect(self.timeout)
        try:
            conn.request("GET", "/health")
            response = conn.getresponse()
            body = _as_dict(json.loads(response.read()))
            return response.status == 200 and body is not None and body.get("health") == "true"
        except (OSError, http.client.HTTPException, ValueError):
            return False
        finally:
            conn.close()

    # -- keys ----------------------------------------------------------------------------------

    def range(self, key: str, *, prefix: bool = False) -> RangeResult:
        """The key (or every key under the prefix, in key order) and the current revision."""
        body: dict[str, Any] = {"key": _b64(key)}
        if prefix:
            body["range_end"] = _b64_raw(prefix_end(key))
        what = f"range of {key!r}" + (" (prefix)" if prefix else "")
        reply = self.call("/v3/kv/range", body, what)
        return RangeResult(
            [KeyValue.from_json(kv) for kv in reply.get("kvs", [])],
            int(reply.get("header", {}).get("revision", 0)),
        )

    def get(self, key: str) -> KeyValue | None:
        kvs = self.range(key).kvs
        return kvs[0] if kvs else None

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        return self.range(prefix, prefix=True).kvs

    def put(self, key: str, value: str, *, lease: int = 0) -> int:
        """Set ``key``; returns the new revision."""
        body: dict[str, Any] = {"key": _b64(key), "value": _b64(value)}
        if lease:
            body["lease"] = str(lease)
        reply = self.call("/v3/kv/put", body, f"put of {key!r}")
        return int(reply.get("header", {}).get("revision", 0))

    def delete(self, key: str, *, prefix: bool = False) -> int:
        """Delete the key (or every key under the prefix); returns how many were deleted."""
        body: dict[str, Any] = {"key": _b64(key)}
        if prefix:
            body["range_end"] = _b64_raw(prefix_end(key))
        reply = self.call("/v3/kv/deleterange", body, f"delete of {key!r}")
        return int(reply.get("deleted", 0))

    def txn(
        self, compare: Sequence[Compare], success: Sequence[Op], failure: Sequence[Op] = ()
    ) -> TxnResult:
        """If every comparison holds run ``success``, else ``failure``, atomically.

        At most ``MAX_TXN_OPS`` operations per branch (etcd's default limit).
        """
        body: dict[str, Any] = {
            "compare": [c.to_json() for c in compare],
            "success": [op.to_json() for op in success],
            "failure": [op.to_json() for op in failure],
        }
        keys = sorted({c.key for c in compare} | {op.key for op in (*success, *failure)})
        shown = ", ".join(repr(k) for k in keys[:3]) + (", ..." if len(keys) > 3 else "")
        reply = self.call("/v3/kv/txn", body, f"transaction on {shown}")
        ranges = [
            [KeyValue.from_json(kv) for kv in r["response_range"].get("kvs", [])]
            for r in reply.get("responses", [])
            if "response_range" in r
        ]
        return TxnResult(
            bool(reply.get("succeeded", False)),
            int(reply.get("header", {}).get("revision", 0)),
            ranges,
        )

    def create_if_absent(self, key: str, value: str, *, lease: int = 0) -> bool:
        """Put ``key`` only if it does not exist; whether it was created."""
        return self.txn([Compare(key, "CREATE", "EQUAL", 0)], [Put(key, value, lease)]).succeeded

    def compare_and_set(self, key: str, expected: str, value: str, *, lease: int = 0) -> bool:
        """Put ``key`` only if its value is ``expected`` (a missing key never is)."""
        return self.txn(
            [Compare(key, "VALUE", "EQUAL", expected)], [Put(key, value, lease)]
        ).succeeded

    # -- leases --------------------------------------------------------------------------------

    def lease_grant(self, ttl: int) -> Lease:
        """A new lease of ``ttl`` seconds (etcd may raise it to its minimum)."""
        reply = self.call("/v3/lease/grant", {"TTL": str(ttl)}, f"lease grant (TTL {ttl} s)")
        return Lease(int(reply["ID"]), int(reply.get("TTL", 0)))

    def lease_keepalive_once(self, lease_id: int) -> int:
        """Renew the lease once; its TTL again, or 0 if it no longer exists."""
        reply = self.call(
            "/v3/lease/keepalive", {"ID": str(lease_id)}, f"keep-alive of lease {lease_id:x}"
        )
        return int(reply.get("TTL", 0))

    def lease_time_to_live(self, lease_id: int) -> int:
        """Seconds left on the lease, -1 if it no longer exists."""
        reply = self.call(
            "/v3/lease/timetolive", {"ID": str(lease_id)}, f"time to live of lease {lease_id:x}"
        )
        return int(reply.get("TTL", 0))

    def lease_revoke(self, lease_id: int) -> None:
        """End the lease now; its keys are deleted. A lease already gone is not an error."""
        try:
            self.call("/v3/lease/revoke", {"ID": str(lease_id)}, f"revoke of lease {lease_id:x}")
        except EtcdError as exc:
            if "lease not found" not in str(exc):
                raise

    # -- watching --------------------------------------------------------------------------------

    def watch(
        self,
        key: str,
        *,
        prefix: bool = False,
        start_revision: int = 0,
        on_event: Callable[[WatchEvent], None] | None = None,
        timeout: float | None = None,
    ) -> Watch:
        """Watch a key or prefix (from ``start_revision`` if given, else from now)."""
        watch = Watch(self, key, prefix=prefix, start_revision=start_revision, on_event=on_event)
        return watch.start(self.timeout if timeout is None else timeout)
