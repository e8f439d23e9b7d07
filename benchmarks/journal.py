"""Lease journal benchmark: what durability costs, dflockd's journal beside Redis's AOF.

    uv run python -m benchmarks.journal            # full size (about 4 minutes on 2 cores)
    uv run python -m benchmarks.journal --quick    # seconds, tiny sizes (the smoke test)
    uv run python -m benchmarks.journal --renewals # what a renewal's record costs (about 1 minute)

Starts six servers as child processes: ``dflockd`` (one event loop, uvloop where installed)
with its journal off (``--state-dir none``), and with a state directory (fresh, in the
benchmark's work directory) at each ``--journal-fsync``: ``no``, ``everysec`` (the default)
and ``always``; a private ``redis-server`` without persistence, and one with its append-only
file on (``--appendonly yes --appendfsync everysec``, its directory in the work directory).
Then for every round and load it drives each of them in turn (the order rotates) with the
same acquire+release pairs (``_loadgen``, as ``benchmarks.server``): round trips at 1, 10 and
50 connections, pipelined batches at 10. Server CPU time is the server process's own
(``/proc/<pid>/task/*/schedstat``).

At the end it asks each dflockd for its ``stats`` (the ``journal`` field: writes, fsyncs,
compactions) and each Redis for ``INFO persistence``, and reads the files they left, so the
results show that every durable server really wrote.

``--renewals`` measures something else, written to ``journal_renewals.json``: what recording
every renewal costs (issue 47). Each connection holds 200 locks and renews them in turn, in
round trips (``n``: so that each renewal moves its lease's end), at 1 and 10 connections,
against ``dflockd`` with its journal off, and at ``everysec`` and ``always`` (every renewal
writes a record, group-committed like the grants', and not fsynced even with ``always``).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._codec import RELEASE, STATS, lock, renew
from benchmarks._common import (
    BenchRun,
    Goal,
    ServerProcess,
    Table,
    available_loops,
    base_parser,
    children_cpu_ns,
    fmt_num,
    fmt_ratio,
    owned_servers,
    ratio,
    read_line,
    start_dflockd,
    start_redis,
    stat_cpu_ns,
    workdir,
    written_bytes,
)
from benchmarks._loadgen import Measurement
from benchmarks.server import (
    MAX_LOCKS,
    WARMUP_S,
    Aggregate,
    Cell,
    aggregate,
    measure,
    redis_script_sha,
)

NAME = "journal"
FULL_CONNS = (1, 10, 50)
QUICK_CONNS = (1, 4)
FULL_PIPELINED_CONNS = 10
QUICK_PIPELINED_CONNS = 4
ROUND_TRIP, PIPELINED = "round trip", "pipelined"
GOAL_RATIO = 1.20
"""The journal at its default fsync may cost at most this much server CPU per pair."""
STATS_TIMEOUT_S = 10.0

OFF = "journal off"
REDIS = "redis"
REDIS_AOF = "redis AOF everysec"
DEFAULT_FSYNC = "everysec"


@dataclass(frozen=True)
class Target:
    """One server of the run: dflockd at one journal setting, or Redis with or without AOF."""

    name: str
    redis: bool
    fsync: str | None
    """dflockd's ``--journal-fsync`` (None: journal off); Redis's ``appendfsync`` (None: no
    AOF)."""

    @property
    def short(self) -> str:
        """The name in ratio columns."""
        if self.redis:
            return "redis AOF" if self.fsync else "redis"
        return self.fsync or "off"


TARGETS = (
    Target(OFF, redis=False, fsync=None),
    Target("journal no", redis=False, fsync="no"),
    Target("journal everysec", redis=False, fsync="everysec"),
    Target("journal always", redis=False, fsync="always"),
    Target(REDIS, redis=True, fsync=None),
    Target(REDIS_AOF, redis=True, fsync="everysec"),
)
JOURNALS = tuple(t for t in TARGETS if not t.redis and t.fsync)
BY_NAME = {t.name: t for t in TARGETS}


def start(target: Target, loop: str, tmp: Path, maxclients: int) -> ServerProcess:
    if target.redis:
        return start_redis(tmp, maxclients=maxclients, appendfsync=target.fsync)
    return start_dflockd(
        loop,
        tmp,
        "--max-locks",
        str(MAX_LOCKS),
        "--max-locks-per-connection",
        "0",  # a pipelined connection holds --pipeline keys at once
        journal=target.fsync is not None,
        journal_fsync=target.fsync,
    )


# ------------------------------------------------------------------------------ what was written
def dflockd_stats(server: ServerProcess) -> dict[str, Any]:
    """The server's ``stats`` JSON."""
    with socket.create_connection((server.host, server.port), timeout=STATS_TIMEOUT_S) as sock:
        sock.sendall(STATS)
        buf = b""
        while not buf.endswith(b"\n"):
            data = sock.recv(1 << 16)
            if not data:
                raise ConnectionError("dflockd closed the connection before its stats reply")
            buf += data
    if not buf.startswith(b"ok "):
        raise RuntimeError(f"stats failed: {buf[:80]!r}")
    return json.loads(buf[3:])


