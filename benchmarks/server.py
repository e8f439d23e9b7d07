"""Lock server benchmark: dflockd (asyncio and uvloop) against Redis, alternating in one run.

    uv run python -m benchmarks.server            # full size (about 7 minutes on 2 cores)
    uv run python -m benchmarks.server --quick    # seconds, tiny sizes (the smoke test)

Starts the servers as child processes (``dflockd`` on asyncio's loop and on uvloop, each as
the pure-Python wheel installs it and from its compiled wheel, ``asyncio+mypyc`` and
``uvloop+mypyc``: the request path compiled by mypyc, see server/hatch_build.py, as ``pip
install`` and the container image run it; a private ``redis-server``), then for every
round, load shape and connection count drives each of them in turn (the order rotates) with
the same acquire+release pairs (see ``_loadgen``).
Server CPU time comes from the server process itself (``/proc/<pid>/task/*/schedstat``).

Load shapes: ``round trip`` (each connection waits for every reply before the next request:
what a lock user does; the latency figures come from it) and ``pipelined`` (batches of
``--pipeline`` acquires on distinct keys, then their releases: the generator costs little per
pair, so the server is what saturates). Then a single client through the client libraries
(``celery_dflock.DistributedLock`` with a pool against redis-py's ``Lock``).

Last, what this machine allows at all: Redis's own C client (``redis-benchmark``, shipped with
``redis-server``) sends the two requests of redis-py's pair one at a time on one connection to
the same private Redis. Redis spends a few microseconds of its own on each, so what they take
is almost all the machine's (the kernel, the wake-ups): the sum of the two p50s is about the least
any lock's single-client acquire+release can take here. The latency goals' verdicts name it.

``--dflockd-go PATH`` adds dflockd's Go server (a binary built from its repository) as one
more server in the same rotation, with the same loads and the same client, and a table of
ours against it. It has no lease journal, so each of our figures pays for durability and
its figures do not.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from benchmarks._common import (
    GO_SERVER,
    BenchRun,
    Goal,
    ServerProcess,
    Table,
    base_parser,
    default_loops,
    fmt_num,
    fmt_ratio,
    median,
    owned_servers,
    percentile,
    ratio,
    start_dflockd,
    start_dflockd_go,
    start_redis,
    workdir,
)
from benchmarks._loadgen import (
    LEASE_S,
    REDIS_RELEASE_SCRIPT,
    LoadSpec,
    Measurement,
    run_load,
    split_connections,
)

NAME = "server"
FULL_CONNS = (1, 10, 50, 200)
QUICK_CONNS = (1, 4)
LATENCY_CONNS = (1, 50)
"""Connection counts whose latency the issue asks for (every count is measured)."""
MODES = ("round trip", "pipelined")
REDIS = "redis"
CPU_GOAL_RATIO = 1.5
"""Issue 28: at most 1.5x Redis's server CPU per pair, on every load and both loops."""
LATENCY_GOAL_US = 100.0
"""Issue 28: single-client p50 at the wire."""
CLIENT_LATENCY_GOAL_US = 130.0
"""Issue 28: single-client p50 through `DistributedLock` (the wire's 100 us plus the client)."""
CLIENT_KEYS = 16
FLOOR_REQUESTS = 20_000
"""Requests per command and repetition of the machine's floor (``redis-benchmark -n``)."""
FLOOR_REPEATS = 3
"""Repetitions of the floor; the median p50 of each command is taken."""
FLOOR_KEYSPACE = 1_000_000
"""Random keys the floor's requests pick from (``redis-benchmark -r``)."""
MAX_LOCKS = 1_000_000
WARMUP_S = 0.2


def target_names(loops: Sequence[str], go: bool = False) -> list[str]:
    """Ours on each loop, dflockd's Go server when ``go``, then Redis."""
    return [f"dflockd ({loop})" for loop in loops] + ([GO_SERVER] if go else []) + [REDIS]


@dataclass(frozen=True)
class Cell:
    target: str
    mode: str
    conns: int


