"""Restart benchmark (issue 52): how long a restart with many leases held takes, and what it
leaves in memory, beside Redis loading its append-only file.

    uv run python -m benchmarks.restart            # 1,000,000 leases, 3 rounds (a few minutes)
    uv run python -m benchmarks.restart --quick    # 2,000 leases, 1 round (the smoke test)

For each round and server, in a fresh directory:

- **dflockd**, started as a user starts it: the ``dflockd`` command on 127.0.0.1 and a fixed
  free port, its state directory at its default (``$XDG_STATE_HOME/dflockd/<host>-<port>``,
  ``XDG_STATE_HOME`` pointed into the work directory: never the user's own), the journal at its
  default fsync; only the caps a million keys need are raised (``--max-locks``,
  ``--max-locks-per-connection 0``, ``--max-locks-per-ip 0``). One connection takes ``--leases``
  locks pipelined (``l <key> 0 300``: 300 s leases, batches of ``BATCH``), every reply checked.
- **Redis** (``redis-server --port P --appendonly yes --dir <dir>``, its defaults otherwise:
  ``appendfsync everysec``, a multi-part AOF): ``SET <key> <token> NX PX 300000`` pipelined on
  one connection, the same keys.

Then, after a second at rest: its RSS, ``kill -9``, and the same command again. Timed from the
restart's ``Popen``: *listening* (a TCP connect succeeds), *answering* (dflockd: ``ping``
answered ``ok``; Redis: ``PING`` answered ``+PONG``, not ``-LOADING``), and *consistent* (a key
held before the kill is refused, ``timeout`` / nil, and a fresh key is granted). Then its RSS
after the restore (a second at rest later), and its peak (``VmHWM``). dflockd's own log line
gives the leases it restored; the benchmark checks that every one came back.

Goal (issue 52, acceptance 4): dflockd listening (and answering consistently) within 2x of
Redis's AOF load time, and its RSS after the restore within 1.2x of before it, the median of
the rounds, for each build measured.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks._codec import PING, lock
from benchmarks._common import (
    COMPILED_SUFFIX,
    BenchRun,
    Goal,
    Table,
    available_loops,
    base_parser,
    compiled_site,
    dflockd_command,
    fmt_num,
    fmt_ratio,
    free_port,
    median,
    ratio,
    redis_server_binary,
    resp,
    rss_bytes,
    split_build,
    workdir,
)

NAME = "restart"
FULL_LEASES = 1_000_000
QUICK_LEASES = 2_000
FULL_ROUNDS = 3
LEASE_S = 300
BATCH = 10_000
"""Requests per pipelined write while taking the leases."""
SETTLE_S = 1.0
"""At rest before each RSS reading (and before the kill: Redis's AOF everysec and the
journal's writes are in the kernel's hands by then)."""
RESTART_TIMEOUT_S = 300.0
POLL_S = 0.005
REDIS = "redis AOF"
GOAL_TIME_RATIO = 2.0
GOAL_RSS_RATIO = 1.2
BASELINE = " at "
"""A server named ``<build> at <dir>`` runs the pure server of another checkout (``dir``: its
``server`` folder, put first on ``PYTHONPATH``): ``--baseline``, for a before/after in one
run."""
_RESTORED = re.compile(rb"journal: restored (\d+) lease")


@dataclass
class Round:
    """One server's restart."""

    server: str
    leases: int
    take_s: float
    """Taking the leases (pipelined, one connection)."""
    rss_before: int
    listening_s: float
    answering_s: float
    consistent_s: float
    rss_after: int
    peak_rss: int
    """``VmHWM`` of the restarted process, read with ``rss_after``."""
    restored: int
    """What the server says it restored (dflockd's log; Redis: ``DBSIZE``)."""


def _status_field(pid: int, name: str) -> int:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(name + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as fh:
                out += [int(p) for p in fh.read().split()]
    except OSError:
        pass
    return out


def _kill9(proc: subprocess.Popen[bytes]) -> None:
    """``kill -9`` the server and any child it forked (Redis's AOF rewrite), by pid."""
    children = _children(proc.pid)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    for child in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)