def redis_persistence(server: ServerProcess) -> dict[str, Any]:
    """``INFO persistence`` of a Redis."""
    import redis

    client = redis.Redis(host=server.host, port=server.port)
    try:
        return dict(client.info("persistence"))
    finally:
        client.close()


def dir_bytes(path: Path | None) -> int:
    """Bytes of the files under ``path`` (-1: none)."""
    if path is None:
        return -1
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@dataclass
class Written:
    """What one server wrote over the run (read at its end)."""

    target: str
    fsync: str
    pairs: int
    """Pairs served, warm-up included."""
    writes: int
    """dflockd: journal writes (one per batch of replies); -1 for Redis."""
    fsyncs: int
    """dflockd: journal fsyncs; -1 for Redis (it does not count them)."""
    compactions: int
    """dflockd: journal compactions; Redis: AOF rewrites (-1: not reported)."""
    file_bytes: int
    """dflockd: the journal file at the end; Redis: its AOF directory (-1: none)."""
    disk_bytes: int
    """``write_bytes`` of ``/proc/<pid>/io`` over the run (-1: not accounted)."""
    ended_threads_cpu_ns: int
    """CPU of threads that ended during the rounds (not in the per-pair figures), 10 ms
    resolution."""
    children_cpu_ns: int
    """CPU of forked children (Redis's AOF rewrites; not in the per-pair figures)."""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class Before:
    """Readings of one server after the warm-up."""

    disk_bytes: int
    stat_cpu_ns: int
    live_cpu_ns: int


def before(server: ServerProcess) -> Before:
    return Before(written_bytes(server.pid), stat_cpu_ns(server.pid), server.cpu_ns())


def written(target: Target, server: ServerProcess, start: Before, pairs: int) -> Written:
    """Read what ``server`` wrote; raises when a durable server wrote nothing, or runs with
    another setting than asked."""
    ended = (stat_cpu_ns(server.pid) - start.stat_cpu_ns) - (server.cpu_ns() - start.live_cpu_ns)
    disk = written_bytes(server.pid)
    disk = disk - start.disk_bytes if disk >= 0 and start.disk_bytes >= 0 else -1
    children = children_cpu_ns(server.pid)
    if target.redis:
        info = redis_persistence(server)
        aof = int(info.get("aof_enabled", 0)) == 1
        if aof != (target.fsync is not None):
            raise RuntimeError(f"{target.name}: aof_enabled is {info.get('aof_enabled')}")
        files = dir_bytes(server.state_dir)
        if aof and files <= 0:
            raise RuntimeError(f"{target.name}: no append-only file in {server.state_dir}")
        return Written(
            target.name,
            target.fsync or "",
            pairs,
            -1,
            -1,
            int(info.get("aof_rewrites", -1)) if aof else -1,
            files,
            disk,
            ended,
            children,
        )
    journal = dflockd_stats(server).get("journal")
    if target.fsync is None:
        if journal is not None:
            raise RuntimeError(f"{target.name}: the server keeps a journal: {journal}")
        return Written(target.name, "", pairs, -1, -1, -1, -1, disk, ended, children)
    if journal is None or journal.get("fsync") != target.fsync:
        raise RuntimeError(f"{target.name}: the server's journal is {journal}")
    if int(journal["writes"]) <= 0:
        raise RuntimeError(f"{target.name}: the journal wrote nothing")
    assert server.state_dir is not None
    return Written(
        target.name,
        target.fsync,
        pairs,
        int(journal["writes"]),
        int(journal["fsyncs"]),
        int(journal.get("compactions", -1)),
        (server.state_dir / "journal").stat().st_size,
        disk,
        ended,
        children,
    )


