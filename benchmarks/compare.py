"""Compare benchmark results of two checkouts measured in one run (an A/B), as a Markdown table.

Each side is one or more results directories (``--results-dir`` of `benchmarks.server` and
`benchmarks.celery_tasks`), run alternately on the same machine; a figure is the median over
that side's directories. Compared: server CPU per acquire+release pair (each load, connection
count and loop), ``DistributedLock``'s acquire+release p50, LockedTask throughput and the lock
server's CPU per task::

    uv run python -m benchmarks.compare --a old-1 old-2 --b new-1 new-2 --label-a main \\
        --label-b branch --out benchmarks/results/ab.md
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

CPU_TITLE = "Server CPU per acquire+release pair"
CLIENT_TITLE = "One client through the client libraries"
TASKS_TITLE = "tasks/s"


def _number(text: str) -> float:
    return float(text.replace(",", "").rstrip("x"))


def _tables(directory: Path, name: str) -> list[dict[str, Any]]:
    path = directory / f"{name}.json"
    if not path.exists():
        return []
    return list(json.loads(path.read_text())["tables"])


def _figures(directory: Path) -> Iterator[tuple[str, float]]:
    """(what, value) for every compared figure in one results directory."""
    for table in _tables(directory, "server"):
        columns: list[str] = table["columns"]
        if table["title"].startswith(CPU_TITLE):
            for row in table["rows"]:
                for index, column in enumerate(columns):
                    if column.startswith("dflockd"):
                        what = f"server CPU/pair (us), {row[0]}, {row[1]} conns, {column}"
                        yield what, _number(row[index])
        elif table["title"].startswith(CLIENT_TITLE):
            for row in table["rows"]:
                if row[1] == "celery_dflock.DistributedLock":
                    yield f"DistributedLock p50 (us), {row[0]}", _number(row[2])
    for table in _tables(directory, "celery_tasks"):
        columns = table["columns"]
        if TASKS_TITLE in " ".join(columns) and "variant" in columns[0]:
            index = next(i for i, c in enumerate(columns) if TASKS_TITLE in c)
            cpu = next((i for i, c in enumerate(columns) if "CPU" in c), None)
            for row in table["rows"]:
                yield f"tasks/s, {row[0]}", _number(row[index])
                if cpu is not None and row[cpu] != "-":
                    yield f"lock server CPU/task (us), {row[0]}", _number(row[cpu])


def _medians(directories: Sequence[Path]) -> dict[str, float]:
    seen: dict[str, list[float]] = {}
    for directory in directories:
        for what, value in _figures(directory):
            seen.setdefault(what, []).append(value)
    return {what: statistics.median(values) for what, values in seen.items()}


def compare(a: Sequence[Path], b: Sequence[Path], label_a: str, label_b: str) -> str:
    left, right = _medians(a), _medians(b)
    lines = [
        f"| figure | {label_a} | {label_b} | {label_b} / {label_a} |",
        "|---|---|---|---|",
    ]
    for what in left:
        if what in right and left[what]:
            ratio = right[what] / left[what]
            lines.append(f"| {what} | {left[what]:.1f} | {right[what]:.1f} | {ratio:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Compare two sides of a same-run A/B.")
    parser.add_argument("--a", nargs="+", type=Path, required=True, help="results dirs of A")
    parser.add_argument("--b", nargs="+", type=Path, required=True, help="results dirs of B")
    parser.add_argument("--label-a", default="A")
    parser.add_argument("--label-b", default="B")
    parser.add_argument("--out", type=Path, help="write the table here too")
    args = parser.parse_args(argv)
    table = compare(args.a, args.b, args.label_a, args.label_b)
    print(table, end="")
    if args.out is not None:
        args.out.write_text(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
