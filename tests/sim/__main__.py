"""``python -m tests.sim``: run simulated seeds by hand (see docs/testing.md).

python -m tests.sim --seed 1234 --trace        replay one seed, print its trace
python -m tests.sim --seeds 500                seeds 0..499
python -m tests.sim --hours 2                  new seeds for two hours
python -m tests.sim --mutation read-timeout-frees --seeds 50   with a defect put back
python -m tests.sim --cluster --seed 3 --trace   a cluster's seed (members, etcd, moves)
"""

from __future__ import annotations

import argparse
import sys
import time

from tests.sim.mutations import MUTATIONS
from tests.sim.run import simulate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.sim", description="Run simulated seeds (tests/sim)."
    )
    parser.add_argument("--seed", type=int, help="run this seed only (a replay)")
    parser.add_argument("--seeds", type=int, default=100, help="run seeds FIRST..FIRST+N-1")
    parser.add_argument("--first", type=int, default=0, help="the first seed (default 0)")
    parser.add_argument("--hours", type=float, help="run new seeds for this long instead")
    parser.add_argument(
        "--duration", type=float, help="simulated s per seed (300; a cluster's 150)"
    )
    parser.add_argument("--mutation", choices=sorted(MUTATIONS), help="put a defect back")
    parser.add_argument("--trace", action="store_true", help="print the trace's last events")
    parser.add_argument(
        "--cluster", action="store_true", help="simulate a cluster (a cluster's mutation does)"
    )
    args = parser.parse_args(argv)
    if args.seed is not None:
        result = simulate(args.seed, args.mutation, args.duration, cluster=args.cluster)
        if args.trace or not result.ok:
            print(result.report())
        print(f"seed {args.seed}: {'ok' if result.ok else 'FAILED'}, trace digest {result.digest}")
        return 0 if result.ok else 1
    deadline = None if args.hours is None else time.monotonic() + args.hours * 3600
    seed, failed, ran = args.first, 0, 0
    while (ran < args.seeds) if deadline is None else (time.monotonic() < deadline):
        result = simulate(seed, args.mutation, args.duration, cluster=args.cluster)
        ran += 1
        if not result.ok:
            failed += 1
            print(result.report(), flush=True)
        seed += 1
    print(f"{ran} seeds from {args.first}: {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
