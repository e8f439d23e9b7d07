"""Round trips measured by dflockd Go's own bench tool, against its Go server and ours.

    uv run python -m benchmarks.gobench --dflockd-go PATH --go-bench PATH
    uv run python -m benchmarks.gobench --dflockd-go PATH --go-bench PATH --quick

dflockd's Go rewrite ships a load tool, ``cmd/bench``: N workers, each on its own persistent
connection and its own key, acquire and release in turn and the tool prints the pairs per
second of the whole run. Issue 52 judges our server by that tool, not by our own load
generator: the figure a user of the Go server would compare. Neither binary is ours: build
both from dflockd's repository (``go build ./cmd/dflockd`` and ``go build ./cmd/bench``) and
hand them in; nothing of that repository is kept here.

For each worker count (10 and 100) and round, both servers are driven in turn (the order
alternates) with the same command, ``bench --workers W --rounds R --servers HOST:PORT``, R
chosen so that each run makes the same number of pairs. Ours runs as the default install
runs it (the compiled wheel on uvloop, ``uvloop+mypyc``; ``--builds`` adds others), its lease
journal on at the default fsync; the Go server keeps nothing on disk. The medians of the
rounds are reported, with the ratio ours / Go's.

The same rounds run twice: first as issue 52 names them, every process free to use every CPU
(the bench tool shares the machine's cores with the server it drives); then **one core each**:
each server started again on one CPU (its affinity set before it starts, so the Go runtime
sees one CPU) and the bench tool on another. That is how the lock server runs in the shipped
manifests (``deploy/kubernetes/dflockd.yaml``: ``limits: cpu: "1"``), apart from the clients
that drive it, and it compares what each server does with one core, not how many cores it can
take from the clients. Skipped, and said so, on a machine with fewer than two CPUs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks._common import (
    GO_SERVER,
    BenchRun,
    Goal,
    ServerProcess,
    Table,
    base_parser,
    children_cpu_ns,
    fmt_num,
    fmt_ratio,
    median,
    on_cpu,
    owned_servers,
    ratio,
    start_dflockd,
    start_dflockd_go,
    workdir,
)

NAME = "gobench"
WORKERS = (10, 100)
FULL_PAIRS, QUICK_PAIRS = 40_000, 2_000
"""Acquire+release pairs per run of the bench tool (split evenly over its workers)."""
FULL_ROUNDS, QUICK_ROUNDS = 5, 1
DEFAULT_BUILD = "uvloop+mypyc"
"""What ``pip install 'celery-dflock[server]'`` runs (issue 52)."""
MAX_LOCKS = 10_000
GOAL_RATIO = 1.0
ONE_CORE_EACH = "one core each"
"""What the tables and goal of the second pass are called (each server on one CPU, the bench
tool on another)."""
_THROUGHPUT = re.compile(r"throughput:\s*([0-9.]+) ops/s")
_P50 = re.compile(r"p50\s*:\s*([0-9.]+) ms")
_P99 = re.compile(r"p99\s*:\s*([0-9.]+) ms")


Figures = dict[str, dict[int, list[dict[str, float]]]]
"""Per server (its label), per worker count: each round's figures (``bench_once``)."""


