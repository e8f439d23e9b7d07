"""Run every benchmark, one after another, then rewrite RESULTS.md from their results.

    uv run python -m benchmarks.run_all            # full sizes (about 35 minutes on 2 cores)
    uv run python -m benchmarks.run_all --quick    # tiny sizes, well under a minute

Each benchmark runs in its own process with the same ``--run-id``, so RESULTS.md can tell
that its figures come from one run. Stops nothing it did not start; a benchmark that fails
is reported and the others still run (the exit status is then 1). ``cluster`` needs etcd: where
there is none it is skipped (said so), not failed. ``--dflockd-go PATH`` hands dflockd's Go
server to ``server``, which measures it beside ours; with ``--go-bench PATH`` besides (dflockd's
own bench tool), ``gobench`` runs that tool against both servers (without the two, it is
skipped, and says so).
"""

from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks._common import BENCH_DIR, REPO, RESULTS_DIR, etcd_binary
from benchmarks.report import ORDER

BENCHMARKS = ORDER
"""Every benchmark, in the order they run: the order RESULTS.md shows them in."""
PASSES: dict[str, tuple[tuple[str, ...], ...]] = {"contention": ((), ("--only", "busy"))}
"""A benchmark run in parts, each part its own command with the same run id (the later ones
add to its results file): ``contention``'s handoff latency, then its busy-keys batch of Celery
workers (3 minutes; left out of ``--quick``). The others run as one command."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.run_all", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the smoke test)")
    parser.add_argument("--results-dir", default=str(RESULTS_DIR))
    parser.add_argument("--output", default=str(BENCH_DIR / "RESULTS.md"))
    parser.add_argument(
        "--only", default="", help=f"comma separated subset of {', '.join(BENCHMARKS)}"
    )
    parser.add_argument(
        "--dflockd-go",
        default="",
        metavar="PATH",
        help="dflockd's Go server binary, for benchmarks.server to measure beside ours",
    )
    parser.add_argument(
        "--go-bench",
        default="",
        metavar="PATH",
        help="dflockd's bench tool binary (with --dflockd-go: benchmarks.gobench runs it)",
    )
    args = parser.parse_args(argv)
    chosen = [b for b in args.only.split(",") if b] or list(BENCHMARKS)
    unknown = sorted(set(chosen) - set(BENCHMARKS))
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(unknown)}")
    run_id = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    Path(args.results_dir).mkdir(parents=True, exist_ok=True)
    durations: dict[str, float] = {}
    failed: list[str] = []
    for name in chosen:
        if name == "cluster" and etcd_binary() is None:
            print("== cluster skipped: no etcd binary (install etcd-server, or set ETCD_BIN)")
            continue
        if name == "gobench" and not (args.dflockd_go and args.go_bench):
            print("== gobench skipped: it needs --dflockd-go and --go-bench (dflockd's binaries)")
            continue
        passes = PASSES.get(name, ((),))
        start = time.monotonic()
        for extra in passes[:1] if args.quick else passes:
            command = [sys.executable, "-m", f"benchmarks.{name}", "--run-id", run_id, *extra]
            if Path(args.results_dir).resolve() != RESULTS_DIR:
                command += ["--results-dir", args.results_dir]
            if args.quick:
                command.append("--quick")
            if name in ("server", "gobench") and args.dflockd_go:
                command += ["--dflockd-go", args.dflockd_go]
            if name == "gobench":
                command += ["--go-bench", args.go_bench]
            print(f"== {name}: {' '.join(command[1:])}", flush=True)
            code = subprocess.run(command, cwd=REPO, check=False).returncode
            if code != 0:
                failed.append(name)
                print(f"== {name} FAILED (exit status {code})", flush=True)
        durations[name] = time.monotonic() - start
    report = [sys.executable, "-m", "benchmarks.report", "--results-dir", args.results_dir]
    report += ["--output", args.output]
    if subprocess.run(report, cwd=REPO, check=False).returncode != 0:
        failed.append("report")
    print("== durations: " + ", ".join(f"{n} {d:.0f} s" for n, d in durations.items()))
    if failed:
        print(f"== failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