class Conn:
    """A blocking connection that reads replies by their line ends."""

    def __init__(self, port: int, timeout_s: float = 120.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = b""

    def lines(self, n: int, sep: bytes) -> list[bytes]:
        chunks = [self.buf]
        have = self.buf.count(sep)
        while have < n:
            data = self.sock.recv(1 << 20)
            if not data:
                raise ConnectionError("the server closed the connection")
            chunks.append(data)
            have += data.count(sep)
        parts = b"".join(chunks).split(sep, n)
        self.buf = parts.pop()
        return parts

    def close(self) -> None:
        self.sock.close()


@dataclass(frozen=True)
class Kind:
    """What differs between dflockd and Redis here: requests, replies, the start command."""

    name: str
    sep: bytes
    acquire: Callable[[int], bytes]
    granted: Callable[[bytes], bool]
    refused: Callable[[bytes], bool]
    ping: bytes
    pong: bytes


def _key(i: int) -> bytes:
    return b"restart-%d" % i


DFLOCKD_KIND = Kind(
    "dflockd",
    b"\n",
    lambda i: lock(0, LEASE_S) % _key(i),
    lambda line: line.startswith(b"ok "),
    lambda line: line == b"timeout",
    PING,
    b"ok",
)
REDIS_KIND = Kind(
    REDIS,
    b"\r\n",
    lambda i: resp(b"SET", _key(i), b"t%d" % i, b"NX", b"PX", b"%d" % (LEASE_S * 1000)),
    lambda line: line == b"+OK",
    lambda line: line in (b"$-1", b"_"),
    b"PING\r\n",
    b"+PONG",
)


def _take(kind: Kind, conn: Conn, n: int) -> float:
    """Take ``n`` leases on ``conn`` (kept open: a close would release them)."""
    start = time.perf_counter()
    for base in range(0, n, BATCH):
        count = min(BATCH, n - base)
        conn.sock.sendall(b"".join(kind.acquire(base + i) for i in range(count)))
        for line in conn.lines(count, kind.sep):
            if not kind.granted(line):
                raise RuntimeError(f"{kind.name} refused a lease: {line[:80]!r}")
    return time.perf_counter() - start


def _restart_timings(
    kind: Kind, proc: subprocess.Popen[bytes], port: int, started: float, fresh: int
) -> tuple[float, float, float]:
    """Seconds from ``started`` until listening, answering, and consistent."""
    deadline = started + RESTART_TIMEOUT_S
    conn: Conn | None = None
    while conn is None:
        if proc.poll() is not None:
            raise RuntimeError(f"{kind.name} exited during its restart ({proc.returncode})")
        if time.perf_counter() > deadline:
            raise RuntimeError(f"{kind.name} did not listen within {RESTART_TIMEOUT_S} s")
        try:
            conn = Conn(port, timeout_s=RESTART_TIMEOUT_S)
        except OSError:
            time.sleep(POLL_S)
    listening = time.perf_counter() - started
    try:
        while True:
            conn.sock.sendall(kind.ping)
            (line,) = conn.lines(1, kind.sep)
            if line == kind.pong:
                break
            if not line.startswith(b"-LOADING"):
                raise RuntimeError(f"{kind.name} answered its ping {line[:80]!r}")
            time.sleep(POLL_S)  # Redis: still loading its AOF
        answering = time.perf_counter() - started
        conn.sock.sendall(kind.acquire(0) + kind.acquire(fresh))
        held, new = conn.lines(2, kind.sep)
        consistent = time.perf_counter() - started
    finally:
        conn.close()
    if not kind.refused(held):
        raise RuntimeError(f"{kind.name} granted a key held before the kill: {held[:80]!r}")
    if not kind.granted(new):
        raise RuntimeError(f"{kind.name} did not grant a fresh key: {new[:80]!r}")
    return listening, answering, consistent


def _dflockd_start(
    build: str, tmp: Path, port: int, leases: int, site: str = ""
) -> Callable[[], Any]:
    build, _, baseline = build.partition(BASELINE)
    loop, compiled = split_build(build)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLOCKD_")}
    env["XDG_STATE_HOME"] = str(tmp / "xdg-state")  # the default state dir, inside tmp
    if baseline:
        env["PYTHONPATH"] = os.pathsep.join([baseline, *filter(None, [env.get("PYTHONPATH")])])
    elif compiled:
        env["PYTHONPATH"] = os.pathsep.join(
            [site or str(compiled_site(tmp.parent)), *filter(None, [env.get("PYTHONPATH")])]
        )
    command = [*dflockd_command(loop), "--host", "127.0.0.1", "--port", str(port)]
    command += ["--max-locks", str(leases + 10), "--max-locks-per-connection", "0"]
    command += ["--max-locks-per-ip", "0"]
    log = tmp / "dflockd.log"

    def start() -> subprocess.Popen[bytes]:
        with log.open("ab") as out:
            return subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env
            )

    return start


