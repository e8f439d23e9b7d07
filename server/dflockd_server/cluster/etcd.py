"""A small etcd v3 client over etcd's JSON gateway (HTTP/1.1, standard library only).

etcd serves its gRPC API as JSON at ``POST /v3/<service>/<method>`` on the client URL, with keys
and values in base64 and 64-bit integers as strings; fields at their zero value are left out of
replies (a failed transaction has no ``succeeded``, a put event no ``type``). This module covers
what the lock cluster needs: ranges (one key or a prefix), put (optionally under a lease),
delete, transactions (with create-if-absent and value-equals helpers), leases (grant, one
keep-alive, revoke, time to live) and watching a key or prefix from a thread.

Every call opens its own connection, so one ``EtcdClient`` may be used from several threads.
Failures raise ``EtcdError`` naming the etcd URL and the operation.

Several endpoints (``http://h1:2379,h2:2379,h3:2379``; ``https://`` for TLS). A call goes to
the endpoint that answered last; when it cannot be reached, does not answer within
``attempt_timeout``, or says it cannot serve now (HTTP 5xx or 429: no leader, a leader change,
a request timed out), the call tries the next one, until ``timeout`` has passed since the call
began (each round over the endpoints waiting twice as long as the one before). So one dead or
paused etcd node costs a call at most ``attempt_timeout``, not ``timeout``.

When is a request sent again? A request that failed before it was sent (no connection, no TLS
handshake) goes to the next endpoint whatever it is. One that was sent and got no answer may
still be applied by etcd, even later than its retry. It is sent again only when that is safe:
reads; lease grant (a second lease holds no key and runs out), keep-alive and revoke (the same
effect twice); and transactions, because every transaction this project writes is conditioned
(``Compare``) so that a second application of the same writes fails its comparison. Such a
retried transaction may therefore report ``succeeded=False`` for a write that the first attempt
made: its callers read again where the difference matters (``membership``'s registration,
``fencestore``). A plain ``put`` or ``delete`` is not sent again after an answerless attempt
(``EtcdError`` says its outcome is unknown).

Authentication (``user`` and ``password``): the client gets a token from
``/v3/auth/authenticate`` on each endpoint it uses (etcd's default "simple" tokens are known
only to the node that issued them) and sends it in the ``Authorization`` header; when etcd says
the token is invalid or outdated it authenticates again and sends the request again (etcd
refused it: nothing was applied). A wrong user or password raises ``EtcdAuthError``.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import logging
import queue
import socket
import ssl
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast
from urllib.parse import urlsplit

log = logging.getLogger("dflockd_server")

MAX_TXN_OPS = 128
"""etcd's default limit of operations in one transaction (``--max-txn-ops``)."""


class EtcdError(Exception):
    """An etcd request failed (the message names the etcd URL and the operation)."""


class EtcdAuthError(EtcdError):
    """etcd refused this client's user or password, or needs one (retrying will not help)."""


class _StatusError(EtcdError):
    """etcd answered with an error (its HTTP status and message)."""

    def __init__(self, text: str, status: int, detail: str) -> None:
        super().__init__(text)
        self.status = status
        self.detail = detail


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
        endpoint: int = 0,
        prefix: bool,
        start_revision: int,
        on_event: Callable[[WatchEvent], None] | None,
    ) -> None:
        self._client = client
        self._key = key
        self.endpoint = endpoint
        """The index of the etcd endpoint this watch reads (``EtcdClient.endpoints``)."""
        self._connect_timeout = client.attempt_timeout
        self._where = client.where(endpoint)
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
                f"etcd at {self._where}: watch of {self._key!r} not confirmed in {timeout} s"
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
            token = self._client.token(self.endpoint, self._connect_timeout)
            conn = self._client.connect(self.endpoint, self._connect_timeout)
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
                    message = _as_dict(json.loads(line))
                    if message is None:
                        raise EtcdError(f"etcd at {self._where}: {what}: bad line {line!r}")
                    self._handle(message, what)
        except (
            OSError,
            http.client.HTTPException,
            ValueError,
            EtcdError,
            _NotSent,
            _NoAnswer,
        ) as exc:
            if not self._stopping.is_set():
                self.error = (
                    exc
                    if isinstance(exc, EtcdError)
                    else EtcdError(f"etcd at {self._where}: {what} failed: {exc}")
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
            detail, _ = _error_detail(message["error"])
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


@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_etcd_url(url: str) -> tuple[bool, tuple[Endpoint, ...]]:
    """``http://HOST:PORT[,HOST:PORT...]`` (``https://`` for TLS) -> (tls, endpoints)."""
    scheme, sep, rest = url.strip().rstrip("/").partition("://")
    if not sep or scheme not in ("http", "https") or not rest:
        raise ValueError(f"etcd URL {url!r}: expected http://HOST:PORT[,HOST:PORT...]")
    endpoints: list[Endpoint] = []
    for part in rest.split(","):
        parts = urlsplit(f"//{part.strip()}")
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or port is None or parts.path:
            raise ValueError(f"etcd URL {url!r}: {part!r} is not HOST:PORT")
        endpoints.append(Endpoint(parts.hostname, port))
    return scheme == "https", tuple(endpoints)


def tls_context(
    ca_file: str | None = None, cert_file: str | None = None, key_file: str | None = None
) -> ssl.SSLContext:
    """A client TLS context for etcd: the system's CAs, or ``ca_file``'s; with a client
    certificate when ``cert_file`` (and ``key_file``) are given. Raises ``ValueError`` naming
    the file that cannot be used."""
    try:
        context = ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"CA file {ca_file!r} cannot be used: {exc}") from exc
    if cert_file is not None:
        try:
            context.load_cert_chain(cert_file, key_file)
        except (OSError, ssl.SSLError) as exc:
            raise ValueError(
                f"client certificate {cert_file!r} / key {key_file!r} cannot be used: {exc}"
            ) from exc
    return context