@dataclass
class Aggregate:
    """The rounds of one cell: medians of the rates, latencies pooled."""

    cell: Cell
    pairs_per_s: float
    cpu_us_per_pair: float
    server_busy: float
    generator_cpu_us_per_pair: float
    p50_us: float
    p99_us: float
    pairs: int
    errors: int

    def as_dict(self) -> dict[str, Any]:
        return {
            "target": self.cell.target,
            "mode": self.cell.mode,
            "conns": self.cell.conns,
            "pairs_per_s": round(self.pairs_per_s, 1),
            "cpu_us_per_pair": round(self.cpu_us_per_pair, 2),
            "server_busy": round(self.server_busy, 3),
            "generator_cpu_us_per_pair": round(self.generator_cpu_us_per_pair, 2),
            "p50_us": round(self.p50_us, 1),
            "p99_us": round(self.p99_us, 1),
            "pairs": self.pairs,
            "errors": self.errors,
        }


def redis_script_sha(server: ServerProcess) -> str:
    import redis

    client = redis.Redis(host=server.host, port=server.port)
    try:
        return str(client.script_load(REDIS_RELEASE_SCRIPT))
    finally:
        client.close()


def measure(
    server: ServerProcess,
    mode: str,
    conns: int,
    *,
    pipeline: int,
    duration_s: float,
    processes: int,
    sha: str,
) -> Measurement:
    protocol = "redis" if server.label == REDIS else "dflockd"
    depth = 1 if mode == "round trip" else pipeline
    specs = [
        LoadSpec(
            protocol=protocol,
            host=server.host,
            port=server.port,
            conns=n,
            pipeline=depth,
            duration_s=duration_s,
            key_prefix=f"dflock-bench:p{index}",
            script_sha=sha,
            record_latency=depth == 1,
        )
        for index, n in enumerate(split_connections(conns, processes))
    ]
    return run_load(specs, server.cpu_ns)


def aggregate(cell: Cell, runs: list[Measurement]) -> Aggregate:
    latencies = sorted(itertools.chain.from_iterable(m.latencies_ns for m in runs))
    return Aggregate(
        cell=cell,
        pairs_per_s=median([m.pairs_per_s for m in runs]),
        cpu_us_per_pair=median([m.server_cpu_us_per_pair for m in runs]),
        server_busy=median([m.server_busy for m in runs]),
        generator_cpu_us_per_pair=median([m.generator_cpu_us_per_pair for m in runs]),
        p50_us=percentile(latencies, 50) / 1000,
        p99_us=percentile(latencies, 99) / 1000,
        pairs=sum(m.pairs for m in runs),
        errors=sum(m.errors for m in runs),
    )


# ------------------------------------------------------------------------------ client libraries
def dflock_client_latencies(server: ServerProcess, iterations: int) -> list[int]:
    """``DistributedLock(key, 0, pool=...)`` acquire + release, as LockedTask does per run."""
    from celery_dflock import ConnectionPool, DistributedLock

    out: list[int] = []
    with ConnectionPool() as pool:
        for i in range(iterations):
            t0 = time.monotonic_ns()
            lock = DistributedLock(
                f"dflock-bench:client:{i % CLIENT_KEYS}",
                0,
                servers=[(server.host, server.port)],
                pool=pool,
            )
            if not lock.acquire():
                raise RuntimeError("DistributedLock was refused a free key")
            lock.release()
            out.append(time.monotonic_ns() - t0)
    return out


def redis_client_latencies(server: ServerProcess, iterations: int) -> list[int]:
    """redis-py ``Lock`` acquire (non-blocking) + release."""
    import redis

    client = redis.Redis(host=server.host, port=server.port)
    out: list[int] = []
    try:
        for i in range(iterations):
            t0 = time.monotonic_ns()
            lock = client.lock(f"dflock-bench:client:{i % CLIENT_KEYS}", timeout=33)
            if not lock.acquire(blocking=False):
                raise RuntimeError("redis-py Lock was refused a free key")
            lock.release()
            out.append(time.monotonic_ns() - t0)
    finally:
        client.close()
    return out


@dataclass(frozen=True)
class Floor:
    """One request at a time on one connection, ``redis-benchmark`` (C) against Redis (C)."""

    p50_us: dict[str, float]
    """Each of redis-py's two requests: the median over the repetitions of its p50."""
    p99_us: dict[str, float]
    requests: int

    @property
    def pair_p50_us(self) -> float:
        return sum(self.p50_us.values())