# ------------------------------------------------------------------------------ main
def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser(NAME, __doc__.split("\n", 1)[0] if __doc__ else NAME)
    parser.add_argument(
        "--conns", default="", help="round-trip connection counts, comma separated (1,10,50)"
    )
    parser.add_argument(
        "--pipelined-conns", type=int, default=0, help="connections of the pipelined load (10)"
    )
    parser.add_argument("--duration", type=float, default=0.0, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=0, help="rounds (the median is reported)")
    parser.add_argument("--pipeline", type=int, default=16, help="pairs per pipelined batch")
    parser.add_argument(
        "--processes",
        type=int,
        default=max(1, os.cpu_count() or 1),
        help="load generator processes (default: one per core)",
    )
    parser.add_argument(
        "--loop", default=available_loops()[-1], help="dflockd's event loop (uvloop if installed)"
    )
    parser.add_argument(
        "--renewals",
        action="store_true",
        help="measure what recording every renewal costs (journal_renewals.json)",
    )
    args = parser.parse_args(argv)
    if args.renewals:
        return renewals_main(args, list(sys.argv[1:] if argv is None else argv))
    quick = bool(args.quick)
    conns_levels: list[int] = (
        [int(x) for x in args.conns.split(",")]
        if args.conns
        else list(QUICK_CONNS if quick else FULL_CONNS)
    )
    pipelined_conns = args.pipelined_conns or (
        QUICK_PIPELINED_CONNS if quick else FULL_PIPELINED_CONNS
    )
    loads = [(ROUND_TRIP, n) for n in conns_levels] + [(PIPELINED, pipelined_conns)]
    duration = args.duration or (0.25 if quick else 1.5)
    rounds = args.rounds or (1 if quick else 5)
    run = BenchRun(
        NAME,
        args,
        list(sys.argv[1:] if argv is None else argv),
        params={
            "loads": [f"{mode} {conns}" for mode, conns in loads],
            "duration_s": duration,
            "rounds": rounds,
            "pipeline": args.pipeline,
            "generator_processes": args.processes,
            "loop": args.loop,
            "targets": {
                t.name: (
                    f"redis-server --appendonly yes --appendfsync {t.fsync}"
                    if t.redis and t.fsync
                    else "redis-server --appendonly no"
                    if t.redis
                    else f"dflockd --state-dir DIR --journal-fsync {t.fsync}"
                    if t.fsync
                    else "dflockd --state-dir none"
                )
                for t in TARGETS
            },
        },
    )
    names = [t.name for t in TARGETS]
    maxclients = max(n for _, n in loads) + 100
    runs: dict[Cell, list[Measurement]] = {}
    pairs: dict[str, int] = dict.fromkeys(names, 0)
    with workdir("dflock-bench-journal-") as tmp, owned_servers() as servers:
        by_name: dict[str, ServerProcess] = {}
        for target in TARGETS:
            by_name[target.name] = start(target, args.loop, tmp, maxclients)
            servers.append(by_name[target.name])
        sha = redis_script_sha(by_name[REDIS])
        if redis_script_sha(by_name[REDIS_AOF]) != sha:
            raise RuntimeError("the two Redis servers disagree on the release script's sha")

        def run_one(name: str, mode: str, conns: int, seconds: float) -> Measurement:
            m = measure(
                by_name[name],
                mode,
                conns,
                pipeline=args.pipeline,
                duration_s=seconds,
                processes=args.processes,
                sha=sha,
            )
            pairs[name] += m.pairs
            return m

        for name in names:  # warm up: first connections, first keys, the files' first pages
            run_one(name, ROUND_TRIP, 1, WARMUP_S)
        start_readings = {name: before(by_name[name]) for name in names}
        turn = 0
        total = rounds * len(loads)
        for round_no in range(rounds):
            for mode, conns in loads:
                order = names[turn % len(names) :] + names[: turn % len(names)]
                turn += 1
                line: list[str] = []
                for name in order:
                    m = run_one(name, mode, conns, duration)
                    runs.setdefault(Cell(name, mode, conns), []).append(m)
                    line.append(f"{name} {m.pairs_per_s:,.0f}/s {m.server_cpu_us_per_pair:.1f}us")
                print(
                    f"[{turn}/{total}] round {round_no + 1} {mode} {conns} conn(s): "
                    + "; ".join(line),
                    flush=True,
                )
        wrote = [
            written(t, by_name[t.name], start_readings[t.name], pairs[t.name]) for t in TARGETS
        ]

    aggs = {cell: aggregate(cell, ms) for cell, ms in runs.items()}
    report(run, aggs=aggs, loads=loads, wrote=wrote)
    run.write()
    errors = sum(a.errors for a in aggs.values())
    if errors:
        print(f"{errors} request(s) failed", file=sys.stderr)
        return 1
    return 0


