"""Scale benchmark: memory per held lock and per idle connection, dflockd against Redis; and
the server's CPU per refused new-key acquire with a full key table of growing size.

    uv run python -m benchmarks.scale            # 100,000 locks, 10,000 connections (~1.5 minutes)
    uv run python -m benchmarks.scale --quick

Refusals: a fresh server with ``--max-locks N`` holds N keys (pipelined on one connection), then
refuses ``--refusals`` acquires of new keys (``error_max_locks``, pipelined on a second one);
the row is the server's CPU time over those requests divided by their number (the least of
five rounds), for each N of ``--full-tables``. A refusal that scanned the table would grow with
N; the goal is flat (the largest within 2x of the smallest). Redis has no key cap: no row.

Each server is a fresh child process: dflockd on each loop, from the pure-Python wheel and (but
in a quick run) from its compiled one, whose table's objects are mypyc's native classes, and
Redis. Memory is its resident set (``VmRSS``) growth: after one
warm-up request, then after ``--locks`` distinct keys are acquired and held (pipelined on one
connection), and, on a fresh server, after ``--connections`` idle connections are open (no
request sent; the server counts them). For Redis the growth of its own ``used_memory`` is shown
too. The benchmark raises its open-file limit (children inherit it) for the connections.

Where the bytes go: one more pure-Python dflockd, on asyncio's loop, runs under ``tracemalloc``
(``python -X tracemalloc``, its snapshots dumped on ``SIGUSR1``); it holds ``--traced-locks``
keys, then queues a waiter on each, then takes ``--traced-connections`` idle connections, and
the snapshots' differences give the bytes per held lock, per waiter and per idle connection
by the source line that allocated them. tracemalloc counts what Python asked the allocator
for; RSS adds the allocator's rounding and what it keeps free. uvloop's transports are C, whose
allocations tracemalloc puts on no line, and mypyc's native objects on the line of the nearest
interpreted caller: hence the pure-Python server on asyncio's loop.
"""

from __future__ import annotations

import json
import linecache
import os
import signal
import socket
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks._codec import PING, STATS, TRY_LOCK, enqueue, lock
from benchmarks._common import (
    BenchRun,
    Goal,
    LineClient,
    ServerProcess,
    Table,
    base_parser,
    default_loops,
    fmt_num,
    fmt_ratio,
    owned_servers,
    raise_fd_limit,
    ratio,
    resp,
    start_dflockd,
    start_redis,
    workdir,
)
from benchmarks._loadgen import LEASE_S

NAME = "scale"
MEMORY_GOAL_RATIO = 2.0
"""Issue 28: memory per held lock at most 2x Redis's (RSS growth per held lock)."""
BATCH = 1000
CONNECT_CHUNK = 500
SETTLE_TIMEOUT_S = 180.0
"""How long a step may take before the run fails: the traced server answers a ``stats`` that
lists 20,000 locks and their waiters in over 10 s on a slow machine."""
FD_MARGIN = 512
SILENT_FOR_LONG = ("--read-timeout", "3600")
"""dflockd's flags for connections that stay silent while a measurement runs (the holder of
the locks, 10,000 idle connections, a waiting asker): a read timeout as long as the leases.
Every connection still keeps its read timer, as with the default (23 s), so the bytes per
connection are the default's; the timer just never fires on a slow machine mid-measurement."""
REDIS = "redis"
MB = 1024 * 1024
REFUSAL_ROUNDS = 5


@dataclass
class Memory:
    server: str
    what: str
    count: int
    rss_before: int
    rss_after: int
    used_before: int | None = None
    used_after: int | None = None

    @property
    def per_item(self) -> float:
        return (self.rss_after - self.rss_before) / self.count

    @property
    def used_per_item(self) -> float:
        if self.used_before is None or self.used_after is None:
            return float("nan")
        return (self.used_after - self.used_before) / self.count

    def as_dict(self) -> dict[str, Any]:
        return {
            "server": self.server,
            "what": self.what,
            "count": self.count,
            "rss_before": self.rss_before,
            "rss_after": self.rss_after,
            "bytes_per_item": round(self.per_item, 1),
            "used_memory_bytes_per_item": (
                None if self.used_before is None else round(self.used_per_item, 1)
            ),
        }


