"""Where the lock server's CPU goes: ``dflockd`` under cProfile, driven by the load generator.

    uv run python -m benchmarks.profile_server            # both loops, 10 connections, 3 s each
    uv run python -m benchmarks.profile_server --quick

The server runs in a child process (``--serve``: the real ``dflockd`` entry point inside
``cProfile``) and is stopped with SIGTERM, after which it writes its profile. The table lists
the functions with the most own time per acquire+release pair. cProfile slows every Python call
down, so read the shares, not the absolute microseconds; on uvloop the event loop itself is C
and shows up only through the Python callbacks it calls. The server runs with its lease journal
on, as users run it; ``--journal off`` (or ``no``, ``everysec``, ``always``) sets it apart:

    uv run python -m benchmarks.profile_server --loops uvloop --pipeline 16 --journal off
"""

from __future__ import annotations

import cProfile
import os
import pstats
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._common import (
    BenchRun,
    Table,
    available_loops,
    base_parser,
    fmt_num,
    owned_servers,
    split_build,
    start_dflockd,
    workdir,
)
from benchmarks._loadgen import LoadSpec, run_load, split_connections

NAME = "profile_server"
JOURNAL_FSYNCS = ("no", "everysec", "always")
STATS_ENV = "DFLOCK_BENCH_PROFILE_OUT"


def serve(loop: str, argv: list[str]) -> None:
    """The child: run ``dflockd`` (its real entry point) under cProfile until SIGTERM."""
    if split_build(loop)[0] == "asyncio":  # asyncio+mypyc too
        sys.modules["uvloop"] = None  # type: ignore[assignment]  # import uvloop fails
    from dflockd_server.cli import main as dflockd_main

    profiler = cProfile.Profile()
    profiler.enable()
    try:
        dflockd_main(argv)
    finally:
        profiler.disable()
        profiler.dump_stats(os.environ[STATS_ENV])


def _where(func: tuple[str, int, str]) -> str:
    filename, line, name = func
    if filename == "~":
        return name
    return f"{Path(filename).name}:{line}({name})"


def top_functions(stats_file: Path, pairs: int, top: int) -> tuple[list[dict[str, Any]], float]:
    stats = pstats.Stats(str(stats_file))
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    total_tt = sum(v[2] for v in raw.values())
    rows: list[dict[str, Any]] = []
    for func, (_cc, nc, tt, ct, _callers) in sorted(raw.items(), key=lambda kv: -kv[1][2])[:top]:
        rows.append(
            {
                "function": _where(func),
                "calls_per_pair": round(nc / pairs, 2),
                "own_us_per_pair": round(tt * 1e6 / pairs, 2),
                "cumulative_us_per_pair": round(ct * 1e6 / pairs, 2),
                "share": round(tt / total_tt, 4) if total_tt else 0.0,
            }
        )
    return rows, total_tt * 1e6 / pairs


def profile_table(title: str, rows: list[dict[str, Any]], per: str, note: str) -> Table:
    """``top_functions``' rows as a table, each figure per ``per`` (a pair, a run)."""
    table = Table(
        title,
        ["function", f"calls/{per}", f"own us/{per}", f"cumulative us/{per}", "share"],
        notes=[note],
    )
    for r in rows:
        table.rows.append(
            [
                r["function"],
                fmt_num(r["calls_per_pair"], 2),
                fmt_num(r["own_us_per_pair"], 2),
                fmt_num(r["cumulative_us_per_pair"], 2),
                f"{r['share']:.1%}",
            ]
        )
    return table


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["--serve"]:
        serve(args_in[1], args_in[2:])
        return 0
    parser = base_parser(NAME, __doc__.split("\n", 1)[0] if __doc__ else NAME)
    parser.add_argument("--duration", type=float, default=0.0, help="seconds of load per loop")
    parser.add_argument("--conns", type=int, default=10, help="connections")
    parser.add_argument("--pipeline", type=int, default=1, help="pairs per batch (1: round trips)")
    parser.add_argument("--top", type=int, default=20, help="functions to list")
    parser.add_argument("--loops", default=",".join(available_loops()), help="dflockd event loops")
    parser.add_argument(
        "--journal",
        choices=("default", "off", *JOURNAL_FSYNCS),
        default="default",
        help="the lease journal: on at the server's default fsync (default), off, or on at "
        "this --journal-fsync",
    )
    args = parser.parse_args(args_in)
    duration = args.duration or (0.3 if args.quick else 3.0)
    loops = [x for x in args.loops.split(",") if x]
    run = BenchRun(
        NAME,
        args,
        args_in,
        params={
            "duration_s": duration,
            "conns": args.conns,
            "pipeline": args.pipeline,
            "loops": loops,
            "journal": args.journal,
        },
    )
    with workdir("dflock-bench-profile-") as tmp:
        for loop in loops:
            stats_file = tmp / f"{loop}.prof"
            os.environ[STATS_ENV] = str(stats_file)
            with owned_servers() as servers:
                server = start_dflockd(
                    loop,
                    tmp,
                    "--max-locks",
                    "100000",
                    "--max-locks-per-connection",
                    "0",  # --pipeline acquires per connection may be many
                    command=[sys.executable, "-m", f"benchmarks.{NAME}", "--serve", loop],
                    journal=args.journal != "off",
                    journal_fsync=args.journal if args.journal in JOURNAL_FSYNCS else None,
                )
                servers.append(server)
                specs = [
                    LoadSpec(
                        protocol="dflockd",
                        host=server.host,
                        port=server.port,
                        conns=n,
                        pipeline=args.pipeline,
                        duration_s=duration,
                        key_prefix=f"dflock-bench:profile:{i}",
                    )
                    for i, n in enumerate(split_connections(args.conns, os.cpu_count() or 1))
                ]
                m = run_load(specs, server.cpu_ns)
            if not stats_file.exists():
                raise RuntimeError(f"the profiled server wrote no profile:\n{server.log_tail()}")
            rows, total_us = top_functions(stats_file, m.pairs, args.top)
            run.add(
                profile_table(
                    f"Server hot path on {loop}, profiled: own time per acquire+release pair "
                    f"({args.conns} connections, pipeline {args.pipeline}, journal "
                    f"{args.journal})",
                    rows,
                    "pair",
                    f"{m.pairs:,} pairs; all profiled functions: {total_us:.1f} us/pair "
                    "(under cProfile; the unprofiled server needs far less)",
                )
            )
            run.data[loop] = {"pairs": m.pairs, "total_us_per_pair": total_us, "top": rows}
    run.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