def _size(value: int) -> str:
    if value < 0:
        return "n/a"
    if value >= 1 << 20:
        return f"{value / (1 << 20):,.1f} MiB"
    if value >= 1 << 10:
        return f"{value / (1 << 10):,.1f} KiB"
    return f"{value} B"


def _count(value: int) -> str:
    return "n/a" if value < 0 else f"{value:,}"


def report(
    run: BenchRun,
    *,
    aggs: dict[Cell, Aggregate],
    loads: list[tuple[str, int]],
    wrote: list[Written],
) -> None:
    p = run.params
    names = [t.name for t in TARGETS]
    off, aof, plain = BY_NAME[OFF], BY_NAME[REDIS_AOF], BY_NAME[REDIS]
    measured = (
        f"median of {p['rounds']} round(s) of {p['duration_s']} s per load and server, the "
        f"servers in turn (the order rotating); pipelined = batches of {p['pipeline']} "
        f"acquires, then their releases, per connection; dflockd on {p['loop']}"
    )

    def values(title: str, metric: Callable[[Aggregate], float], digits: int) -> Table:
        table = Table(title, ["load", "conns", *names], notes=[measured])
        for mode, conns in loads:
            table.rows.append(
                [mode, str(conns)]
                + [fmt_num(metric(aggs[Cell(n, mode, conns)]), digits) for n in names]
            )
        return table

    pairs_of_ratios = [
        *((t, off) for t in JOURNALS),
        *((t, aof) for t in JOURNALS),
        (aof, plain),
    ]

    def ratios(title: str, metric: Callable[[Aggregate], float], note: str) -> Table:
        table = Table(
            title,
            ["load", "conns", *(f"{a.short} / {b.short}" for a, b in pairs_of_ratios)],
            notes=[note],
        )
        for mode, conns in loads:
            table.rows.append(
                [mode, str(conns)]
                + [
                    fmt_ratio(
                        ratio(
                            metric(aggs[Cell(a.name, mode, conns)]),
                            metric(aggs[Cell(b.name, mode, conns)]),
                        )
                    )
                    for a, b in pairs_of_ratios
                ]
            )
        return table

    run.add(
        values(
            "Server CPU per acquire+release pair (microseconds, the server process's own CPU time)",
            lambda a: a.cpu_us_per_pair,
            1,
        )
    )
    run.add(
        ratios(
            "Server CPU per pair, ratios: each journal setting to journal off and to Redis "
            "with AOF everysec",
            lambda a: a.cpu_us_per_pair,
            "above 1.00x costs more CPU per pair than the server it is compared with; "
            "`redis AOF / redis` is what Redis's own append-only file costs it",
        )
    )
    run.add(values("Throughput (acquire+release pairs per second)", lambda a: a.pairs_per_s, 0))
    run.add(
        ratios(
            "Throughput, ratios: each journal setting to journal off and to Redis with AOF "
            "everysec",
            lambda a: a.pairs_per_s,
            f"below 1.00x serves fewer pairs per second; {p['generator_processes']} load "
            f"generator process(es) on the same {os.cpu_count()} core(s) as the servers",
        )
    )
    busy = Table(
        "Server CPU (% of one core) while each load ran",
        ["load", "conns", *names],
        notes=["a server near 100% is the bottleneck; otherwise round trips or the generator are"],
    )
    for mode, conns in loads:
        busy.rows.append(
            [mode, str(conns)]
            + [fmt_num(aggs[Cell(n, mode, conns)].server_busy * 100, 0) for n in names]
        )
    run.add(busy)
    rt_conns = [conns for mode, conns in loads if mode == ROUND_TRIP]
    latency = Table(
        "Latency of one acquire+release pair, round trips (microseconds, p50 / p99)",
        ["server", *(f"{c} conn(s)" for c in rt_conns)],
        notes=[
            "from sending the acquire to reading the release's reply, as the generator sees "
            "it; `always` fsyncs before each reply"
        ],
    )
    for n in names:
        latency.rows.append(
            [n]
            + [
                f"{fmt_num(aggs[Cell(n, ROUND_TRIP, c)].p50_us)} / "
                f"{fmt_num(aggs[Cell(n, ROUND_TRIP, c)].p99_us)}"
                for c in rt_conns
            ]
        )
    run.add(latency)
    files = Table(
        "What each server wrote over the run (read at its end)",
        [
            "server",
            "pairs served",
            "journal writes",
            "writes / pair",
            "fsyncs",
            "compactions / AOF rewrites",
            "file at the end",
            "bytes to disk",
            "ended threads' CPU (ms)",
            "forked children's CPU (ms)",
        ],
        notes=[
            "dflockd: `writes`, `fsyncs`, `compactions` from its `stats` (the `journal` field), "
            "the size of `journal` in its state directory; Redis: `aof_rewrites` of `INFO "
            "persistence` and the size of its append-only directory (Redis does not count its "
            "fsyncs). Pairs and writes include the warm-up. Every lease is released by the "
            "end, so a journal compacted since holds its header alone (under 100 bytes).",
            "bytes to disk: `write_bytes` of /proc/<pid>/io from after the warm-up (the page "
            "cache the server dirtied; a compaction rewrites the live leases).",
            "ended threads: CPU of threads that ended during the rounds (dflockd's everysec "
            "fsync runs in a short-lived thread, Redis's in a thread that lives on), which the "
            "per-pair figures, read from the live threads, leave out (over the rounds: the "
            "difference of two readings at /proc's 10 ms resolution, so 0 to 20 ms is none); "
            "forked children: Redis's AOF rewrites.",
        ],
    )
    for w in wrote:
        files.rows.append(
            [
                w.target,
                f"{w.pairs:,}",
                _count(w.writes),
                "n/a" if w.writes < 0 or not w.pairs else f"{w.writes / w.pairs:.2f}",
                _count(w.fsyncs),
                _count(w.compactions),
                _size(w.file_bytes),
                _size(w.disk_bytes),
                fmt_num(max(0, w.ended_threads_cpu_ns) / 1e6, 0),
                fmt_num(w.children_cpu_ns / 1e6, 0),
            ]
        )
    run.add(files)

    # --------------------------------------------------------------------- goal
    default = BY_NAME[f"journal {DEFAULT_FSYNC}"]
    cpu = {
        load: ratio(
            aggs[Cell(default.name, *load)].cpu_us_per_pair,
            aggs[Cell(OFF, *load)].cpu_us_per_pair,
        )
        for load in loads
    }
    worst = max(cpu, key=lambda k: cpu[k])
    run.goals.append(
        Goal(
            goal=(
                f"journal at its default ({DEFAULT_FSYNC}) costs at most "
                f"{GOAL_RATIO - 1:.0%} server CPU per pair over journal off"
            ),
            measured=(
                f"{min(cpu.values()):.2f}x to {cpu[worst]:.2f}x of journal off's CPU per pair "
                f"({', '.join(f'{m} {c}: {cpu[(m, c)]:.2f}x' for m, c in loads)})"
            ),
            met=cpu[worst] <= GOAL_RATIO,
            detail=f"worst at {worst[1]} connection(s), {worst[0]}; dflockd on {p['loop']}",
        )
    )
    run.data["cells"] = [a.as_dict() for a in aggs.values()]
    run.data["written"] = [w.as_dict() for w in wrote]
    run.data["cpu_ratio_default_to_off"] = {f"{m} {c}": round(r, 3) for (m, c), r in cpu.items()}


