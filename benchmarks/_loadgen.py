"""The load generator: processes that drive a lock server with acquire+release pairs.

Each generator process opens its connections, reports ready, and on ``go`` runs until its
deadline: every connection sends a batch of ``pipeline`` acquires on distinct keys (one write),
reads the replies, sends the matching releases (one write), reads those, and starts over. The
operations are the same on both servers:

* dflockd: ``l <key> 0`` (try once, the server's default lease), then ``r <key> <token>``.
* Redis, as redis-py's ``Lock`` does it: ``SET <key> <token> NX PX 33000``, then a
  compare-and-delete script (``EVALSHA``) that deletes the key only if it holds the token.

Batches of one (``pipeline=1``) are plain request/response round trips: what a lock user
does, and what the latency figures are taken from. Larger batches make the generator cheap
per pair, so that the server, not the generator, is what runs out of CPU.
"""

from __future__ import annotations

import multiprocessing
import os
import selectors
import socket
import time
import traceback
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection as Pipe
from multiprocessing.process import BaseProcess
from typing import Any

from benchmarks._codec import RELEASE, TRY_LOCK

PROTOCOLS = ("dflockd", "redis")
LEASE_S = 33
READY_TIMEOUT_S = 60.0
RESULT_GRACE_S = 60.0
RECV_BYTES = 1 << 16

REDIS_RELEASE_SCRIPT = """\
if redis.call('get', KEYS[1]) == ARGV[1] then
    return redis.call('del', KEYS[1])
end
return 0
"""
"""Release only if the key still holds our token (redis-py's ``Lock`` releases this way)."""

_DFLOCKD_OK = b"ok "
_DFLOCKD_RELEASED = b"ok"
_REDIS_OK = b"+OK\r"
_REDIS_RELEASED = b":1\r"
_TOKEN_START = 3
_TOKEN_END = 35


@dataclass(frozen=True)
class LoadSpec:
    """What one generator process does."""

    protocol: str
    host: str
    port: int
    conns: int
    pipeline: int
    duration_s: float
    key_prefix: str
    script_sha: str = ""
    record_latency: bool = False


@dataclass
class LoadResult:
    """What one generator process did (times are ``time.monotonic_ns``)."""

    pairs: int = 0
    errors: int = 0
    cpu_s: float = 0.0
    started_ns: int = 0
    finished_ns: int = 0
    latencies_ns: bytes = b""


@dataclass
class Measurement:
    """One load run against one server, all generator processes together."""

    pairs: int
    errors: int
    wall_s: float
    server_cpu_ns: int
    generator_cpu_s: float
    latencies_ns: list[int] = field(default_factory=list[int])

    @property
    def pairs_per_s(self) -> float:
        return self.pairs / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def server_cpu_us_per_pair(self) -> float:
        return self.server_cpu_ns / 1000 / self.pairs if self.pairs else float("nan")

    @property
    def generator_cpu_us_per_pair(self) -> float:
        return self.generator_cpu_s * 1e6 / self.pairs if self.pairs else float("nan")

    @property
    def server_busy(self) -> float:
        """Fraction of one core the server used while the load ran."""
        return self.server_cpu_ns / 1e9 / self.wall_s if self.wall_s > 0 else float("nan")


# ------------------------------------------------------------------------------ wire codecs
def _resp(*parts: bytes) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for part in parts:
        out.append(b"$%d\r\n%s\r\n" % (len(part), part))
    return b"".join(out)


class _Conn:
    """One connection's requests and its position in the acquire/release cycle."""

    __slots__ = ("acquire", "buf", "expect", "keys", "releasing", "sock", "t0", "tokens")

    def __init__(self, sock: socket.socket, spec: LoadSpec, keys: list[bytes]) -> None:
        self.sock = sock
        self.keys = keys
        self.buf = b""
        self.expect = 0
        self.releasing = False
        self.t0 = 0
        if spec.protocol == "dflockd":
            self.acquire = b"".join(TRY_LOCK % key for key in keys)
            self.tokens: list[bytes] = []
        else:
            px = b"%d" % (LEASE_S * 1000)
            self.tokens = [os.urandom(16).hex().encode() for _ in keys]
            self.acquire = b"".join(
                _resp(b"SET", key, token, b"NX", b"PX", px)
                for key, token in zip(keys, self.tokens, strict=True)
            )