# ------------------------------------------------------------------------------ wire helpers
def dflockd_connections(client: LineClient) -> int:
    reply = client.call(STATS)
    return int(json.loads(reply[3:])["connections"])


def redis_info(client: LineClient, field: str) -> int:
    client.sock.sendall(resp(b"INFO"))
    header = client.lines(1)[0]
    size = int(header[1:].strip())
    body = client.buf
    while len(body) < size + 2:
        data = client.sock.recv(1 << 16)
        if not data:
            raise ConnectionError("redis closed the connection")
        body += data
    client.buf = body[size + 2 :]
    for line in body[:size].decode().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split(":", 1)[1])
    raise RuntimeError(f"no {field} in INFO")


def hold_locks(server: ServerProcess, client: LineClient, count: int, first: int = 0) -> None:
    """Acquire ``count`` distinct keys (numbered from ``first``) on ``client``'s connection
    (pipelined) and keep them."""
    redis = server.label == REDIS
    px = b"%d" % (LEASE_S * 1000 * 100)
    for start in range(0, count, BATCH):
        n = min(BATCH, count - start)
        keys = [b"dflock-bench:scale:%07d" % i for i in range(first + start, first + start + n)]
        if redis:
            batch = b"".join(
                resp(b"SET", key, b"%032x" % i, b"NX", b"PX", px) for i, key in enumerate(keys)
            )
        else:
            batch = b"".join(TRY_LOCK % key for key in keys)
        client.sock.sendall(batch)
        for line in client.lines(n):
            if not (line.startswith(b"ok ") or line == b"+OK\r"):
                raise RuntimeError(f"{server.label} refused a lock: {line!r}")


def queue_waiters(client: LineClient, count: int) -> None:
    """Queue one waiter (two-phase ``e``, pipelined) on each of the first ``count`` keys
    ``hold_locks`` holds; each must be answered ``queued``."""
    for start_at in range(0, count, BATCH):
        n = min(BATCH, count - start_at)
        waiter = enqueue("dflock-bench:scale:%07d")
        client.sock.sendall(b"".join(waiter % i for i in range(start_at, start_at + n)))
        for line in client.lines(n):
            if line != b"queued":
                raise RuntimeError(f"expected queued, got {line!r}")


def open_idle(
    server: ServerProcess, count: int, seen: Callable[[], int], baseline: int
) -> list[socket.socket]:
    """Open ``count`` connections that send nothing; return once the server counts them all."""
    socks: list[socket.socket] = []
    try:
        for start in range(0, count, CONNECT_CHUNK):
            for _ in range(min(CONNECT_CHUNK, count - start)):
                socks.append(socket.create_connection((server.host, server.port), timeout=30))
            wait_for(lambda: seen() >= baseline + len(socks), f"{len(socks)} connections")
    except BaseException:
        for sock in socks:
            sock.close()
        raise
    return socks


def wait_for(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.01)


# ------------------------------------------------------------------------------ measurements
def start(label: str, tmp: Any, maxclients: int) -> ServerProcess:
    if label == REDIS:
        return start_redis(tmp, maxclients=maxclients)
    loop = label.removeprefix("dflockd (").rstrip(")")
    return start_dflockd(loop, tmp, *dflockd_flags(maxclients))


def dflockd_flags(maxclients: int) -> tuple[str, ...]:
    """dflockd's flags for the memory measurements: room for every key and connection."""
    return (
        "--max-locks",
        str(10 * maxclients + 1_000_000),
        "--max-locks-per-connection",
        "0",  # every key is held over one connection
        "--max-locks-per-ip",
        "0",  # ... from one address
        "--default-lease-ttl",
        "3600",
        "--max-lease-ttl",
        "3600",
        "--max-connections",
        "0",  # 10,000 idle connections: past the default cap
        "--max-waits-per-connection",
        "0",  # every waiter is queued over one connection
        *SILENT_FOR_LONG,
    )


def measure_locks(label: str, tmp: Any, count: int, maxclients: int) -> Memory:
    with owned_servers() as servers:
        server = start(label, tmp, maxclients)
        servers.append(server)
        client = LineClient(server, SETTLE_TIMEOUT_S)
        try:
            warm = resp(b"PING") if label == REDIS else PING
            client.call(warm)
            used_before = redis_info(client, "used_memory") if label == REDIS else None
            before = server.rss()
            hold_locks(server, client, count)
            after = server.rss()
            used_after = redis_info(client, "used_memory") if label == REDIS else None
        finally:
            client.close()
    return Memory(label, "held lock", count, before, after, used_before, used_after)