# ------------------------------------------------------------------------------ renewals
RENEWALS_NAME = "journal_renewals"
RENEWALS_OFF = "journal off"
RENEWAL_LEASE_S = 30
RENEWAL_KEYS = 200
"""Locks each connection holds and renews in turn."""
RENEWAL_CONNS = (1, 10)
RENEWAL_TARGETS = (
    (RENEWALS_OFF, None),
    ("journal everysec", "everysec"),
    ("journal always", "always"),
)
"""Name, ``--journal-fsync`` (None: journal off)."""


def _renewer(address: tuple[str, int], key: str, stop: Any, counts: list[int], i: int) -> None:
    """Hold ``RENEWAL_KEYS`` keys and renew them in turn, in round trips, until ``stop`` is
    set. Many keys, so that each renewal moves its lease's end (the table's clock counts
    milliseconds on uvloop: a key renewed twice in one millisecond ends where it did)."""
    with socket.create_connection(address) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        buf = bytearray()
        requests: list[bytes] = []
        releases: list[bytes] = []
        for k in range(RENEWAL_KEYS):
            sock.sendall(lock(0, RENEWAL_LEASE_S, key=f"{key}:{k}"))
            token = read_line(sock, buf).split()[1].decode()
            requests.append(renew(f"{key}:{k}", token, RENEWAL_LEASE_S))
            releases.append(RELEASE % (f"{key}:{k}".encode(), token.encode()))
        done = 0
        while not stop.is_set():
            sock.sendall(requests[done % RENEWAL_KEYS])
            if not read_line(sock, buf).startswith(b"ok "):
                raise RuntimeError(f"a renewal on {key} was refused")
            done += 1
            counts[i] = done
        for release in releases:  # released: the next measurement starts from an empty table
            sock.sendall(release)
            read_line(sock, buf)


