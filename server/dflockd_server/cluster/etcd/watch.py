"""Watching a key or prefix of etcd from a thread (``Watch``), over one endpoint of an
``EtcdTransport``; ``EtcdClient.watch`` picks the endpoint."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
from collections.abc import Callable
from typing import Any

from dflockd_server.cluster.etcd.errors import EtcdError, NoAnswer, NotSent
from dflockd_server.cluster.etcd.messages import (
    KeyValue,
    WatchEvent,
    as_dict,
    error_detail,
    key_range,
)
from dflockd_server.cluster.etcd.transport import EtcdTransport

_FAILURES = (OSError, http.client.HTTPException, ValueError, EtcdError, NotSent, NoAnswer)
"""What ends a watch with an error (``Watch.error``) unless it is being stopped."""


class Watch:
    """A running watch of a key or prefix: a thread reading etcd's event stream, calling
    ``on_event`` with each event. If the stream fails, ``error`` says why."""

    def __init__(
        self,
        client: EtcdTransport,
        key: str,
        *,
        endpoint: int = 0,
        prefix: bool,
        start_revision: int,
        on_event: Callable[[WatchEvent], None],
    ) -> None:
        self._client = client
        self._key = key
        self.endpoint = endpoint  # the index of the etcd endpoint it reads (transport.endpoints)
        self._where = client.where(endpoint)
        self._prefix = prefix
        self._start_revision = start_revision
        self._on_event = on_event
        self._stopping = threading.Event()
        self._created = threading.Event()
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()
        self.error: EtcdError | None = None
        self._thread = threading.Thread(target=self._run, name=f"etcd-watch {key!r}", daemon=True)

    def start(self, timeout: float) -> None:
        """Start, and return once etcd confirmed the watch (later changes are all seen)."""
        self._thread.start()
        if not self._created.wait(timeout):
            self.stop()
            raise EtcdError(
                f"etcd at {self._where}: watch of {self._key!r} not confirmed in {timeout} s"
            )
        if self.error is not None:
            self._thread.join(timeout)
            raise self.error

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

    def _run(self) -> None:
        create = key_range(self._key, self._prefix)
        if self._start_revision:
            create["start_revision"] = str(self._start_revision)
        what = f"watch of {self._key!r}"
        try:
            token = self._client.token(self.endpoint, self._client.attempt_timeout)
            conn = self._client.connect(self.endpoint, self._client.attempt_timeout)
            if conn.sock is not None:
                conn.sock.settimeout(None)  # a stream: events come when they come
            with self._lock:
                self._conn = conn
            if self._stopping.is_set():
                return
            response = self._client.send(conn, "/v3/watch", {"create_request": create}, what, token)
            while not self._stopping.is_set():
                line = response.readline()
                if not line:
                    if not self._stopping.is_set():
                        raise EtcdError(f"etcd at {self._where}: {what} ended by etcd")
                    return
                if line.strip():
                    message = as_dict(json.loads(line))
                    if message is None:
                        raise EtcdError(f"etcd at {self._where}: {what}: bad line {line!r}")
                    self._handle(message, what)
        except _FAILURES as exc:
            if not self._stopping.is_set():
                self.error = (
                    exc
                    if isinstance(exc, EtcdError)
                    else EtcdError(f"etcd at {self._where}: {what} failed: {exc}")
                )
        finally:
            with self._lock:
                conn, self._conn = self._conn, None
            if conn is not None:
                conn.close()
            self._created.set()

    def _handle(self, message: dict[str, Any], what: str) -> None:
        if "error" in message:
            detail, _ = error_detail(message["error"])
            raise EtcdError(f"etcd at {self._where}: {what} failed: {detail}")
        result: dict[str, Any] = message.get("result", {})
        if result.get("created"):
            self._created.set()
        if result.get("canceled"):
            reason = result.get("cancel_reason") or (
                f"compacted at revision {result.get('compact_revision')}"
            )
            raise EtcdError(f"etcd at {self._where}: {what} canceled: {reason}")
        for raw in result.get("events", []):
            kind = "delete" if raw.get("type") == "DELETE" else "put"
            self._on_event(WatchEvent(kind, KeyValue.from_json(raw.get("kv", {}))))