def measure_connections(label: str, tmp: Any, count: int) -> Memory:
    with owned_servers() as servers:
        server = start(label, tmp, count + 100)
        servers.append(server)
        monitor = LineClient(server, SETTLE_TIMEOUT_S)
        socks: list[socket.socket] = []
        try:
            if label == REDIS:
                monitor.call(resp(b"PING"))

                def seen() -> int:
                    return redis_info(monitor, "connected_clients")
            else:

                def seen() -> int:
                    return dflockd_connections(monitor)

            baseline = seen()
            used_before = redis_info(monitor, "used_memory") if label == REDIS else None
            before = server.rss()
            socks = open_idle(server, count, seen, baseline)
            after = server.rss()
            used_after = redis_info(monitor, "used_memory") if label == REDIS else None
            if seen() < baseline + count:
                raise RuntimeError(f"{label} dropped idle connections during the measurement")
        finally:
            for sock in socks:
                sock.close()
            monitor.close()
    return Memory(label, "idle connection", count, before, after, used_before, used_after)


def measure_waiters(loop: str, tmp: Any, count: int) -> Memory:
    """``count`` held keys, then one waiter queued on each (two-phase ``e``, pipelined over one
    connection, each answered ``queued``): the RSS growth per waiter. Redis has no queue (its
    Lock's waiters poll), so there is no Redis row."""
    with owned_servers() as servers:
        server = start(f"dflockd ({loop})", tmp, count)
        servers.append(server)
        holder = LineClient(server, SETTLE_TIMEOUT_S)
        waiter = LineClient(server, SETTLE_TIMEOUT_S)
        try:
            hold_locks(server, holder, count)
            waiter.call(PING)
            before = server.rss()
            queue_waiters(waiter, count)
            after = server.rss()
        finally:
            holder.close()
            waiter.close()
    return Memory(server.label, "waiter", count, before, after)


# ------------------------------------------------------------------------------ tracemalloc
_TRACED_BOOT = (
    "import os, signal, sys, tracemalloc\n"
    "sys.modules['uvloop'] = None  # asyncio's loop: its transports are Python, traced\n"
    "path = sys.argv[1]\n"
    "def dump(signum, frame):\n"
    "    tracemalloc.take_snapshot().dump(path + '.part')\n"
    "    os.replace(path + '.part', path)\n"
    "signal.signal(signal.SIGUSR1, dump)\n"
    "from dflockd_server.cli import main\n"
    "main(sys.argv[2:])\n"
)
"""Runs ``dflockd`` (asyncio's loop) and dumps a tracemalloc snapshot to ``argv[1]`` on SIGUSR1."""
TRACED_SITES = 6
"""Allocation sites listed per item (the rest summed as one row)."""


@dataclass
class Site:
    item: str
    site: str
    bytes_per_item: float
    blocks_per_item: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "item": self.item,
            "site": self.site,
            "bytes_per_item": round(self.bytes_per_item, 1),
            "blocks_per_item": round(self.blocks_per_item, 2),
        }


def _snapshot(server: ServerProcess, path: str) -> tracemalloc.Snapshot:
    """Ask the traced server for a snapshot and load it."""
    if os.path.exists(path):
        os.unlink(path)
    os.kill(server.pid, signal.SIGUSR1)
    wait_for(lambda: os.path.exists(path), "the traced server's snapshot")
    return tracemalloc.Snapshot.load(path)