def floor_commands(sha: str) -> dict[str, list[str]]:
    """redis-py ``Lock``'s acquire and release (``_loadgen``'s pair), on fresh random keys."""
    key = "dflock-bench:floor:__rand_int__"
    return {
        "SET NX PX": ["SET", key, "token", "NX", "PX", str(LEASE_S * 1000)],
        "EVALSHA": ["EVALSHA", sha, "1", key, "token"],
    }


def parse_redis_benchmark_csv(text: str) -> tuple[float, float]:
    """p50 and p99 in microseconds from ``redis-benchmark --csv``'s output (one test)."""
    rows = [line for line in text.splitlines() if line.startswith('"')]
    if len(rows) != 2:
        raise RuntimeError(f"redis-benchmark --csv printed no result:\n{text.strip()}")
    header = [h.strip('"') for h in rows[0].split(",")]
    values = [v.strip('"') for v in rows[1].rsplit(",", len(header) - 1)]
    row = dict(zip(header, values, strict=True))
    return float(row["p50_latency_ms"]) * 1000, float(row["p99_latency_ms"]) * 1000


def machine_floor(server: ServerProcess, sha: str, requests: int, repeats: int) -> Floor | None:
    """Redis's own C client against the benchmark's Redis; None without ``redis-benchmark``."""
    binary = shutil.which("redis-benchmark")
    if binary is None:
        return None
    p50s: dict[str, list[float]] = {}
    p99s: dict[str, list[float]] = {}
    where = ["-h", server.host, "-p", str(server.port)]
    one_at_a_time = ["-c", "1", "-n", str(requests), "-r", str(FLOOR_KEYSPACE), "--csv"]
    for _ in range(repeats):
        for name, command in floor_commands(sha).items():
            done = subprocess.run(
                [binary, *where, *one_at_a_time, *command],
                capture_output=True,
                text=True,
                timeout=300,
                check=True,
            )
            p50, p99 = parse_redis_benchmark_csv(done.stdout)
            p50s.setdefault(name, []).append(p50)
            p99s.setdefault(name, []).append(p99)
    return Floor(
        p50_us={name: median(v) for name, v in p50s.items()},
        p99_us={name: median(v) for name, v in p99s.items()},
        requests=requests,
    )


