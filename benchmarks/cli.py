"""How long ``celery -A proj dflock ...`` takes to answer, one lock held (issue 73).

    uv run python -m benchmarks.cli             # 5 runs of each command, each bytecode case
    uv run python -m benchmarks.cli --quick     # 1 run of ``locks``, bytecode cached (seconds)

One ``dflockd`` as users run it (its journal on), one lock held on it with a LockedTask's owner
note, and a Celery project of one module (``proj.py``: the app and ``dflock_servers``). Each
command runs as a user runs it, a new ``celery`` process each time; measured: its wall time
and its CPU time (user + system, from the kernel's accounting of the child), median of the
runs. Beside the ``dflock`` commands, Celery's own ``celery -A proj report`` (it loads the app
and prints its settings, talking to nothing) is the floor: what any ``celery`` command costs
before it does anything.

Two cases of bytecode. *cached*: as Python runs by default, the ``.pyc`` of every module is
written at its first import (one run before the measured ones) and read afterwards. *none*:
no ``.pyc`` read or written (``PYTHONDONTWRITEBYTECODE=1`` and an empty
``PYTHONPYCACHEPREFIX``), as on a machine that sets ``PYTHONDONTWRITEBYTECODE`` over packages
installed without bytecode (``uv`` installs none unless ``--compile-bytecode``): every process
compiles Celery, kombu, click-repl and the plugin from source again. The goal is decided on
the cached case, the wall time, as issue 73 states it: ``celery -A proj dflock locks`` answers
in under 1 s, median of 5, one lock held. On a loaded machine the wall time is the CPU time
stretched by the load (``loadavg`` is in the results file): the CPU time is the command's
own cost.
"""

from __future__ import annotations

import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks._common import (
    BenchRun,
    Goal,
    Table,
    available_loops,
    base_parser,
    owned_servers,
    start_dflockd,
    workdir,
)

NAME = "cli"
ROUNDS = 5
GOAL_S = 1.0
"""Issue 73, acceptance 4: ``celery -A proj dflock locks`` answers in under 1 s."""
COMMANDS: tuple[tuple[str, ...], ...] = (
    ("dflock", "locks"),
    ("dflock", "status"),
    ("dflock", "ping"),
    ("report",),
)
HELD_KEY = "report:42"
HELD_NOTE = "0f6a2c1e-5b1d-4c3e-9a7f-2d8e4b6c1a90/celery%40worker1/4242/proj.tasks.report"
"""A LockedTask's owner note: task id, worker, pid, task name (``locks`` shows them)."""


def project(where: Path, address: str) -> None:
    """``proj.py``: a Celery app that names the lock server (as a user's project does)."""
    (where / "proj.py").write_text(
        "from celery import Celery\n\n"
        'app = Celery("proj", broker="memory://")\n'
        f"app.conf.dflock_servers = [{address!r}]\n"
    )


def environment(case: str, cache_prefix: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DFLOCK", "PYTHONPYCACHE"))}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if case == "none":
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        env["PYTHONPYCACHEPREFIX"] = str(cache_prefix)  # empty: no .pyc is found there
    return env


def run_once(command: Sequence[str], cwd: Path, env: dict[str, str]) -> tuple[float, float, str]:
    """One ``celery -A proj COMMAND``: (wall s, CPU s of the child, its output)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "proj", *command],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr}")
    return wall, cpu, done.stdout


def main(argv: Sequence[str] | None = None) -> int:
    parser = base_parser(NAME, __doc__.split("\n", 1)[0] if __doc__ else NAME)
    parser.add_argument("--rounds", type=int, default=ROUNDS, help=f"runs per command ({ROUNDS})")
    args = parser.parse_args(argv)
    rounds: int = 1 if args.quick else args.rounds
    commands = COMMANDS[:1] if args.quick else COMMANDS
    run = BenchRun(
        NAME,
        args,
        list(sys.argv[1:] if argv is None else argv),
        params={"rounds": rounds, "commands": [" ".join(c) for c in commands]},
    )
    from celery_dflock import Client  # the holder: this process, as another worker would

    loop = available_loops()[-1]
    with workdir(NAME) as work, owned_servers() as servers:
        server = start_dflockd(loop, work)
        servers.append(server)
        address = f"{server.host}:{server.port}"
        project(work, address)
        empty_cache = work / "no-pycache"
        empty_cache.mkdir()
        with Client([(server.host, server.port)]) as client:
            held = client.lock(HELD_KEY, lease_ttl_s=300, note=HELD_NOTE)
            if not held.acquire():
                raise RuntimeError(f"{HELD_KEY} could not be taken")
            table = Table(
                f"celery -A proj COMMAND, a new process each run, one lock held ({loop} "
                f"server, journal on); median of {rounds}",
                ["command", "bytecode", "wall s", "CPU s", "runs (wall s)"],
                notes=[
                    "bytecode cached: .pyc written at the first import (a run before these), "
                    "read after; none: compiled from source in every process "
                    "(PYTHONDONTWRITEBYTECODE=1, nothing to read)",
                    "report: Celery's own command, the floor of any celery command",
                ],
            )
            figures: dict[str, dict[str, dict[str, float | list[float]]]] = {}
            goal_figures = (float("nan"), float("nan"))
            for case in ("cached",) if args.quick else ("cached", "none"):
                env = environment(case, empty_cache)
                run_once(commands[0], work, env)  # the cached case's .pyc written
                for command in commands:
                    walls: list[float] = []
                    cpus: list[float] = []
                    for _ in range(rounds):
                        wall, cpu, output = run_once(command, work, env)
                        if command == ("dflock", "locks") and "proj.tasks.report" not in output:
                            raise RuntimeError(f"locks did not list the held lock:\n{output}")
                        walls.append(wall)
                        cpus.append(cpu)
                    label = " ".join(command)
                    wall_s, cpu_s = statistics.median(walls), statistics.median(cpus)
                    if case == "cached" and command == ("dflock", "locks"):
                        goal_figures = (wall_s, cpu_s)
                    figures.setdefault(label, {})[case] = {
                        "wall_s": round(wall_s, 3),
                        "cpu_s": round(cpu_s, 3),
                        "walls": [round(w, 3) for w in walls],
                    }
                    table.rows.append(
                        [
                            label,
                            case,
                            f"{wall_s:.2f}",
                            f"{cpu_s:.2f}",
                            ", ".join(f"{w:.2f}" for w in walls),
                        ]
                    )
            held.release()
        run.add(table)
        run.data["commands"] = figures
        wall_s, cpu_s = goal_figures
        run.goals.append(
            Goal(
                goal=f"celery -A proj dflock locks answers in under {GOAL_S:g} s, median of "
                f"{ROUNDS}, one lock held (issue 73)",
                measured=f"{wall_s:.2f} s wall, {cpu_s:.2f} s CPU (bytecode cached; "
                f"load average {os.getloadavg()[0]:.1f})",
                met=wall_s < GOAL_S,
            )
        )
    run.write()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