def _sites(
    item: str, before: tracemalloc.Snapshot, after: tracemalloc.Snapshot, count: int
) -> list[Site]:
    """The growth from ``before`` to ``after`` per item, by allocating line: the largest
    ``TRACED_SITES``, then the rest, then the total."""
    compared = after.compare_to(before, "lineno")
    stats = [s for s in compared if s.size_diff > 0]
    sites: list[Site] = []
    for stat in stats[:TRACED_SITES]:
        frame = stat.traceback[0]
        code = linecache.getline(frame.filename, frame.lineno).strip()
        where = f"{os.path.basename(frame.filename)}:{frame.lineno}"
        sites.append(
            Site(item, f"{where} `{code}`", stat.size_diff / count, stat.count_diff / count)
        )
    rest = stats[TRACED_SITES:]
    sites.append(
        Site(
            item,
            f"{len(rest)} other lines",
            sum(s.size_diff for s in rest) / count,
            sum(s.count_diff for s in rest) / count,
        )
    )
    sites.append(
        Site(
            item,
            "all (net, freed blocks netted out)",
            sum(s.size_diff for s in compared) / count,
            sum(s.count_diff for s in compared) / count,
        )
    )
    return sites


def measure_traced(tmp: Any, locks: int, connections: int) -> list[Site]:
    """The pure-Python server on asyncio's loop under tracemalloc: bytes per held lock, per
    waiter and per idle connection, by allocating line (see the module's doc)."""
    path = str(tmp / "traced.snapshot")
    with owned_servers() as servers:
        server = start_dflockd(
            "asyncio",
            tmp,
            *dflockd_flags(connections),
            command=[sys.executable, "-X", "tracemalloc=1", "-c", _TRACED_BOOT, path],
        )
        servers.append(server)
        holder = LineClient(server, SETTLE_TIMEOUT_S)
        waiter = LineClient(server, SETTLE_TIMEOUT_S)
        socks: list[socket.socket] = []
        try:
            waiter.call(PING)
            # Warm up: the table's dict and the lease index grow in steps; the growth is
            # measured past the first thousand keys, as the RSS rows (100,000 keys) are.
            hold_locks(server, holder, 1000, first=locks)
            start_snapshot = _snapshot(server, path)
            hold_locks(server, holder, locks)
            held = _snapshot(server, path)
            queue_waiters(waiter, locks)
            queued = _snapshot(server, path)
            baseline = dflockd_connections(waiter)
            if baseline != 2:  # a closed holder lets its locks go: the figures would be wrong
                raise RuntimeError(
                    f"the traced server counts {baseline} connections, not the holder's and the "
                    "waiter's: it closed one (its --read-timeout?) and let go of what it held"
                )
            socks = open_idle(server, connections, lambda: dflockd_connections(waiter), baseline)
            idle = _snapshot(server, path)
        finally:
            for sock in socks:
                sock.close()
            holder.close()
            waiter.close()
    return [
        *_sites("held lock", start_snapshot, held, locks),
        *_sites("waiter", held, queued, locks),
        *_sites("idle connection", queued, idle, connections),
    ]


@dataclass
class Refusals:
    server: str
    table: int
    count: int
    cpu_ns: int

    @property
    def per_refusal_us(self) -> float:
        return self.cpu_ns / self.count / 1000

    def as_dict(self) -> dict[str, Any]:
        return {
            "server": self.server,
            "full_table_keys": self.table,
            "refusals": self.count,
            "server_cpu_us_per_refusal": round(self.per_refusal_us, 2),
        }


