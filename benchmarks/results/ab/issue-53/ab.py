"""Issue 53's A/B, in one run: instructions per acquire+release pair (callgrind, as
``benchmarks.instructions`` counts them: a run of BASE pairs and one of BASE + PAIRS, the
difference over PAIRS), the server of each tree on uvloop with its journal on, pure and
compiled, and ``Client.lock`` in the client process; the arms alternate form by form.

    python benchmarks/results/ab/issue-53/ab.py BASE PAIRS NAME=TREE[:COMPILED_SITE] ...

Each arm's tree (a ``git archive``: its ``server/`` and its root) goes first on ``PYTHONPATH``
of the processes measured; for the compiled rows, a compiled site (the tree's wheel, unpacked)
takes the place of its ``server/``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks._common import (
    ServerProcess,
    dflockd_command,
    owned_servers,
    start_dflockd,
    workdir,
)
from benchmarks.instructions import (
    CLIENT_LOOPS,
    FORMS,
    callgrind,
    count_server,
    dflockd_pairs,
    total,
)


def count_client(
    label: str, server: ServerProcess, tmp: Path, tree: str, lengths: tuple[int, int]
) -> float:
    """Instructions per pair of ``benchmarks.instructions``' client loop ``label``, run from
    ``tree`` (its working directory: ``python -c`` puts it first on the path)."""
    totals: list[int] = []
    for n in lengths:
        out = tmp / f"callgrind.client.{len(totals)}.{n}"
        argv = [CLIENT_LOOPS[label], server.host, str(server.port), str(n)]
        command = [*callgrind(out), sys.executable, "-c", *argv]
        subprocess.run(command, check=True, capture_output=True, timeout=1800, cwd=tree)
        totals.append(total(out))
    return (totals[1] - totals[0]) / (lengths[1] - lengths[0])


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
                server_code = site if build == "compiled" else f"{tree}/server"
                os.environ["PYTHONPATH"] = os.pathsep.join([server_code, tree])

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
            os.environ["PYTHONPATH"] = os.pathsep.join([f"{tree}/server", tree])
            with owned_servers() as running:
                server = start_dflockd("uvloop", tmp)
                running.append(server)
                for label in ("plain socket (l + r)", "celery_dflock Client.lock"):
                    per_pair = count_client(label, server, tmp, tree, (base, base + pairs))
                    results.setdefault(f"client: {label}", {})[name] = per_pair
                    print(f"client: {label} [{name}]: {per_pair:,.0f}", flush=True)
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