class _NotSent(Exception):
    """An attempt failed before its request left (another endpoint may take it)."""


class _NoAnswer(Exception):
    """An attempt's request was sent, and no answer came (etcd may apply it, even later)."""


_TOKEN_ERRORS = ("invalid auth token", "auth store is old", "revision of auth store")
_AUTH_ERRORS = (
    "authentication failed",
    "user name is empty",
    "permission denied",
    "user name not found",
)
_RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


def _error_detail(error: Any) -> tuple[str, int]:
    """etcd's error as text and its HTTP code (a stream's error is an object with both)."""
    data = _as_dict(error)
    if data is None:
        return str(error), 0
    return str(data.get("message") or data.get("error") or data), int(data.get("http_code", 0))


class EtcdClient:
    """etcd v3 over its JSON gateway at ``url``: ``http://HOST:PORT[,HOST:PORT...]`` (or
    ``https://``), with fail-over between the endpoints (see the module's docstring)."""

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 5.0,
        attempt_timeout: float | None = None,
        ssl_context: ssl.SSLContext | None = None,
        user: str | None = None,
        password: str | None = None,
    ) -> None:
        tls, endpoints = parse_etcd_url(url)
        if (user is None) != (password is None):
            raise ValueError("etcd authentication needs both a user and a password")
        self.endpoints = endpoints
        self.url = f"{'https' if tls else 'http'}://{','.join(map(str, endpoints))}"
        self.timeout = timeout
        """The longest one call may take, every attempt included."""
        self.attempt_timeout = (
            attempt_timeout
            if attempt_timeout is not None
            else (timeout if len(endpoints) == 1 else max(timeout / 5, 0.5))
        )
        """The longest one endpoint is waited for before the next is tried."""
        self._ssl = (ssl_context or ssl.create_default_context()) if tls else None
        self._credentials = None if user is None or password is None else (user, password)
        self._lock = threading.Lock()
        self._preferred = 0
        self._tokens: dict[int, str | None] = {}
        """Endpoint index -> its token (None: etcd said authentication is off)."""
        self.switches = 0
        """Calls answered by another endpoint than the one that answered before (each is
        logged: which endpoint failed, and why)."""

    def __repr__(self) -> str:
        return f"EtcdClient({self.url!r})"

    def where(self, index: int) -> str:
        """Endpoint ``index`` as a URL (``http://HOST:PORT``)."""
        return f"{'https' if self._ssl is not None else 'http'}://{self.endpoints[index]}"

    @property
    def preferred(self) -> int:
        """The index of the endpoint that answered last (calls go there first)."""
        return self._preferred

    # -- plumbing --------------------------------------------------------------------------------

    def connect(self, index: int, timeout: float | None) -> http.client.HTTPConnection:
        """A connection to endpoint ``index``, connected (raises ``OSError``, ``ssl.SSLError``)."""
        endpoint = self.endpoints[index]
        conn: http.client.HTTPConnection
        if self._ssl is not None:
            conn = http.client.HTTPSConnection(
                endpoint.host, endpoint.port, timeout=timeout, context=self._ssl
            )
        else:
            conn = http.client.HTTPConnection(endpoint.host, endpoint.port, timeout=timeout)
        try:
            conn.connect()
        except BaseException:
            conn.close()
            raise
        return conn

    def send(
        self,
        conn: http.client.HTTPConnection,
        path: str,
        body: dict[str, Any],
        what: str,
        token: str | None = None,
    ) -> http.client.HTTPResponse:
        """POST ``body`` to ``path``; the response once its status is 200 (else ``EtcdError``)."""
        payload = json.dumps(body).encode("ascii")
        headers = {"Content-Type": "application/json"}
        if token is not None:
            headers["Authorization"] = token
        conn.request("POST", path, payload, headers)
        response = conn.getresponse()
        if response.status != 200:
            detail = response.read(4096).decode("utf-8", errors="replace").strip()
            with contextlib.suppress(ValueError):
                parsed = _as_dict(json.loads(detail))
                if parsed is not None and "message" in parsed:
                    detail = str(parsed["message"])
            raise self._http_error(what, response.status, detail)
        return response

    def _http_error(self, what: str, status: int, detail: str) -> EtcdError:
        text = f"etcd at {self.url}: {what} failed: HTTP {status} {detail}".rstrip()
        if any(word in detail for word in _AUTH_ERRORS):
            return EtcdAuthError(text)
        return _StatusError(text, status, detail)

    def token(self, index: int, timeout: float) -> str | None:
        """The auth token for endpoint ``index`` (authenticating there when it has none)."""
        if self._credentials is None:
            return None
        with self._lock:
            if index in self._tokens:
                return self._tokens[index]
        user, password = self._credentials
        what = f"authentication as {user!r}"
        try:
            conn = self.connect(index, timeout)
        except (OSError, http.client.HTTPException) as exc:
            raise _NotSent(f"{self.endpoints[index]}: {exc!r}") from exc
        try:
            response = self.send(
                conn, "/v3/auth/authenticate", {"name": user, "password": password}, what
            )
            reply = _as_dict(json.loads(response.read()))
        except _StatusError as exc:
            if "authentication is not enabled" in exc.detail:
                token = None
            elif exc.status in _RETRY_STATUSES:
                raise _NoAnswer(f"{self.endpoints[index]}: {exc.detail}") from exc
            else:
                raise EtcdAuthError(str(exc)) from exc
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise _NoAnswer(f"{self.endpoints[index]}: {what}: {exc!r}") from exc
        else:
            if reply is None or not reply.get("token"):
                raise EtcdAuthError(f"etcd at {self.url}: {what} failed: no token in {reply!r}")
            token = str(reply["token"])
        finally:
            conn.close()
        with self._lock:
            self._tokens[index] = token
        return token

    def forget_token(self, index: int) -> None:
        with self._lock:
            self._tokens.pop(index, None)

    def _attempt(
        self, index: int, path: str, body: dict[str, Any], what: str, timeout: float
    ) -> Any:
        """One attempt on one endpoint: its decoded JSON reply."""
        for fresh_token in (False, True):
            token = self.token(index, timeout)
            try:
                conn = self.connect(index, timeout)
            except (OSError, http.client.HTTPException) as exc:
                raise _NotSent(f"{self.endpoints[index]}: {exc!r}") from exc
            try:
                response = self.send(conn, path, body, what, token)
                reply: Any = json.loads(response.read())
            except _StatusError as exc:
                if any(word in exc.detail for word in _TOKEN_ERRORS) and not fresh_token:
                    self.forget_token(index)  # refused, not applied: again with a new token
                    continue
                if exc.status in _RETRY_STATUSES:
                    raise _NoAnswer(
                        f"{self.endpoints[index]}: HTTP {exc.status} {exc.detail}"
                    ) from exc
                raise
            except (OSError, http.client.HTTPException, ValueError) as exc:
                raise _NoAnswer(f"{self.endpoints[index]}: {exc!r}") from exc
            finally:
                conn.close()
            data = _as_dict(reply)
            if data is not None and "error" in data:
                detail, code = _error_detail(data["error"])
                if any(word in detail for word in _TOKEN_ERRORS) and not fresh_token:
                    self.forget_token(index)
                    continue
                error = self._http_error(what, code, detail)
                if not isinstance(error, EtcdAuthError) and code in _RETRY_STATUSES:
                    raise _NoAnswer(f"{self.endpoints[index]}: {detail}")
                raise error
            return reply
        raise EtcdAuthError(f"etcd at {self.url}: {what} failed: the token was refused twice")

    def _switched(self, index: int, failures: Mapping[int, str]) -> None:
        with self._lock:
            old, self._preferred = self._preferred, index
            if old == index:
                return
            self.switches += 1
        log.warning(
            "etcd endpoint %s failed (%s); using %s from now on",
            self.endpoints[old],
            failures.get(old, "no answer"),
            self.endpoints[index],
        )

    def call(
        self, path: str, body: dict[str, Any], what: str, *, resend: bool = True
    ) -> dict[str, Any]:
        """One request and its JSON reply, failing over between the endpoints (``resend``:
        the request may be sent again after an attempt that got no answer)."""
        began = time.monotonic()
        deadline = began + self.timeout
        first = self._preferred
        count = len(self.endpoints)
        failures: dict[int, str] = {}
        attempt = 0
        while True:
            index = (first + attempt) % count
            remaining = deadline - time.monotonic()
            if attempt > 0 and remaining <= 0:
                break
            attempt += 1
            try:
                # Each round over the endpoints waits twice as long: when all are slow (a
                # loaded etcd), a later round still gets an answer.
                patience = self.attempt_timeout * 2 ** ((attempt - 1) // count)
                reply = self._attempt(index, path, body, what, max(min(patience, remaining), 0.05))
            except _NotSent as exc:
                failures[index] = str(exc)
            except _NoAnswer as exc:
                failures[index] = str(exc)
                if not resend:
                    raise EtcdError(
                        f"etcd at {self.url}: {what}: no answer ({exc}); whether it was applied "
                        "is unknown"
                    ) from exc
            else:
                if index != self._preferred:
                    self._switched(index, failures)
                data = _as_dict(reply)
                # A keep-alive streams {"result": ...}; unary calls answer the message itself.
                result = None if data is None else _as_dict(data.get("result", data))
                if result is None:
                    raise EtcdError(
                        f"etcd at {self.url}: {what} failed: unexpected reply {reply!r}"
                    )
                return result
            if attempt % count == 0:
                # Every endpoint failed once: a short pause before the next round.
                pause = min(0.05 * (attempt // count), 0.5, deadline - time.monotonic())
                if pause > 0:
                    time.sleep(pause)
        tried = "; ".join(failures[i] for i in sorted(failures))
        raise EtcdError(
            f"etcd at {self.url}: {what} failed (no endpoint answered in {self.timeout:g} s): "
            f"{tried}"
        )

    def healthy(self, index: int = 0) -> bool:
        """etcd's ``/health`` on endpoint ``index`` says it is (False when it cannot be
        reached)."""
        try:
            conn = self.connect(index, self.attempt_timeout)
        except (OSError, http.client.HTTPException):
            return False
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
        reply = self.call("/v3/kv/put", body, f"put of {key!r}", resend=False)
        return int(reply.get("header", {}).get("revision", 0))

    def delete(self, key: str, *, prefix: bool = False) -> int:
        """Delete the key (or every key under the prefix); returns how many were deleted."""
        body: dict[str, Any] = {"key": _b64(key)}
        if prefix:
            body["range_end"] = _b64_raw(prefix_end(key))
        reply = self.call("/v3/kv/deleterange", body, f"delete of {key!r}", resend=False)
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
        """Watch a key or prefix (from ``start_revision`` if given, else from now), on the
        first endpoint (from the preferred one on) that confirms it within ``attempt_timeout``
        (all in ``timeout``)."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        first = self._preferred
        failures: dict[int, str] = {}
        attempt = 0
        while True:
            index = (first + attempt) % len(self.endpoints)
            remaining = deadline - time.monotonic()
            if attempt > 0 and remaining <= 0:
                break
            attempt += 1
            watch = Watch(
                self,
                key,
                endpoint=index,
                prefix=prefix,
                start_revision=start_revision,
                on_event=on_event,
            )
            try:
                watch.start(max(min(self.attempt_timeout, remaining), 0.05))
            except EtcdAuthError:
                raise
            except EtcdError as exc:
                failures[index] = str(exc)
            else:
                if index != self._preferred:
                    # Calls follow the watch: a member re-watches when they part.
                    self._switched(index, failures)
                return watch
            if attempt % len(self.endpoints) == 0:
                pause = min(
                    0.05 * (attempt // len(self.endpoints)), 0.5, deadline - time.monotonic()
                )
                if pause > 0:
                    time.sleep(pause)
        raise EtcdError(
            f"etcd at {self.url}: watch of {key!r} failed: {'; '.join(failures.values())}"
        )