# ------------------------------------------------------------------------------ main
def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser(NAME, __doc__.split("\n", 1)[0] if __doc__ else NAME)
    parser.add_argument(
        "--conns", default="", help="connection counts, comma separated (default 1,10,50,200)"
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
        "--client-iterations",
        type=int,
        default=0,
        help="acquire+release pairs through the client libraries",
    )
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
        "--dflockd-go",
        default="",
        metavar="PATH",
        help="dflockd's Go server binary, measured beside ours (built from its repository: "
        "go build ./cmd/dflockd)",
    )
    args = parser.parse_args(argv)
    quick = bool(args.quick)
    conns_levels: list[int] = (
        [int(x) for x in args.conns.split(",")]
        if args.conns
        else list(QUICK_CONNS if quick else FULL_CONNS)
    )
    duration = args.duration or (0.25 if quick else 1.5)
    rounds = args.rounds or (1 if quick else 5)
    client_iterations = args.client_iterations or (50 if quick else 3000)
    loops = [x for x in args.loops.split(",") if x] or default_loops(quick)
    run = BenchRun(
        NAME,
        args,
        list(sys.argv[1:] if argv is None else argv),
        params={
            "conns": conns_levels,
            "duration_s": duration,
            "rounds": rounds,
            "pipeline": args.pipeline,
            "generator_processes": args.processes,
            "client_iterations": client_iterations,
            "loops": loops,
            "lease_s": 33,
            **({"dflockd_go": go_version(args.dflockd_go)} if args.dflockd_go else {}),
        },
    )
    targets = target_names(loops, go=bool(args.dflockd_go))
    with workdir("dflock-bench-server-") as tmp, owned_servers() as servers:
        by_name: dict[str, ServerProcess] = {}
        for loop in loops:
            by_name[f"dflockd ({loop})"] = start_dflockd(
                loop, tmp, "--max-locks", str(MAX_LOCKS), "--max-locks-per-connection", "0"
            )
        if args.dflockd_go:
            by_name[GO_SERVER] = start_dflockd_go(args.dflockd_go, tmp, max_locks=MAX_LOCKS)
        by_name[REDIS] = start_redis(tmp, maxclients=max(conns_levels) + 100)
        servers.extend(by_name.values())
        sha = redis_script_sha(by_name[REDIS])
        for target in targets:  # warm up: first connections, first keys, caches
            measure(
                by_name[target],
                "round trip",
                1,
                pipeline=args.pipeline,
                duration_s=WARMUP_S,
                processes=1,
                sha=sha,
            )
        runs: dict[Cell, list[Measurement]] = {}
        turn = 0
        total = rounds * len(MODES) * len(conns_levels)
        for round_no in range(rounds):
            for mode in MODES:
                for conns in conns_levels:
                    order = targets[turn % len(targets) :] + targets[: turn % len(targets)]
                    turn += 1
                    line: list[str] = []
                    for target in order:
                        m = measure(
                            by_name[target],
                            mode,
                            conns,
                            pipeline=args.pipeline,
                            duration_s=duration,
                            processes=args.processes,
                            sha=sha,
                        )
                        runs.setdefault(Cell(target, mode, conns), []).append(m)
                        line.append(
                            f"{target} {m.pairs_per_s:,.0f}/s {m.server_cpu_us_per_pair:.1f}us/pair"
                        )
                    print(
                        f"[{turn}/{total}] round {round_no + 1} {mode} {conns} conn(s): "
                        + "; ".join(line),
                        flush=True,
                    )
        client: dict[str, list[int]] = {}
        for name in targets:
            if name != REDIS:
                client[name] = sorted(dflock_client_latencies(by_name[name], client_iterations))
        client[REDIS] = sorted(redis_client_latencies(by_name[REDIS], client_iterations))
        floor = machine_floor(
            by_name[REDIS],
            sha,
            requests=500 if quick else FLOOR_REQUESTS,
            repeats=1 if quick else FLOOR_REPEATS,
        )

    aggs = {cell: aggregate(cell, ms) for cell, ms in runs.items()}
    report(
        run,
        aggs=aggs,
        client=client,
        floor=floor,
        targets=targets,
        loops=loops,
        conns_levels=conns_levels,
    )
    run.write()
    errors = sum(a.errors for a in aggs.values())
    if errors:
        print(f"{errors} request(s) failed", file=sys.stderr)
        return 1
    return 0