def _redis_start(tmp: Path, port: int) -> Callable[[], Any]:
    binary = redis_server_binary()
    if binary is None:
        raise RuntimeError("redis-server is not on PATH (the benchmark compares against it)")
    data = tmp / "redis-data"
    data.mkdir()
    command = [binary, "--bind", "127.0.0.1", "--port", str(port), "--appendonly", "yes"]
    command += ["--dir", str(data), "--logfile", str(tmp / "redis.log")]

    def start() -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )

    return start


def _redis_quiet(port: int) -> None:
    """Until Redis runs no AOF rewrite (the kill must not land in one)."""
    conn = Conn(port)
    try:
        while True:
            conn.sock.sendall(resp(b"INFO", b"persistence"))
            (head,) = conn.lines(1, b"\r\n")
            size = int(head[1:])
            while len(conn.buf) < size + 2:
                conn.buf += conn.sock.recv(1 << 16)
            body, conn.buf = conn.buf[:size], conn.buf[size + 2 :]
            if b"aof_rewrite_in_progress:0" in body and b"aof_rewrite_scheduled:0" in body:
                return
            time.sleep(0.1)
    finally:
        conn.close()


def _redis_dbsize(port: int) -> int:
    conn = Conn(port)
    try:
        conn.sock.sendall(resp(b"DBSIZE"))
        (line,) = conn.lines(1, b"\r\n")
        return int(line[1:])
    finally:
        conn.close()


def one_round(server: str, base: Path, leases: int, round_no: int, site: str = "") -> Round:
    tmp = base / f"{re.sub(r'[^a-z0-9+]+', '-', server)}-{round_no}"
    tmp.mkdir()
    port = free_port()
    is_redis = server == REDIS
    kind = REDIS_KIND if is_redis else DFLOCKD_KIND
    start = _redis_start(tmp, port) if is_redis else _dflockd_start(server, tmp, port, leases, site)
    proc: subprocess.Popen[bytes] = start()
    try:
        # a held key refused is asked of a key not held yet: the start waits for any answer
        _wait_ready_first(kind, proc, port)
        holder = Conn(port)
        try:
            take_s = _take(kind, holder, leases)
            if is_redis:
                _redis_quiet(port)
            time.sleep(SETTLE_S)
            rss_before = rss_bytes(proc.pid)
            _kill9(proc)
        finally:
            holder.close()
        started = time.perf_counter()
        proc = start()
        listening, answering, consistent = _restart_timings(
            kind, proc, port, started, fresh=leases + 1
        )
        time.sleep(SETTLE_S)
        rss_after = rss_bytes(proc.pid)
        peak = _status_field(proc.pid, "VmHWM")
        if is_redis:
            restored = _redis_dbsize(port) - 1  # the fresh key
        else:
            found = _RESTORED.findall((tmp / "dflockd.log").read_bytes())
            restored = int(found[-1]) if found else -1
    finally:
        if proc.poll() is None:
            _kill9(proc)
    if restored != leases:
        raise RuntimeError(f"{server} restored {restored} lease(s) of {leases}")
    return Round(
        server,
        leases,
        take_s,
        rss_before,
        listening,
        answering,
        consistent,
        rss_after,
        peak,
        restored,
    )


def _wait_ready_first(kind: Kind, proc: subprocess.Popen[bytes], port: int) -> None:
    """Until a first start answers ``ping`` (nothing is held yet)."""
    deadline = time.perf_counter() + RESTART_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{kind.name} exited at its start ({proc.returncode})")
        try:
            conn = Conn(port, timeout_s=30)
        except OSError:
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{kind.name} did not start") from None
            time.sleep(POLL_S)
            continue
        try:
            conn.sock.sendall(kind.ping)
            (line,) = conn.lines(1, kind.sep)
        finally:
            conn.close()
        if line == kind.pong:
            return
        time.sleep(POLL_S)


def _mb(n: float) -> str:
    return fmt_num(n / 1e6, 0)