def _dflockd_releases(conn: _Conn, lines: list[bytes]) -> tuple[bytes, int]:
    out: list[bytes] = []
    for key, line in zip(conn.keys, lines, strict=True):
        if line[:3] == _DFLOCKD_OK:
            out.append(RELEASE % (key, line[_TOKEN_START:_TOKEN_END]))
    return b"".join(out), len(out)


def _redis_releases(conn: _Conn, lines: list[bytes], sha: bytes) -> tuple[bytes, int]:
    out: list[bytes] = []
    for key, token, line in zip(conn.keys, conn.tokens, lines, strict=True):
        if line == _REDIS_OK:
            out.append(_resp(b"EVALSHA", sha, b"1", key, token))
    return b"".join(out), len(out)


# ------------------------------------------------------------------------------ the generator
def _connect(spec: LoadSpec) -> list[_Conn]:
    conns: list[_Conn] = []
    for index in range(spec.conns):
        sock = socket.create_connection((spec.host, spec.port), timeout=30)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
        keys = [f"{spec.key_prefix}:{index}:{i}".encode() for i in range(spec.pipeline)]
        conns.append(_Conn(sock, spec, keys))
    return conns


def _drive(spec: LoadSpec, conns: list[_Conn], result: LoadResult) -> None:
    """Run the acquire/release cycle on every connection until the deadline."""
    dflockd = spec.protocol == "dflockd"
    sha = spec.script_sha.encode()
    released_reply = _DFLOCKD_RELEASED if dflockd else _REDIS_RELEASED
    latencies = array("q")
    record = spec.record_latency
    clock = time.monotonic_ns
    start = clock()
    deadline = start + int(spec.duration_s * 1e9)
    result.started_ns = start
    sel = selectors.DefaultSelector()
    for conn in conns:
        sel.register(conn.sock, selectors.EVENT_READ, conn)
        conn.t0 = clock()
        conn.expect = spec.pipeline
        conn.sock.sendall(conn.acquire)
    pairs = errors = 0
    active = len(conns)
    while active:
        for key, _mask in sel.select():
            conn: _Conn = key.data
            data = conn.sock.recv(RECV_BYTES)
            if not data:
                raise ConnectionError("the server closed a connection")
            buf = conn.buf + data if conn.buf else data
            if buf.count(b"\n") < conn.expect:
                conn.buf = buf
                continue
            conn.buf = b""
            lines = buf.split(b"\n")
            if lines.pop():
                raise RuntimeError(f"unexpected trailing bytes from the server: {buf[-80:]!r}")
            if not conn.releasing:
                if dflockd:
                    batch, granted = _dflockd_releases(conn, lines)
                else:
                    batch, granted = _redis_releases(conn, lines, sha)
                errors += len(lines) - granted
                if granted:
                    conn.releasing = True
                    conn.expect = granted
                    conn.sock.sendall(batch)
                    continue
                done = 0
            else:
                done = sum(1 for line in lines if line == released_reply)
                errors += len(lines) - done
            pairs += done
            now = clock()
            if record:
                latencies.append(now - conn.t0)
            conn.releasing = False
            if now >= deadline:
                sel.unregister(conn.sock)
                active -= 1
                continue
            conn.t0 = now
            conn.expect = spec.pipeline
            conn.sock.sendall(conn.acquire)
    sel.close()
    result.finished_ns = clock()
    result.pairs = pairs
    result.errors = errors
    result.latencies_ns = latencies.tobytes()