def report(
    run: BenchRun,
    *,
    aggs: dict[Cell, Aggregate],
    client: dict[str, list[int]],
    floor: Floor | None,
    targets: list[str],
    loops: list[str],
    conns_levels: list[int],
) -> None:
    ours = [f"dflockd ({loop})" for loop in loops]
    dflockds = [t for t in targets if t != REDIS]  # ours, and the Go server when measured
    short = {t: t.replace("dflockd (", "").rstrip(")") for t in dflockds}

    def per_target(
        title: str, metric: Callable[[Aggregate], float], digits: int, notes: list[str]
    ) -> Table:
        columns = ["load", "conns", *targets, *(f"{short[t]} / redis" for t in dflockds)]
        table = Table(title, columns, notes=notes)
        for mode in MODES:
            for conns in conns_levels:
                values = {t: metric(aggs[Cell(t, mode, conns)]) for t in targets}
                table.rows.append(
                    [
                        mode,
                        str(conns),
                        *(fmt_num(values[t], digits) for t in targets),
                        *(fmt_ratio(ratio(values[t], values[REDIS])) for t in dflockds),
                    ]
                )
        return table

    p = run.params
    run.add(
        per_target(
            "Server CPU per acquire+release pair (microseconds, the server process's own CPU time)",
            lambda a: a.cpu_us_per_pair,
            1,
            [
                f"median of {p['rounds']} round(s) of {p['duration_s']} s; pipelined = batches "
                f"of {p['pipeline']} acquires, then their releases, per connection",
            ],
        )
    )
    run.add(
        per_target(
            "Throughput (acquire+release pairs per second)",
            lambda a: a.pairs_per_s,
            0,
            [
                f"{p['generator_processes']} load generator process(es) on the same "
                f"{os.cpu_count()} core(s) as the server",
            ],
        )
    )
    busy = Table(
        "Who was busy: server CPU (% of one core) and load generator CPU per pair (us)",
        ["load", "conns", *(f"{t} server %" for t in targets), *(f"{t} gen us" for t in targets)],
        notes=[
            "a server near 100% is the bottleneck; otherwise round trips or the generator are",
        ],
    )
    for mode in MODES:
        for conns in conns_levels:
            row = [aggs[Cell(t, mode, conns)] for t in targets]
            busy.rows.append(
                [
                    mode,
                    str(conns),
                    *(fmt_num(a.server_busy * 100, 0) for a in row),
                    *(fmt_num(a.generator_cpu_us_per_pair, 1) for a in row),
                ]
            )
    run.add(busy)
    latency = Table(
        "Latency of one acquire+release pair, round trips (microseconds)",
        [
            "conns",
            *(f"{t} p50" for t in targets),
            *(f"{t} p99" for t in targets),
            *(f"{short[t]} / redis p50" for t in dflockds),
        ],
        notes=[
            "from sending the acquire to reading the release's reply, as the generator sees it "
            f"(the issue asks for {', '.join(map(str, LATENCY_CONNS))} connections)",
        ],
    )
    for conns in conns_levels:
        row = {t: aggs[Cell(t, "round trip", conns)] for t in targets}
        latency.rows.append(
            [
                str(conns),
                *(fmt_num(row[t].p50_us) for t in targets),
                *(fmt_num(row[t].p99_us) for t in targets),
                *(fmt_ratio(ratio(row[t].p50_us, row[REDIS].p50_us)) for t in dflockds),
            ]
        )
    run.add(latency)
    client_stats = {
        name: (percentile(lat, 50) / 1000, percentile(lat, 99) / 1000)
        for name, lat in client.items()
    }
    client_table = Table(
        "One client through the client libraries: acquire+release (microseconds)",
        ["server", "client", "p50", "p99", "p50 / redis-py"],
        notes=[
            f"{p['client_iterations']} pairs each; DistributedLock(key, 0, pool=ConnectionPool()) "
            "schedules its renewal on the pool's renewal thread, as LockedTask does per run",
        ],
    )
    for name, (p50, p99) in client_stats.items():
        lib = "redis-py Lock" if name == REDIS else "celery_dflock.DistributedLock"
        client_table.rows.append(
            [
                name,
                lib,
                fmt_num(p50),
                fmt_num(p99),
                fmt_ratio(ratio(p50, client_stats[REDIS][0])),
            ]
        )
    run.add(client_table)
    if GO_SERVER in targets:
        run.add(against_go(aggs, client_stats, ours, short, conns_levels))
    if floor is None:
        floor_note = "this machine's floor not measured (no redis-benchmark on PATH)"
    else:
        floor_table = Table(
            "What this machine allows: one request at a time on one connection, Redis's own C "
            "client against Redis (microseconds)",
            ["request", "p50", "p99"],
            notes=[
                f"redis-benchmark -c 1 -n {floor.requests:,} -r {FLOOR_KEYSPACE}, the median "
                "of each figure over the repetitions, on random keys, against the benchmark's "
                "Redis; the sum of the p50s is about the least a single client's "
                "acquire+release can take on this machine",
            ],
        )
        for name, p50 in floor.p50_us.items():
            floor_table.rows.append([name, fmt_num(p50), fmt_num(floor.p99_us[name])])
        floor_table.rows.append(["pair (the sum of the p50s)", fmt_num(floor.pair_p50_us), ""])
        run.add(floor_table)
        floor_note = (
            f"this machine's floor: {floor.pair_p50_us:.1f} us, two round trips of Redis's own "
            "C client against Redis"
        )

    # --------------------------------------------------------------------- goals
    for loop, target in zip(loops, ours, strict=True):
        ratios = {
            (mode, conns): ratio(
                aggs[Cell(target, mode, conns)].cpu_us_per_pair,
                aggs[Cell(REDIS, mode, conns)].cpu_us_per_pair,
            )
            for mode in MODES
            for conns in conns_levels
        }
        worst_key = max(ratios, key=lambda k: ratios[k])
        single = ratios[("round trip", 1)] if ("round trip", 1) in ratios else float("nan")
        run.goals.append(
            Goal(
                goal=f"server CPU per pair within {CPU_GOAL_RATIO:g}x of Redis ({loop})",
                measured=(
                    f"{min(ratios.values()):.2f}x to {ratios[worst_key]:.2f}x of Redis "
                    f"(1 connection, round trips: {single:.2f}x)"
                ),
                met=ratios[worst_key] <= CPU_GOAL_RATIO,
                detail=f"worst at {worst_key[1]} connection(s), {worst_key[0]}",
            )
        )
    for loop, target in zip(loops, ours, strict=True):
        if 1 not in conns_levels:
            continue
        a = aggs[Cell(target, "round trip", 1)]
        run.goals.append(
            Goal(
                goal=(
                    f"single-client acquire+release p50 under {LATENCY_GOAL_US:g} us "
                    f"({loop}, wire level)"
                ),
                measured=f"p50 {a.p50_us:.1f} us, p99 {a.p99_us:.1f} us",
                met=a.p50_us < LATENCY_GOAL_US,
                detail=f"minimal client (the load generator), one connection; {floor_note}",
            )
        )
    for target in ours:
        p50, p99 = client_stats[target]
        run.goals.append(
            Goal(
                goal=(
                    f"single-client acquire+release p50 under {CLIENT_LATENCY_GOAL_US:g} us "
                    f"({short[target]}, through DistributedLock)"
                ),
                measured=f"p50 {p50:.1f} us, p99 {p99:.1f} us",
                met=p50 < CLIENT_LATENCY_GOAL_US,
                detail=f"celery_dflock.DistributedLock with a ConnectionPool; {floor_note}",
            )
        )
    run.data["cells"] = [a.as_dict() for a in aggs.values()]
    run.data["floor"] = (
        None
        if floor is None
        else {
            "p50_us": {k: round(v, 1) for k, v in floor.p50_us.items()},
            "p99_us": {k: round(v, 1) for k, v in floor.p99_us.items()},
            "pair_p50_us": round(floor.pair_p50_us, 1),
            "requests": floor.requests,
        }
    )
    run.data["client"] = {
        name: {"p50_us": round(v[0], 1), "p99_us": round(v[1], 1)}
        for name, v in client_stats.items()
    }