def bench_once(
    tool: str, server: ServerProcess, workers: int, pairs: int, cpu: int | None = None
) -> dict[str, float]:
    """One run of the Go bench tool against ``server`` (the tool on the one CPU ``cpu``, if
    given): pairs/s, p50 and p99 (ms), and the server's CPU time per pair (all its threads)
    and the bench tool's."""
    rounds = max(1, pairs // workers)
    command = [tool, "--workers", str(workers), "--rounds", str(rounds)]
    command += ["--servers", f"{server.host}:{server.port}"]
    if cpu is not None:
        command = on_cpu(cpu, command)
    cpu0, tool0 = server.cpu_ns(), children_cpu_ns(os.getpid())  # (the tool, once reaped)
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    cpu_us = (server.cpu_ns() - cpu0) / 1000 / (rounds * workers)
    tool_us = (children_cpu_ns(os.getpid()) - tool0) / 1000 / (rounds * workers)
    found = _THROUGHPUT.search(done.stdout)
    if done.returncode != 0 or found is None:
        raise RuntimeError(
            f"{' '.join(command)} against {server.label} failed ({done.returncode}):\n"
            f"{done.stdout[-1500:]}{done.stderr[-1500:]}\n{server.log_tail()}"
        )
    p50, p99 = _P50.search(done.stdout), _P99.search(done.stdout)
    return {
        "pairs_per_s": float(found.group(1)),
        "p50_ms": float(p50.group(1)) if p50 else float("nan"),
        "p99_ms": float(p99.group(1)) if p99 else float("nan"),
        "server_cpu_us_per_pair": cpu_us,
        "tool_cpu_us_per_pair": tool_us,
    }


def _version(binary: str) -> str:
    """What ``binary --version`` says (the Go server prints none: its path then)."""
    try:
        done = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
        )
    except OSError as exc:
        raise SystemExit(f"cannot run {binary}: {exc}") from None
    return (done.stdout or done.stderr).strip().splitlines()[0] if done.returncode == 0 else binary


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser(NAME, __doc__.split("\n", 1)[0] if __doc__ else NAME)
    parser.add_argument(
        "--dflockd-go",
        default=os.environ.get("DFLOCKD_GO_BIN", ""),
        help="dflockd's Go server binary (go build ./cmd/dflockd; env DFLOCKD_GO_BIN)",
    )
    parser.add_argument(
        "--go-bench",
        default=os.environ.get("DFLOCKD_GO_BENCH", ""),
        help="dflockd's bench tool binary (go build ./cmd/bench; env DFLOCKD_GO_BENCH)",
    )
    parser.add_argument(
        "--builds",
        default=DEFAULT_BUILD,
        help=f"our server's builds, comma separated (default {DEFAULT_BUILD}: the default install)",
    )
    parser.add_argument("--pairs", type=int, default=0, help="pairs per bench run (40,000)")
    parser.add_argument("--rounds", type=int, default=0, help="rounds (the median is reported)")
    args = parser.parse_args(argv)
    if not args.dflockd_go or not args.go_bench:
        parser.error("needs --dflockd-go and --go-bench: binaries built from dflockd's repository")
    quick = bool(args.quick)
    pairs = args.pairs or (QUICK_PAIRS if quick else FULL_PAIRS)
    rounds = args.rounds or (QUICK_ROUNDS if quick else FULL_ROUNDS)
    builds = [b.strip() for b in args.builds.split(",") if b.strip()]
    run = BenchRun(
        NAME,
        args,
        list(sys.argv[1:] if argv is None else argv),
        params={
            "workers": list(WORKERS),
            "pairs_per_run": pairs,
            "rounds": rounds,
            "builds": builds,
            "dflockd_go": _version(args.dflockd_go),
            "bench_tool": "dflockd cmd/bench: bench --workers W --rounds PAIRS/W --servers H:P",
        },
    )
    cpus = sorted(os.sched_getaffinity(0))[:2]
    run.params["one_core_each"] = (
        {"server_cpu": cpus[0], "bench_tool_cpu": cpus[1]} if len(cpus) == 2 else None
    )
    with workdir(NAME) as tmp:
        shared = measure(
            args.dflockd_go, args.go_bench, builds, tmp, pairs=pairs, rounds=rounds, cpus=None
        )
        pinned = (
            measure(
                args.dflockd_go,
                args.go_bench,
                builds,
                tmp,
                pairs=pairs,
                rounds=rounds,
                cpus=(cpus[0], cpus[1]),
            )
            if len(cpus) == 2
            else None
        )
    report(run, shared, pairs, rounds, "")
    if pinned is None:
        print("one core each: skipped (this process may run on fewer than two CPUs)")
    else:
        report(run, pinned, pairs, rounds, ONE_CORE_EACH)
    run.data["runs"] = as_data(shared)
    run.data["runs_one_core_each"] = as_data(pinned) if pinned is not None else None
    run.write()
    return 0


