"""How the etcd client reaches etcd (``EtcdTransport``): endpoints, fail-over, TLS and
authentication, over HTTP/1.1 with the standard library only. Every call opens its own
connection, so one client may be used from several threads.

Fail-over (docs/deployment.md, *etcd's own failures*): a call goes to the endpoint that answered
last; one that cannot be reached, does not answer within ``attempt_timeout`` or cannot serve now
(HTTP 5xx or 429) leaves the call to the next, until ``timeout``; each round over the endpoints
waits twice as long and starts one endpoint further on (a paused etcd leader is not the first
waited for again).

A request sent without an answer may still be applied, even later, and is sent again too, so
every request the client makes is safe to apply twice: reads, lease grant, keep-alive and
revoke, and transactions (all conditioned here, so a second application fails its comparison:
such a retry may report ``succeeded=False`` for a write the first attempt made, and its callers
read again where that matters); never a plain put or delete.

Authentication: a token from ``/v3/auth/authenticate`` per endpoint (etcd's "simple" tokens are
known only to their issuer), sent again with a new token when etcd says it is invalid or
outdated. A wrong user or password raises ``EtcdAuthError``.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import ssl
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from dflockd_server.cluster.etcd.errors import (
    EtcdAuthError,
    EtcdError,
    NoAnswer,
    NotSent,
    StatusError,
)
from dflockd_server.cluster.etcd.messages import as_dict, error_detail
from dflockd_server.tls import no_passphrase

log = logging.getLogger("dflockd_server")


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
    """A client TLS context for etcd (``ValueError`` naming the file that cannot be used)."""
    try:
        context = ssl.create_default_context(cafile=ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"CA file {ca_file!r} cannot be used: {exc}") from exc
    if cert_file is not None:
        try:
            context.load_cert_chain(cert_file, key_file, password=no_passphrase)
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            raise ValueError(
                f"client certificate {cert_file!r} / key {key_file!r} cannot be used: {exc}"
            ) from exc
    return context


_TOKEN_ERRORS = ("invalid auth token", "auth store is old", "revision of auth store")
_AUTH_ERRORS = (
    "authentication failed",
    "user name is empty",
    "permission denied",
    "user name not found",
)
_RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})


class EtcdTransport:
    """etcd v3's JSON gateway at ``url``: ``http://HOST:PORT[,HOST:PORT...]`` (or
    ``https://``), failing over between the endpoints. ``user`` and ``password`` come together,
    checked where they are given (``Config``, the cluster commands)."""

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
        self.endpoints = endpoints
        self.url = f"{'https' if tls else 'http'}://{','.join(map(str, endpoints))}"
        self.timeout = timeout  # the longest one call may take, every attempt included
        if attempt_timeout is None:
            attempt_timeout = timeout if len(endpoints) == 1 else max(timeout / 5, 0.5)
        self.attempt_timeout = attempt_timeout  # the longest wait for one endpoint before the next
        self._ssl = (ssl_context or ssl.create_default_context()) if tls else None
        self._credentials = None if user is None or password is None else (user, password)
        self._lock = threading.Lock()
        self.preferred = 0  # the index of the endpoint that answered last (calls go there first)
        self._tokens: dict[int, str | None] = {}  # endpoint index -> its token (None: auth is off)
        self.switches = 0  # calls answered by another endpoint than the one that answered before

    def where(self, index: int) -> str:
        return f"{'https' if self._ssl is not None else 'http'}://{self.endpoints[index]}"

    def attempts(self, timeout: float) -> Iterator[tuple[int, int, float]]:
        """(endpoint, round, seconds left) of each attempt of a call lasting ``timeout``: round
        after round over the endpoints from the preferred one, each round starting one further
        on, with a short pause between rounds."""
        count = len(self.endpoints)
        deadline = time.monotonic() + timeout
        first = self.preferred
        attempt = 0
        while True:
            remaining = deadline - time.monotonic()
            if attempt > 0 and remaining <= 0:
                return
            yield (first + attempt // count + attempt % count) % count, attempt // count, remaining
            attempt += 1
            if attempt % count == 0:
                pause = min(0.05 * (attempt // count), 0.5, deadline - time.monotonic())
                if pause > 0:
                    time.sleep(pause)

    def connect(self, index: int, timeout: float | None) -> http.client.HTTPConnection:
        host, port = self.endpoints[index].host, self.endpoints[index].port
        conn = (
            http.client.HTTPSConnection(host, port, timeout=timeout, context=self._ssl)
            if self._ssl is not None
            else http.client.HTTPConnection(host, port, timeout=timeout)
        )
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
                if (parsed := as_dict(json.loads(detail))) is not None and "message" in parsed:
                    detail = str(parsed["message"])
            raise self._http_error(what, response.status, detail)
        return response

    def _http_error(self, what: str, status: int, detail: str) -> EtcdError:
        text = f"etcd at {self.url}: {what} failed: HTTP {status} {detail}".rstrip()
        if any(word in detail for word in _AUTH_ERRORS):
            return EtcdAuthError(text)
        return StatusError(text, status, detail)

    def token(self, index: int, timeout: float) -> str | None:
        if self._credentials is None:
            return None
        with self._lock:
            if index in self._tokens:
                return self._tokens[index]
        user, password = self._credentials
        what = f"authentication as {user!r}"
        body = {"name": user, "password": password}
        try:
            reply = as_dict(
                self._exchange(index, "/v3/auth/authenticate", body, what, timeout, token=None)
            )
        except StatusError as exc:
            if "authentication is not enabled" not in exc.detail:
                if exc.status in _RETRY_STATUSES:
                    raise NoAnswer(f"{self.endpoints[index]}: {exc.detail}") from exc
                raise EtcdAuthError(str(exc)) from exc
            token = None
        else:
            if reply is None or not reply.get("token"):
                raise EtcdAuthError(f"etcd at {self.url}: {what} failed: no token in {reply!r}")
            token = str(reply["token"])
        with self._lock:
            self._tokens[index] = token
        return token

    def _exchange(
        self, index: int, path: str, body: Any, what: str, timeout: float, *, token: str | None
    ) -> Any:
        """One request to endpoint ``index`` on a connection of its own: its JSON reply."""
        try:
            conn = self.connect(index, timeout)
        except (OSError, http.client.HTTPException) as exc:
            raise NotSent(f"{self.endpoints[index]}: {exc!r}") from exc
        try:
            return json.loads(self.send(conn, path, body, what, token).read())
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise NoAnswer(f"{self.endpoints[index]}: {what}: {exc!r}") from exc
        finally:
            conn.close()

    def _attempt(
        self, index: int, path: str, body: dict[str, Any], what: str, timeout: float
    ) -> Any:
        for fresh_token in (False, True):
            token = self.token(index, timeout)
            try:
                reply = self._exchange(index, path, body, what, timeout, token=token)
            except StatusError as exc:
                detail, code = exc.detail, exc.status
            else:
                data = as_dict(reply)
                if data is None or "error" not in data:
                    return reply
                detail, code = error_detail(data["error"])
            if any(word in detail for word in _TOKEN_ERRORS) and not fresh_token:
                with self._lock:  # refused, not applied: again with a new token
                    self._tokens.pop(index, None)
                continue
            error = self._http_error(what, code, detail)
            if not isinstance(error, EtcdAuthError) and code in _RETRY_STATUSES:
                raise NoAnswer(f"{self.endpoints[index]}: HTTP {code} {detail}")
            raise error

    def switched(self, index: int, failures: Mapping[int, str]) -> None:
        """Endpoint ``index`` answered after ``failures``: calls go there first from now on."""
        with self._lock:
            old, self.preferred = self.preferred, index
            if old == index:
                return
            self.switches += 1
        log.warning(
            "etcd endpoint %s failed (%s); using %s from now on",
            self.endpoints[old],
            failures.get(old, "no answer"),
            self.endpoints[index],
        )

    def call(self, path: str, body: dict[str, Any], what: str) -> dict[str, Any]:
        """One request and its JSON reply (sent again after an attempt that got no answer)."""
        failures: dict[int, str] = {}
        for index, round_, remaining in self.attempts(self.timeout):
            try:
                # Each round waits twice as long: a loaded etcd still answers a later one.
                patience = self.attempt_timeout * 2**round_
                reply = self._attempt(index, path, body, what, max(min(patience, remaining), 0.05))
            except (NotSent, NoAnswer) as exc:
                failures[index] = str(exc)
            else:
                self.switched(index, failures)
                data = as_dict(reply)
                # A keep-alive streams {"result": ...}; unary calls answer the message itself.
                result = None if data is None else as_dict(data.get("result", data))
                if result is None:
                    raise EtcdError(
                        f"etcd at {self.url}: {what} failed: unexpected reply {reply!r}"
                    )
                return result
        tried = "; ".join(failures[i] for i in sorted(failures))
        raise EtcdError(
            f"etcd at {self.url}: {what} failed (no endpoint answered in {self.timeout:g} s): "
            f"{tried}"
        )