def go_version(binary: str) -> str:
    """What ``binary --version`` prints (the Go server's release), or the path when it says
    nothing."""
    try:
        done = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
        )
    except OSError as exc:
        raise SystemExit(f"--dflockd-go: cannot run {binary}: {exc}") from None
    said = (done.stdout or done.stderr).strip()
    return said.splitlines()[0] if said else binary


def against_go(
    aggs: dict[Cell, Aggregate],
    client_stats: dict[str, tuple[float, float]],
    ours: list[str],
    short: dict[str, str],
    conns_levels: list[int],
) -> Table:
    """Ours on each loop against dflockd's Go server: CPU per pair and throughput (lower CPU
    and higher throughput than Go read below and above 1.00x), and the client's p50."""
    table = Table(
        f"Against {GO_SERVER}: ours / Go, per loop (CPU per pair: below 1.00x is cheaper; "
        "throughput: above 1.00x serves more)",
        [
            "load",
            "conns",
            *(f"{short[t]} CPU / Go" for t in ours),
            *(f"{short[t]} pairs/s / Go" for t in ours),
        ],
        notes=[
            f"{GO_SERVER} keeps no lease journal; ours run with it on (everysec), as shipped; "
            "the last row: p50 through celery_dflock.DistributedLock, ours / Go",
        ],
    )
    for mode in MODES:
        for conns in conns_levels:
            go = aggs[Cell(GO_SERVER, mode, conns)]
            row = [aggs[Cell(t, mode, conns)] for t in ours]
            table.rows.append(
                [
                    mode,
                    str(conns),
                    *(fmt_ratio(ratio(a.cpu_us_per_pair, go.cpu_us_per_pair)) for a in row),
                    *(fmt_ratio(ratio(a.pairs_per_s, go.pairs_per_s)) for a in row),
                ]
            )
    go_p50 = client_stats[GO_SERVER][0]
    table.rows.append(
        [
            "client p50",
            "1",
            *(fmt_ratio(ratio(client_stats[t][0], go_p50)) for t in ours),
            *("-" for _ in ours),
        ]
    )
    return table


if __name__ == "__main__":
    raise SystemExit(main())