def measure(
    go_server: str,
    tool: str,
    builds: list[str],
    tmp: Path,
    *,
    pairs: int,
    rounds: int,
    cpus: tuple[int, int] | None,
) -> Figures:
    """The rounds against the Go server and each of our ``builds``, fresh servers for the
    pass; ``cpus``: the CPU each server runs on and the bench tool's (None: every CPU)."""
    server_cpu, tool_cpu = cpus if cpus is not None else (None, None)
    figures: Figures = {}
    with owned_servers() as servers:
        targets = [start_dflockd_go(go_server, tmp, max_locks=MAX_LOCKS, cpu=server_cpu)]
        for build in builds:
            targets.append(start_dflockd(build, tmp, "--max-locks", str(MAX_LOCKS), cpu=server_cpu))
        servers.extend(targets)
        for server in targets:
            bench_once(tool, server, WORKERS[0], min(pairs, 1_000), tool_cpu)  # warm up
        where = "" if cpus is None else f" ({ONE_CORE_EACH})"
        for round_no in range(rounds):
            order = targets if round_no % 2 == 0 else list(reversed(targets))
            for workers in WORKERS:
                for server in order:
                    one = bench_once(tool, server, workers, pairs, tool_cpu)
                    figures.setdefault(server.label, {}).setdefault(workers, []).append(one)
                    print(
                        f"round {round_no + 1}/{rounds}{where} {workers:>3} workers "
                        f"{server.label:<24} {fmt_num(one['pairs_per_s'], 0):>10} pairs/s",
                        flush=True,
                    )
    return figures


def report(run: BenchRun, figures: Figures, pairs: int, rounds: int, where: str) -> None:
    """The pass's tables (pairs/s and CPU per pair, medians) and its goal per build of ours;
    ``where``: "" for the pass with every CPU, else what the pass is called."""
    suffix = f", {where}" if where else ""
    table = Table(
        f"Round trips with dflockd Go's own bench tool (acquire+release pairs per second, "
        f"median{suffix})",
        ["workers", *figures, *(f"{label} / Go" for label in figures if label != GO_SERVER)],
    )
    medians: dict[str, dict[int, float]] = {
        label: {w: median([f["pairs_per_s"] for f in runs]) for w, runs in by_w.items()}
        for label, by_w in figures.items()
    }
    for workers in WORKERS:
        row = [str(workers), *(fmt_num(medians[label][workers], 0) for label in figures)]
        row += [
            fmt_ratio(ratio(medians[label][workers], medians[GO_SERVER][workers]))
            for label in figures
            if label != GO_SERVER
        ]
        table.rows.append(row)
    table.notes.append(
        f"{pairs:,} pairs per run, {rounds} round(s); each worker one connection and one key"
    )
    if where:
        table.notes.append(
            "each server on one CPU and the bench tool on another (affinity set before each "
            "starts): the manifests' cpu limit of 1 for the lock server"
        )
    run.add(table)
    cpu = Table(
        "CPU per acquire+release pair under the bench tool (microseconds, median"
        f"{suffix}): the server's, and the bench tool's against it",
        ["workers", *figures, *(f"bench tool against {label}" for label in figures)],
        notes=[
            "the server process's CPU time (every thread) over the run, divided by its pairs; "
            "the bench tool's likewise" + ("" if where else "; both share the machine's cores")
        ],
    )
    for workers in WORKERS:
        row = [str(workers)]
        for field in ("server_cpu_us_per_pair", "tool_cpu_us_per_pair"):
            row += [
                fmt_num(median([f[field] for f in by_w[workers]]), 1) for by_w in figures.values()
            ]
        cpu.rows.append(row)
    run.add(cpu)
    for label in figures:
        if label == GO_SERVER:
            continue
        shares = {w: ratio(medians[label][w], medians[GO_SERVER][w]) for w in WORKERS}
        run.goals.append(
            Goal(
                f"round trips at least {GOAL_RATIO:.1f}x dflockd Go's, its bench tool ({label}"
                f"{suffix})",
                ", ".join(f"{w} workers: {fmt_ratio(s)}" for w, s in shares.items()),
                all(s >= GOAL_RATIO for s in shares.values()),
            )
        )


def as_data(figures: Figures) -> dict[str, dict[str, list[dict[str, float]]]]:
    return {label: {str(w): runs for w, runs in by_w.items()} for label, by_w in figures.items()}


if __name__ == "__main__":
    raise SystemExit(main())
