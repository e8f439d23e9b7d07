"""Two or more trees of this project side by side, in one run: instructions per acquire+release
pair and per task run, counted by callgrind as ``benchmarks.instructions`` counts them (a run
of BASE and one of BASE + PAIRS, the difference over PAIRS), the arms alternating row by row.

    git archive <before> | tar -x -C /tmp/ab/before        # and <after> in /tmp/ab/after
    uv run python -m benchmarks.ab 200 1000 before=/tmp/ab/before after=/tmp/ab/after \\
        --out benchmarks/results/ab/<name>.json

An arm is ``NAME=TREE[:COMPILED_SITE]``: ``TREE`` (its ``server/`` and its root) goes first on
``PYTHONPATH`` of every process measured; with ``COMPILED_SITE`` (the tree's compiled server
wheel, unpacked), the server rows run once more on it. Rows: the server on uvloop with its
lease journal on, each of ``benchmarks.instructions``' request forms and a semaphore's ``sl``
+ ``sr``; the client process's plain socket loop (the floor, the same code in every arm) and
``Client.lock``; a plain task's and a ``LockedTask``'s run by Celery's ``apply()`` (the tracer
and the lock, without a broker), each tree's server answering its own client and tasks.
Load-independent to about 1%: it may run beside other work. Each arm is imported through a link
of the same length in the run's directory: the count moved 0.5% with the length of a tree's path.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from benchmarks._common import (
    ServerProcess,
    dflockd_command,
    owned_servers,
    start_dflockd,
    start_redis,
    workdir,
)
from benchmarks.instructions import (
    AB_FORMS,
    CLIENT_LOOPS,
    START_UNDER_VALGRIND_S,
    TASK_LOOP,
    TASKS,
    callgrind,
    count_server,
    dflockd_pairs,
    total,
)

CLIENT_ROWS = {"plain socket (l + r)": "floor", "celery_dflock Client.lock": "client"}
TASK_ROWS = {"plain task": "plain task", "LockedTask": "task"}
"""Each client loop's and task's row, by its label in ``benchmarks.instructions``."""
NO_SWEEP = ("--lease-sweep-interval", "3600")
"""The counted servers' lease sweep, out of the run: it runs by the clock (each second), not per
request, and its first pass (the journal's upkeep, the fsync thread started) is about 190,000
instructions, 190 a pair of the 1,000 counted: whether it falls in the longer run or not
depended on the machine's load."""
ROWS = ("server", "pipelined", *CLIENT_ROWS.values(), *TASK_ROWS.values())
"""What ``--rows`` picks from: the server's round-trip forms, its pipelined form, the plain
socket client, ``Client.lock``, the plain task's run, the ``LockedTask`` run."""


def count_in(tree: str, tmp: Path, label: str, argv: list[str], lengths: tuple[int, int]) -> float:
    """Instructions per iteration of ``python -c <argv...> <n>`` run from ``tree`` (its working
    directory, first on the path), ``n`` each of ``lengths``: the difference over theirs."""
    totals: list[int] = []
    for n in lengths:
        out = tmp / f"callgrind.{re.sub(r'[^A-Za-z0-9]+', '-', label)}.{n}"
        command = [*callgrind(out), sys.executable, "-c", *argv, str(n)]
        subprocess.run(command, check=True, capture_output=True, timeout=1800, cwd=tree)
        totals.append(total(out))
    return (totals[1] - totals[0]) / (lengths[1] - lengths[0])


def _aligned(tmp: Path, link: str, path: str) -> str:
    """``path`` reached through ``tmp/link``, a link as long as every other arm's: the count
    moves with the length of the path a tree is imported from (the same code measured 0.5% apart
    from /tmp/ab/now and /tmp/ab/now2; two copies at paths of one length agree to 0.03%)."""
    (tmp / link).symlink_to(Path(path).resolve())
    return str(tmp / link)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else "")
    parser.add_argument("base", type=int, help="pairs of the shorter run")
    parser.add_argument("pairs", type=int, help="pairs counted (the difference)")
    parser.add_argument("arms", nargs="+", help="NAME=TREE[:COMPILED_SITE]")
    parser.add_argument("--out", type=Path, required=True, help="where the counts go (JSON)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"a list of {', '.join(ROWS)}")
    parser.add_argument(
        "--builds", default="pure,compiled", help="the server rows' builds: pure, compiled"
    )
    args = parser.parse_args()
    arms = [
        (name, *where.partition(":")[::2])
        for name, _, where in (spec.partition("=") for spec in args.arms)
    ]
    results: dict[str, dict[str, float]] = {}

    def record(label: str, name: str, value: float) -> None:
        results.setdefault(label, {})[name] = value
        print(f"{label} [{name}]: {value:,.0f}", flush=True)

    rows = set(args.rows.split(","))
    builds = args.builds.split(",")
    with workdir("dflock-ab-") as tmp:
        arms = [
            (
                name,
                _aligned(tmp, f"tree{i:02d}", tree),
                site and _aligned(tmp, f"site{i:02d}", site),
            )
            for i, (name, tree, site) in enumerate(arms)
        ]
        for build in builds:
            for form, acquire, depth in AB_FORMS:
                if ("pipelined" if depth > 1 else "server") not in rows:
                    continue
                for name, tree, site in arms:
                    if build == "compiled" and not site:
                        continue
                    server_code = site if build == "compiled" else f"{tree}/server"
                    os.environ["PYTHONPATH"] = os.pathsep.join([server_code, tree])

                    def start(wrapper: list[str]) -> ServerProcess:
                        command = [*wrapper, *dflockd_command("uvloop")]
                        return start_dflockd(
                            "uvloop",
                            tmp,
                            *NO_SWEEP,
                            command=command,
                            start_timeout_s=START_UNDER_VALGRIND_S,
                        )

                    counted = count_server(
                        f"{name} {build} {form}",
                        start,
                        dflockd_pairs(acquire, depth),
                        tmp,
                        base=args.base - args.base % depth,
                        pairs=args.pairs - args.pairs % depth,
                    )
                    record(f"server {build}: {form}", name, counted.per_pair)
        lengths = (args.base, args.base + args.pairs)
        task_lengths = (args.base // 2, (args.base + args.pairs) // 2)
        with owned_servers() as running:
            redis_server = start_redis(tmp)
            running.append(redis_server)
            redis_url = f"redis://{redis_server.host}:{redis_server.port}/0"
            for name, tree, _site in arms:
                os.environ["PYTHONPATH"] = os.pathsep.join([f"{tree}/server", tree])
                server = start_dflockd("uvloop", tmp)
                running.append(server)
                address = [server.host, str(server.port)]
                for label, row in CLIENT_ROWS.items():
                    if row not in rows:
                        continue
                    argv = [CLIENT_LOOPS[label], *address]
                    per_pair = count_in(tree, tmp, f"{name} {label}", argv, lengths)
                    record(f"client: {label}", name, per_pair)
                for label, row in TASK_ROWS.items():
                    if row not in rows:
                        continue
                    log = str(tmp / "bodies.log")
                    argv = [TASK_LOOP, TASKS[label], *address, redis_url, log]
                    per_run = count_in(tree, tmp, f"{name} {label}", argv, task_lengths)
                    record(f"task run: {label}", name, per_run)
                server.stop()
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    names = [name for name, _, _ in arms]
    print("| per pair (per run for a task) | " + " | ".join(names) + " | change |")
    print("|---|" + "---:|" * (len(names) + 1))
    for label, by_arm in results.items():
        cells = [f"{by_arm[n]:,.0f}" if n in by_arm else "n/a" for n in names]
        first, last = by_arm.get(names[0]), by_arm.get(names[-1])
        change = f"{(last / first - 1) * 100:+.1f}%" if first and last else "n/a"
        print(f"| {label} | " + " | ".join(cells) + f" | {change} |")


if __name__ == "__main__":
    main()
