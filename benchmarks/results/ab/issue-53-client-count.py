"""Issue 53's A/B count: instructions per ``Client.lock`` acquire+release pair in the client
process (callgrind), with `benchmarks.instructions`' own client loop and counting, beside the
plain-socket floor. Run from the tree to measure, with it first on the path::

    cd TREE && PYTHONPATH=TREE VENV/bin/python \
        benchmarks/results/ab/issue-53-client-count.py 200 1000
"""

from __future__ import annotations

import sys

from benchmarks import instructions
from benchmarks._common import available_loops, owned_servers, start_dflockd, workdir


def main() -> None:
    base, pairs = int(sys.argv[1]), int(sys.argv[2])
    with workdir("dflock-instr-") as tmp, owned_servers() as running:
        loop = "uvloop" if "uvloop" in available_loops() else "asyncio"
        server = start_dflockd(loop, tmp)
        running.append(server)
        for label in ("plain socket (l + r)", "celery_dflock Client.lock"):
            counted = instructions.count_client(label, server, tmp, base, pairs)
            print(
                f"{label}: {counted.per_pair:,.0f} per pair ({counted.base:,} / {counted.longer:,})"
            )


if __name__ == "__main__":
    main()