def _renewals(server: ServerProcess, conns: int, seconds: float, tag: str) -> tuple[int, int]:
    """Renewals done in ``seconds`` over ``conns`` connections, and the server's CPU (ns)."""
    stop = threading.Event()
    counts = [0] * conns
    threads = [
        threading.Thread(
            target=_renewer,
            args=((server.host, server.port), f"renew:{tag}:{i}", stop, counts, i),
        )
        for i in range(conns)
    ]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while not all(counts) and time.monotonic() < deadline:  # every connection holds its locks
        time.sleep(0.05)
    cpu0 = server.cpu_ns()
    base = sum(counts)
    time.sleep(seconds)
    cpu1 = server.cpu_ns()
    done = sum(counts)
    stop.set()
    for thread in threads:
        thread.join()
    return done - base, cpu1 - cpu0


def renewals_main(args: Any, argv: list[str]) -> int:
    """``--renewals``: the renewal records' A/B (see the module's doc)."""
    quick = bool(args.quick)
    conns_levels = [1, 2] if quick else list(RENEWAL_CONNS)
    duration = args.duration or (0.25 if quick else 2.0)
    rounds = args.rounds or (1 if quick else 5)
    names = [name for name, _ in RENEWAL_TARGETS]
    run = BenchRun(
        RENEWALS_NAME,
        args,
        argv,
        params={
            "conns": conns_levels,
            "duration_s": duration,
            "rounds": rounds,
            "lease_s": RENEWAL_LEASE_S,
            "loop": args.loop,
            "targets": names,
        },
    )
    per: dict[tuple[str, int], list[tuple[int, int]]] = {}
    journal_stats: dict[str, dict[str, Any]] = {}
    with workdir("dflock-bench-renewals-") as tmp, owned_servers() as servers:
        by_name: dict[str, ServerProcess] = {}
        for name, fsync in RENEWAL_TARGETS:
            server = start_dflockd(
                args.loop,
                tmp,
                "--max-locks",
                str(MAX_LOCKS),
                "--max-locks-per-connection",
                "0",
                journal=fsync is not None,
                journal_fsync=fsync,
            )
            by_name[name] = server
            servers.append(server)
        turn = 0
        for round_no in range(rounds):
            for conns in conns_levels:
                order = names[turn % len(names) :] + names[: turn % len(names)]
                turn += 1
                line: list[str] = []
                for name in order:
                    done, cpu = _renewals(by_name[name], conns, duration, f"{round_no}")
                    per.setdefault((name, conns), []).append((done, cpu))
                    line.append(f"{name} {done / duration:,.0f}/s {cpu / 1e3 / max(done, 1):.1f}us")
                print(f"round {round_no + 1}, {conns} conn(s): " + "; ".join(line), flush=True)
        for name, fsync in RENEWAL_TARGETS:
            if fsync is not None:
                journal_stats[name] = dflockd_stats(by_name[name])["journal"]

    def median(values: list[float]) -> float:
        ordered = sorted(values)
        mid = len(ordered) // 2
        return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2

    cpu_us = {
        cell: median([cpu / 1e3 / max(done, 1) for done, cpu in ms]) for cell, ms in per.items()
    }
    rate = {cell: median([done / duration for done, _ in ms]) for cell, ms in per.items()}
    table = Table(
        "Server CPU per renewal (microseconds), and renewals per second, median of the rounds",
        ["server", *(f"{c} conn(s) CPU/renewal" for c in conns_levels)]
        + [f"{c} conn(s) renewals/s" for c in conns_levels],
        notes=[
            "with the journal, every renewal writes a record, in the same group write as the "
            "grants; the servers taken in turn (the order rotates)",
        ],
    )
    for name in names:
        table.rows.append(
            [name]
            + [fmt_num(cpu_us[(name, c)]) for c in conns_levels]
            + [fmt_num(rate[(name, c)], 0) for c in conns_levels]
        )
    run.add(table)
    ratios_table = Table(
        "Journal / journal off: what recording every renewal costs",
        ["server", *(f"{c} conn(s) CPU/renewal" for c in conns_levels)]
        + [f"{c} conn(s) renewals/s" for c in conns_levels],
    )
    for b in names[1:]:
        a = RENEWALS_OFF
        ratios_table.rows.append(
            [b]
            + [fmt_ratio(ratio(cpu_us[(b, c)], cpu_us[(a, c)])) for c in conns_levels]
            + [fmt_ratio(ratio(rate[(b, c)], rate[(a, c)])) for c in conns_levels]
        )
    run.add(ratios_table)
    wrote = Table(
        "What each journal wrote (its stats at the end)",
        ["server", "writes", "fsyncs", "compactions"],
    )
    for name, st in journal_stats.items():
        wrote.rows.append(
            [name, _count(int(st["writes"])), _count(int(st["fsyncs"])), str(st["compactions"])]
        )
    run.add(wrote)
    run.data["cpu_us_per_renewal"] = {f"{n} {c}": round(v, 2) for (n, c), v in cpu_us.items()}
    run.data["renewals_per_s"] = {f"{n} {c}": round(v, 1) for (n, c), v in rate.items()}
    run.data["journal_stats"] = journal_stats
    run.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