def measure_refusals(loop: str, tmp: Any, table: int, count: int) -> Refusals:
    with owned_servers() as servers:
        server = start_dflockd(
            loop,
            tmp,
            "--max-locks",
            str(table),
            "--max-locks-per-connection",
            "0",  # the table is filled over one connection
            "--max-locks-per-ip",
            "0",  # ... from one address
            "--default-lease-ttl",
            "3600",
            "--max-lease-ttl",
            "3600",
            *SILENT_FOR_LONG,  # the asker waits while the table fills
        )
        servers.append(server)
        holder = LineClient(server, SETTLE_TIMEOUT_S)
        asker = LineClient(server, SETTLE_TIMEOUT_S)
        try:
            hold_locks(server, holder, table)
            asker.call(PING)
            rounds: list[int] = []
            for _ in range(REFUSAL_ROUNDS):
                before = server.cpu_ns()
                for start in range(0, count, BATCH):
                    n = min(BATCH, count - start)
                    new = lock(0, key="dflock-bench:new:%07d")
                    asker.sock.sendall(b"".join(new % i for i in range(start, start + n)))
                    for line in asker.lines(n):
                        if line != b"error_max_locks":
                            raise RuntimeError(f"expected error_max_locks, got {line!r}")
                rounds.append(server.cpu_ns() - before)
            used = min(rounds)  # the least disturbed round (other processes share the cores)
        finally:
            holder.close()
            asker.close()
    return Refusals(server.label, table, count, used)


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser(NAME, __doc__.split("\n", 1)[0] if __doc__ else NAME)
    parser.add_argument("--locks", type=int, default=0, help="held locks (100,000)")
    parser.add_argument("--connections", type=int, default=0, help="idle connections (10,000)")
    parser.add_argument(
        "--loops",
        default="",
        help=(
            "dflockd event loops, comma separated; a loop ending +mypyc runs the server's "
            "compiled wheel, built first (default: asyncio,uvloop,asyncio+mypyc,"
            "uvloop+mypyc; --quick: asyncio,uvloop)"
        ),
    )
    parser.add_argument(
        "--full-tables",
        default="",
        help="key table sizes for the refusal rows (1024,100000,1000000)",
    )
    parser.add_argument("--refusals", type=int, default=0, help="refused acquires (20,000)")
    parser.add_argument(
        "--traced-locks",
        type=int,
        default=0,
        help="held locks and waiters under tracemalloc (20,000)",
    )
    parser.add_argument(
        "--traced-connections",
        type=int,
        default=0,
        help="idle connections under tracemalloc (1,000)",
    )
    args = parser.parse_args(argv)
    quick = bool(args.quick)
    locks = args.locks or (2000 if quick else 100_000)
    connections = args.connections or (200 if quick else 10_000)
    loops = [x for x in args.loops.split(",") if x] or default_loops(quick)
    full_tables = [
        int(x)
        for x in (args.full_tables or ("1024,10000" if quick else "1024,100000,1000000")).split(",")
        if x
    ]
    refusals = args.refusals or (2000 if quick else 20_000)
    traced_locks = args.traced_locks or (1000 if quick else 20_000)
    traced_connections = args.traced_connections or (100 if quick else 1000)
    limit = raise_fd_limit(connections + FD_MARGIN)
    if limit < connections + FD_MARGIN:
        connections = limit - FD_MARGIN
        print(f"open-file limit {limit}: measuring {connections} connections", flush=True)
    run = BenchRun(
        NAME,
        args,
        list(sys.argv[1:] if argv is None else argv),
        params={
            "locks": locks,
            "connections": connections,
            "loops": loops,
            "fd_limit": limit,
            "full_tables": full_tables,
            "refusals": refusals,
            "traced_locks": traced_locks,
            "traced_connections": traced_connections,
        },
    )
    labels = [f"dflockd ({loop})" for loop in loops] + [REDIS]
    held: list[Memory] = []
    idle: list[Memory] = []
    with workdir("dflock-bench-scale-") as tmp:
        for label in labels:
            held.append(measure_locks(label, tmp, locks, connections))
            print(f"{label}: {held[-1].per_item:.0f} bytes per held lock", flush=True)
            idle.append(measure_connections(label, tmp, connections))
            print(f"{label}: {idle[-1].per_item:.0f} bytes per idle connection", flush=True)
        waiting = [measure_waiters(loop, tmp, locks) for loop in loops]
        for m in waiting:
            print(f"{m.server}: {m.per_item:.0f} bytes per waiter", flush=True)
        traced = measure_traced(tmp, traced_locks, min(traced_connections, connections))
        for site in traced:
            if site.site.startswith("all"):
                print(f"tracemalloc: {site.bytes_per_item:.0f} bytes per {site.item}", flush=True)
        refused: list[Refusals] = []
        for loop in loops:
            for size in full_tables:
                refused.append(measure_refusals(loop, tmp, size, refusals))
                print(
                    f"dflockd ({loop}), {size:,} keys: "
                    f"{refused[-1].per_refusal_us:.1f} us CPU per refused new key",
                    flush=True,
                )

    for title, rows in (
        (f"Memory per held lock, {locks:,} keys held (bytes)", held),
        (f"Memory per idle connection, {connections:,} connections (bytes)", idle),
    ):
        redis_row = next(m for m in rows if m.server == REDIS)
        table = Table(
            title,
            [
                "server",
                "RSS before (MB)",
                "RSS after (MB)",
                "per item (RSS)",
                "/ redis",
                "per item (redis used_memory)",
            ],
            notes=["RSS: the server process's resident set growth divided by the count"],
        )
        for m in rows:
            table.rows.append(
                [
                    m.server,
                    fmt_num(m.rss_before / MB),
                    fmt_num(m.rss_after / MB),
                    fmt_num(m.per_item, 0),
                    fmt_ratio(ratio(m.per_item, redis_row.per_item)),
                    fmt_num(m.used_per_item, 0),
                ]
            )
        run.add(table)
    table = Table(
        f"Memory per waiter, {locks:,} held keys with one queued acquire each (bytes)",
        ["server", "RSS before (MB)", "RSS after (MB)", "per waiter (RSS)", "/ its held lock"],
        notes=[
            "RSS growth divided by the waiters, queued by two-phase `e` over one connection; "
            "Redis has no queue (redis-py's Lock polls), so no row"
        ],
    )
    for m in waiting:
        lock = next(h for h in held if h.server == m.server)
        table.rows.append(
            [
                m.server,
                fmt_num(m.rss_before / MB),
                fmt_num(m.rss_after / MB),
                fmt_num(m.per_item, 0),
                fmt_ratio(ratio(m.per_item, lock.per_item)),
            ]
        )
    run.add(table)
    redis_held = next(m for m in held if m.server == REDIS)
    for m in held:
        if m.server == REDIS:
            continue
        share = ratio(m.per_item, redis_held.per_item)
        run.goals.append(
            Goal(
                goal=f"memory per held lock at most {MEMORY_GOAL_RATIO:g}x Redis's ({m.server})",
                measured=(
                    f"{m.per_item:,.0f} B against Redis's {redis_held.per_item:,.0f} B "
                    f"({share:.2f}x)"
                ),
                met=share <= MEMORY_GOAL_RATIO,
                detail=f"RSS growth per lock, {locks:,} keys held",
            )
        )
    rss = {
        "held lock": next((m for m in held if m.server == "dflockd (asyncio)"), None),
        "waiter": next((m for m in waiting if m.server == "dflockd (asyncio)"), None),
        "idle connection": next((m for m in idle if m.server == "dflockd (asyncio)"), None),
    }
    table = Table(
        "Where the bytes go: the pure-Python server on asyncio's loop under tracemalloc "
        f"({traced_locks:,} held locks, a waiter on each, "
        f"{min(traced_connections, connections):,} idle connections)",
        ["item", "allocated at", "bytes per item", "blocks per item"],
        notes=[
            "what Python asked the allocator for, by the line that allocated it (the growth "
            "between snapshots, divided by the count); RSS adds the allocator's rounding and "
            "free space: "
            + ", ".join(
                f"{item} {fmt_num(m.per_item, 0)} B by RSS (dflockd (asyncio), above)"
                for item, m in rss.items()
                if m is not None
            )
        ],
    )
    for site in traced:
        table.rows.append(
            [
                site.item,
                site.site,
                fmt_num(site.bytes_per_item, 1),
                fmt_num(site.blocks_per_item, 2),
            ]
        )
    run.add(table)
    run.data["traced"] = [site.as_dict() for site in traced]
    table = Table(
        f"Server CPU per refused new-key acquire, full key table ({refusals:,} refusals)",
        ["server", *(f"{size:,} keys (us)" for size in full_tables), "largest / smallest"],
        notes=[
            "goal: flat, the largest within 2x of the smallest (a refusal must not scan the "
            "table); Redis has no key cap, so no row"
        ],
    )
    flat = True
    for loop in loops:
        rows = [r for r in refused if r.server == f"dflockd ({loop})"]
        spread = ratio(max(r.per_refusal_us for r in rows), min(r.per_refusal_us for r in rows))
        flat = flat and spread <= 2
        table.rows.append(
            [f"dflockd ({loop})", *(fmt_num(r.per_refusal_us, 1) for r in rows), fmt_ratio(spread)]
        )
    run.add(table)
    run.data["refusals"] = [r.as_dict() for r in refused]
    run.data["refusals_flat"] = flat
    run.data["held_locks"] = [m.as_dict() for m in held]
    run.data["idle_connections"] = [m.as_dict() for m in idle]
    run.data["waiters"] = [m.as_dict() for m in waiting]
    run.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