def _drive_one(spec: LoadSpec, conn: _Conn, result: LoadResult) -> None:
    """The single-connection case without a selector (the leanest round trip we can do)."""
    dflockd = spec.protocol == "dflockd"
    sha = spec.script_sha.encode()
    released_reply = _DFLOCKD_RELEASED if dflockd else _REDIS_RELEASED
    sock = conn.sock
    recv = sock.recv
    latencies = array("q")
    record = spec.record_latency
    clock = time.monotonic_ns
    start = clock()
    deadline = start + int(spec.duration_s * 1e9)
    result.started_ns = start
    pairs = errors = 0
    n = spec.pipeline
    now = start
    while now < deadline:
        t0 = clock()
        sock.sendall(conn.acquire)
        buf = recv(RECV_BYTES)
        while buf.count(b"\n") < n:
            more = recv(RECV_BYTES)
            if not more:
                raise ConnectionError("the server closed the connection")
            buf += more
        lines = buf.split(b"\n")
        lines.pop()
        if dflockd:
            batch, granted = _dflockd_releases(conn, lines)
        else:
            batch, granted = _redis_releases(conn, lines, sha)
        errors += n - granted
        if granted:
            sock.sendall(batch)
            buf = recv(RECV_BYTES)
            while buf.count(b"\n") < granted:
                more = recv(RECV_BYTES)
                if not more:
                    raise ConnectionError("the server closed the connection")
                buf += more
            lines = buf.split(b"\n")
            lines.pop()
            done = sum(1 for line in lines if line == released_reply)
            errors += granted - done
            pairs += done
        now = clock()
        if record:
            latencies.append(now - t0)
    result.finished_ns = now
    result.pairs = pairs
    result.errors = errors
    result.latencies_ns = latencies.tobytes()


def generator_main(spec: LoadSpec, pipe: Pipe) -> None:
    """A generator process: connect, ``ready``; on ``go`` run; send the result; on ``quit`` end."""
    conns: list[_Conn] = []
    try:
        conns = _connect(spec)
        pipe.send(("ready", None))
        if pipe.recv() != "go":
            return
        result = LoadResult()
        cpu0 = time.process_time()
        if len(conns) == 1:
            _drive_one(spec, conns[0], result)
        else:
            _drive(spec, conns, result)
        result.cpu_s = time.process_time() - cpu0
        pipe.send(("result", result))
        pipe.recv()  # "quit": the parent has read the server's CPU time
    except BaseException as exc:
        pipe.send(("error", f"{exc!r}\n{traceback.format_exc()}"))
    finally:
        for conn in conns:
            conn.sock.close()
        pipe.close()


def split_connections(total: int, processes: int) -> list[int]:
    """``total`` connections over at most ``processes`` generator processes."""
    processes = max(1, min(processes, total))
    base, extra = divmod(total, processes)
    return [base + (1 if i < extra else 0) for i in range(processes)]


def run_load(specs: Sequence[LoadSpec], server_cpu_ns: Callable[[], int]) -> Measurement:
    """Run one generator process per spec against one server; ``server_cpu_ns()`` reads the
    server's CPU time, taken once every generator is connected and again once all are done."""
    ctx = multiprocessing.get_context("fork")  # the parent holds no threads here
    pipes: list[Pipe] = []
    procs: list[BaseProcess] = []
    try:
        for spec in specs:
            parent_end, child_end = ctx.Pipe()
            proc = ctx.Process(target=generator_main, args=(spec, child_end), daemon=True)
            proc.start()
            child_end.close()
            pipes.append(parent_end)
            procs.append(proc)
        for pipe in pipes:
            _expect(pipe, "ready", READY_TIMEOUT_S)
        cpu0 = server_cpu_ns()
        for pipe in pipes:
            pipe.send("go")
        longest = max(spec.duration_s for spec in specs) + RESULT_GRACE_S
        results: list[LoadResult] = [_expect(pipe, "result", longest) for pipe in pipes]
        cpu1 = server_cpu_ns()
        for pipe in pipes:
            pipe.send("quit")
        for proc in procs:
            proc.join(10)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
        for pipe in pipes:
            pipe.close()
    latencies: list[int] = []
    for result in results:
        latencies.extend(array("q", result.latencies_ns))
    latencies.sort()
    return Measurement(
        pairs=sum(r.pairs for r in results),
        errors=sum(r.errors for r in results),
        wall_s=(max(r.finished_ns for r in results) - min(r.started_ns for r in results)) / 1e9,
        server_cpu_ns=cpu1 - cpu0,
        generator_cpu_s=sum(r.cpu_s for r in results),
        latencies_ns=latencies,
    )


def _expect(pipe: Pipe, what: str, timeout: float) -> Any:
    if not pipe.poll(timeout):
        raise RuntimeError(f"a load generator sent no {what!r} within {timeout:.0f} s")
    kind, payload = pipe.recv()
    if kind == "error":
        raise RuntimeError(f"a load generator failed:\n{payload}")
    if kind != what:
        raise RuntimeError(f"a load generator sent {kind!r}, expected {what!r}")
    return payload