def main(argv: list[str] | None = None) -> int:
    parser = base_parser(NAME, __doc__ or "")
    parser.add_argument("--leases", type=int, default=0, help=f"default {FULL_LEASES:,}")
    parser.add_argument("--rounds", type=int, default=0, help=f"default {FULL_ROUNDS}")
    parser.add_argument(
        "--builds",
        default="",
        help="comma separated dflockd builds (a loop, +mypyc for the compiled wheel); default: "
        "the first available loop, pure, and (not --quick) compiled",
    )
    parser.add_argument(
        "--compiled-site",
        default="",
        metavar="DIR",
        help="the compiled wheel of this checkout, unpacked (default: built here, as "
        "benchmarks.server builds it)",
    )
    parser.add_argument(
        "--baseline",
        default="",
        metavar="DIR",
        help="also run the pure server of another checkout (its server/ folder), as before",
    )
    args = parser.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    leases = args.leases or (QUICK_LEASES if args.quick else FULL_LEASES)
    rounds = args.rounds or (1 if args.quick else FULL_ROUNDS)
    loop = available_loops()[-1]
    builds = [b for b in args.builds.split(",") if b] or (
        [loop] if args.quick else [loop, loop + COMPILED_SUFFIX]
    )
    baseline = [f"{loop}{BASELINE}{args.baseline}"] if args.baseline else []
    servers = [*builds, *baseline, REDIS]
    run = BenchRun(
        NAME,
        args,
        list(argv),
        params={"leases": leases, "rounds": rounds, "lease_s": LEASE_S, "servers": servers},
    )
    results: list[Round] = []
    with workdir("dflock-bench-restart-") as base:
        for round_no in range(rounds):
            order = servers[round_no % len(servers) :] + servers[: round_no % len(servers)]
            for server in order:
                r = one_round(server, base, leases, round_no, args.compiled_site)
                results.append(r)
                print(
                    f"round {round_no + 1} {server}: took {r.take_s:.1f} s, listening "
                    f"{r.listening_s:.2f} s, answering {r.answering_s:.2f} s, consistent "
                    f"{r.consistent_s:.2f} s, RSS {_mb(r.rss_before)} -> {_mb(r.rss_after)} MB "
                    f"(peak {_mb(r.peak_rss)})",
                    flush=True,
                )

    def med(server: str, attr: str) -> float:
        return median([float(getattr(r, attr)) for r in results if r.server == server])

    table = Table(
        f"Restart with {leases:,} leases held ({LEASE_S} s, one connection), kill -9, the same "
        f"command: median of {rounds} round(s)",
        [
            "server",
            "listening s",
            "answering s",
            "consistent s",
            "/ redis",
            "RSS before MB",
            "RSS after MB",
            "after / before",
            "peak MB",
            "bytes per lease after",
        ],
        notes=[
            "seconds from the restart's Popen: listening (a connect succeeds), answering (ping), "
            "consistent (a key held before the kill refused, a fresh key granted); / redis: "
            "consistent over Redis's; RSS a second at rest after each; peak: VmHWM",
        ],
    )
    redis_consistent = med(REDIS, "consistent_s")
    for server in servers:
        after, before = med(server, "rss_after"), med(server, "rss_before")
        table.rows.append(
            [
                server,
                fmt_num(med(server, "listening_s"), 2),
                fmt_num(med(server, "answering_s"), 2),
                fmt_num(med(server, "consistent_s"), 2),
                fmt_ratio(ratio(med(server, "consistent_s"), redis_consistent)),
                _mb(before),
                _mb(after),
                fmt_ratio(ratio(after, before)),
                _mb(med(server, "peak_rss")),
                fmt_num(after / leases, 0),
            ]
        )
    run.add(table)
    for build in builds:
        time_ratio = ratio(med(build, "consistent_s"), redis_consistent)
        rss_ratio = ratio(med(build, "rss_after"), med(build, "rss_before"))
        run.goals.append(
            Goal(
                f"restart with {leases:,} leases held ({build}) listening and consistent "
                f"within {GOAL_TIME_RATIO:g}x of Redis's AOF load, RSS after the restore "
                f"within {GOAL_RSS_RATIO:g}x of before it (issue 52)",
                f"{fmt_ratio(time_ratio)} of Redis's time "
                f"({med(build, 'consistent_s'):.2f} s against {redis_consistent:.2f} s), RSS "
                f"{fmt_ratio(rss_ratio)}",
                time_ratio <= GOAL_TIME_RATIO and rss_ratio <= GOAL_RSS_RATIO,
            )
        )
    run.data["rounds"] = [asdict(r) for r in results]
    run.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
