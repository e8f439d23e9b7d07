"""Where the client's time goes: ``Client.lock`` per acquire+release, and a ``LockedTask`` run
against a plain task and a task taking redis-py's ``Lock``, timed and under cProfile.

    uv run python -m benchmarks.profile_client            # 3,000 pairs and runs per variant
    uv run python -m benchmarks.profile_client --quick

Everything runs in this process against a real ``dflockd`` (the console script, default
settings, journal on, uvloop when installed, as ``benchmarks.celery_tasks`` runs it) and a
private ``redis-server``. The tasks are ``benchmarks.celery_app``'s, run with Celery's
``apply()``: the same tracer, signals and ``LockedTask.__call__`` a worker runs, without the
broker and the pool, so what differs between the variants is the lock alone. Times per run are
measured first without the profiler (the median of ``--rounds`` batches); then one batch of
each locked variant runs under cProfile, whose table lists the functions with the most own
time per run (cProfile slows every Python call: read the shares, not the microseconds). Time
spent waiting for the server's replies shows as ``poll``/``recv``.
"""

from __future__ import annotations

import cProfile
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks._common import (
    BenchRun,
    Table,
    available_loops,
    base_parser,
    fmt_num,
    median,
    owned_servers,
    start_dflockd,
    start_redis,
    workdir,
)
from benchmarks.profile_server import profile_table, top_functions

NAME = "profile_client"
CLIENT_LOCK = "Client.lock (with client.lock(key): pass)"
PLAIN = "plain task"
LOCKED = "LockedTask"
REDIS_LOCK = "redis-py Lock in the task"


def _time_per_call(call: Callable[[int], object], n: int, first: int) -> float:
    start = time.perf_counter()
    for i in range(first, first + n):
        call(i)
    return (time.perf_counter() - start) / n * 1e6


def _profile(call: Callable[[int], object], n: int, first: int, out: str) -> None:
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        for i in range(first, first + n):
            call(i)
    finally:
        profiler.disable()
    profiler.dump_stats(out)


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    parser = base_parser(NAME, __doc__.split("\n", 1)[0] if __doc__ else NAME)
    parser.add_argument("--runs", type=int, default=0, help="pairs or runs per batch")
    parser.add_argument("--rounds", type=int, default=3, help="timed batches per variant")
    parser.add_argument("--top", type=int, default=15, help="functions to list")
    args = parser.parse_args(args_in)
    n = args.runs or (100 if args.quick else 3000)
    loop = available_loops()[-1]
    run = BenchRun(
        NAME,
        args,
        args_in,
        params={"runs": n, "rounds": args.rounds, "lock_server": f"dflockd ({loop})"},
    )
    with workdir("dflock-bench-profile-client-") as tmp, owned_servers() as servers:
        server = start_dflockd(loop, tmp)
        servers.append(server)
        lock_redis = start_redis(tmp)
        servers.append(lock_redis)
        os.environ["DFLOCK_BENCH_LOG"] = str(tmp / "bodies.log")
        os.environ["DFLOCK_BENCH_REDIS_LOCK_URL"] = f"redis://{lock_redis.host}:{lock_redis.port}"
        os.environ["DFLOCK_BENCH_SETTINGS"] = json.dumps(
            {
                "broker_url": "memory://",
                "task_ignore_result": True,
                "dflock_servers": f"{server.host}:{server.port}",
            }
        )
        from benchmarks import celery_app  # reads the settings above at import
        from celery_dflock import Client

        client = Client([(server.host, server.port)])
        tasks = celery_app.app.tasks  # by name: @app.task is untyped

        def client_lock(i: int) -> None:
            with client.lock(f"dflock-bench:profile-client:{i}"):
                pass

        variants: dict[str, Callable[[int], object]] = {
            CLIENT_LOCK: client_lock,
            PLAIN: lambda i: tasks["bench.plain"].apply(args=(i,)),
            LOCKED: lambda i: tasks["bench.locked"].apply(args=(i,)),
            REDIS_LOCK: lambda i: tasks["bench.redis_lock"].apply(args=(i,)),
        }
        timed: dict[str, float] = {}
        first = 0
        for name, call in variants.items():
            call(first)  # warm: connections, imports, the task's plan
            first += 1
            batches: list[float] = []
            for _ in range(args.rounds):
                batches.append(_time_per_call(call, n, first))
                first += n
            timed[name] = median(batches)
            print(f"{name}: {timed[name]:.1f} us per run", flush=True)
        table = Table(
            "Time per run, in process, no profiler (microseconds; median of "
            f"{args.rounds} batches of {n:,})",
            ["variant", "us per run", "over a plain task's run"],
            notes=[
                "Client.lock: one acquire+release pair, nothing else; the tasks: Celery's "
                "apply() of benchmarks.celery_app's tasks (a body that appends one line to a "
                "file), LockedTask with lock_key per run, redis-py's Lock on its own "
                "redis-server",
            ],
        )
        for name, us in timed.items():
            over = "-" if name in (CLIENT_LOCK, PLAIN) else fmt_num(us - timed[PLAIN], 1)
            table.rows.append([name, fmt_num(us, 1), over])
        run.add(table)
        run.data["us_per_run"] = timed
        profiled: dict[str, Any] = {}
        for name in (CLIENT_LOCK, LOCKED):
            out = str(tmp / f"profile-{len(profiled)}.prof")
            _profile(variants[name], n, first, out)
            first += n
            rows, total_us = top_functions(Path(out), n, args.top)
            label = "Client.lock, one acquire+release" if name != LOCKED else "a LockedTask run"
            run.add(
                profile_table(
                    f"{label}, profiled: own time per run ({n:,} runs; lock server "
                    f"dflockd ({loop}))",
                    rows,
                    "run",
                    f"{n:,} runs under cProfile; all profiled functions: {total_us:.1f} us/run "
                    "(cProfile slows every call: read the shares)",
                )
            )
            profiled[name] = {"total_us_per_run": total_us, "top": rows}
        run.data["profiled"] = profiled
        client.close()
    run.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
