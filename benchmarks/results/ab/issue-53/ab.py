"""Issue 53's A/B, in one run: instructions per acquire+release pair (callgrind, as
``benchmarks.instructions`` counts them: a run of BASE pairs and one of BASE + PAIRS, the
difference over PAIRS), the server of each tree on uvloop with its journal on, pure and
compiled, and ``Client.lock`` in the client process; the arms alternate form by form.

    python benchmarks/results/ab/issue-53/ab.py BASE PAIRS NAME=TREE[:COMPILED_SITE] ...

Each arm's tree (a ``git archive``) goes first on ``PYTHONPATH`` of the processes measured;
a compiled site (the tree's wheel, unpacked) before it for the compiled rows.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from benchmarks._common import (
    ServerProcess,
    dflockd_command,
    owned_servers,
    start_dflockd,
    workdir,
)
from benchmarks.instructions import FORMS, count_client, count_server, dflockd_pairs


def main() -> None:
    base, pairs = int(sys.argv[1]), int(sys.argv[2])
    arms: list[tuple[str, str, str]] = []
    for spec in sys.argv[3:]:
        name, _, where = spec.partition("=")
        tree, _, site = where.partition(":")
        arms.append((name, tree, site))
    results: dict[str, dict[str, float]] = {}
    rows: list[tuple[str, str]] = [(form, "pure") for form, _, _ in FORMS]
    rows += [(form, "compiled") for form, _, _ in FORMS]
    with workdir("ab53-") as tmp:
        for form, build in rows:
            hold, depth = next((h, d) for f, h, d in FORMS if f == form)
            for name, tree, site in arms:
                if build == "compiled" and not site:
                    continue
                os.environ["PYTHONPATH"] = os.pathsep.join(
                    [site, tree] if build == "compiled" else [tree]
                )

                def start(wrapper: list[str]) -> ServerProcess:
                    return start_dflockd(
                        "uvloop",
                        tmp,
                        command=[*wrapper, *dflockd_command("uvloop")],
                        start_timeout_s=900.0,
                    )

                counted = count_server(
                    form,
                    start,
                    dflockd_pairs(hold, depth),
                    tmp,
                    base=base - base % depth,
                    pairs=pairs - pairs % depth,
                )
                label = f"server {build}: {form}"
                results.setdefault(label, {})[name] = counted.per_pair
                print(f"{label} [{name}]: {counted.per_pair:,.0f}", flush=True)
        for name, tree, _site in arms:
            os.environ["PYTHONPATH"] = tree
            with owned_servers() as running:
                server = start_dflockd("uvloop", tmp)
                running.append(server)
                for label in ("plain socket (l + r)", "celery_dflock Client.lock"):
                    counted = count_client(label, server, tmp, base, pairs)
                    results.setdefault(f"client: {label}", {})[name] = counted.per_pair
                    print(f"client: {label} [{name}]: {counted.per_pair:,.0f}", flush=True)
    out = Path(__file__).with_name("counts.json")
    out.write_text(json.dumps(results, indent=1) + "\n")
    names = [name for name, _, _ in arms]
    print("| pair | " + " | ".join(names) + " | change |")
    print("|---|" + "---:|" * (len(names) + 1))
    for label, by_arm in results.items():
        cells = [f"{by_arm[n]:,.0f}" if n in by_arm else "n/a" for n in names]
        first, last = by_arm.get(names[0]), by_arm.get(names[-1])
        change = f"{(last / first - 1) * 100:+.1f}%" if first and last else "n/a"
        print(f"| {label} | " + " | ".join(cells) + f" | {change} |")


if __name__ == "__main__":
    main()
