"""Issue 52's A/B, in one run: dflockd's instructions per pair on uvloop, on ``TurnLoop`` (the
asyncio re-implementation: ``turn``, ``transport``, ``loops.TurnLoop``) and on asyncio's plain
selector loop, pure and compiled, counted by callgrind (``benchmarks.instructions``' counts).

Run at fadbcbb, the last commit with ``TurnLoop`` (there ``--event-loop asyncio``, and ``auto``
without uvloop, run it); the plain loop is the same server with ``cli._loop_factory`` handing
out ``asyncio.SelectorEventLoop`` (its group write then scheduled with ``call_soon``, as on any
loop not the server's own: what asyncio's loop does once ``TurnLoop`` is gone)::

    uv run python benchmarks/results/ab/issue-52/ab.py [--pairs 1000 --base 200] [--pure-only]

``--arms uvloop`` counts uvloop alone: on a later commit (``TurnLoop`` gone), the same counts of
what the default install runs, to compare with this run's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

from benchmarks._common import (
    COMPILED_SUFFIX,
    ServerProcess,
    dflockd_command,
    start_dflockd,
    workdir,
)
from benchmarks.instructions import (
    FORMS,
    START_UNDER_VALGRIND_S,
    count_server,
    dflockd_pairs,
)

PLAIN_ASYNCIO_BOOT = (
    "import asyncio, sys\n"
    "sys.modules['uvloop'] = None\n"
    "from dflockd_server import cli\n"
    "cli._loop_factory = lambda event_loop: asyncio.SelectorEventLoop\n"
    "cli.main(sys.argv[1:])\n"
)
"""dflockd on asyncio's plain selector loop (no ``TurnLoop``)."""

LOOPS = {
    "uvloop": ("uvloop", lambda: dflockd_command("uvloop")),
    "TurnLoop": ("asyncio", lambda: dflockd_command("asyncio")),
    "asyncio plain": ("asyncio", lambda: [sys.executable, "-c", PLAIN_ASYNCIO_BOOT]),
}
"""What each arm runs: (the loop the server must report, its command)."""


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=1000)
    parser.add_argument("--base", type=int, default=200)
    parser.add_argument("--pure-only", action="store_true")
    parser.add_argument("--forms", type=int, default=len(FORMS), help="the first N forms only")
    parser.add_argument("--arms", default=",".join(LOOPS), help="which of the loops to count")
    parser.add_argument("--out", default=str(Path(__file__).with_name("counts.json")))
    args = parser.parse_args()
    builds = [""] if args.pure_only else ["", COMPILED_SUFFIX]
    out = Path(args.out)
    results: dict[str, float] = json.loads(out.read_text()) if out.exists() else {}
    """Counts of an earlier run to the same file are kept (a run that stopped goes on)."""
    with workdir("dflock-ab-52-") as tmp:
        for build in builds:
            for arm, (loop, command) in LOOPS.items():
                if arm not in args.arms.split(","):
                    continue
                argv = command()
                for form, hold, depth in FORMS[: args.forms]:

                    def start(
                        wrapper: list[str], loop: str = loop + build, argv: list[str] = argv
                    ) -> ServerProcess:
                        return start_dflockd(
                            loop,
                            tmp,
                            command=[*wrapper, *argv],
                            start_timeout_s=3 * START_UNDER_VALGRIND_S,  # a loaded machine
                        )

                    label = f"{arm}{' compiled' if build else ' pure'}: {form}"
                    if label in results:
                        continue
                    counted = count_server(
                        label,
                        start,
                        dflockd_pairs(hold, depth),
                        tmp,
                        base=args.base - args.base % depth,
                        pairs=args.pairs - args.pairs % depth,
                    )
                    results[label] = counted.per_pair
                    print(f"{label}: {counted.per_pair:,.0f} per pair", flush=True)
                    out.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
