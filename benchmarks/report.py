"""Assemble ``benchmarks/RESULTS.md`` (and its chart) from ``benchmarks/results/*.json``.

    uv run python -m benchmarks.report

Everything in RESULTS.md comes from the results files: the tables each benchmark printed, the
goals as each benchmark decided them from its figures, the machine, the commands and their
durations. Nothing is typed in by hand, so re-running the benchmarks and this command on
another machine rewrites it whole.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks._common import BENCH_DIR, RESULTS_DIR

NAME = "report"
ORDER = (
    "server",
    "gobench",
    "journal",
    "restart",
    "cluster",
    "contention",
    "scale",
    "held",
    "celery_tasks",
    "profile_server",
    "profile_client",
    "instructions",
    "code_size",
    "cli",
)
SECTIONS = {
    "server": "Lock server: dflockd against Redis",
    "gobench": "Round trips with dflockd Go's own bench tool, its server beside ours",
    "journal": "Lease journal: what durability costs, beside Redis's AOF",
    "restart": "Restart: a million leases held, kill -9, beside Redis loading its AOF",
    "cluster": "Cluster mode: one server against a 3-member cluster and 3 static members",
    "contention": "Contention: many waiters on one key",
    "scale": "Scale: memory per held lock and per idle connection",
    "held": "Held locks: what keeping them held costs, today (A) against this checkout (B)",
    "celery_tasks": "Celery: plain tasks against locked tasks",
    "profile_server": "Where the server's CPU goes (cProfile)",
    "profile_client": "Where the client's and LockedTask's time goes (timed, and cProfile)",
    "instructions": "Instructions per pair (callgrind): server and client, load-independent",
    "code_size": "Code size: the product's lines against issue 71's baseline",
    "cli": "celery -A proj dflock ...: how long a command takes to answer",
}
CHART = "throughput.png"
DOCS_CHART = BENCH_DIR.parent / "docs" / "assets" / "images" / CHART
"""The copy docs/evidence.md shows (tests/docs/test_docs_site.py checks it is the same)."""
MODES = ("round trip", "pipelined")


def load(results_dir: Path) -> dict[str, dict[str, Any]]:
    found: dict[str, dict[str, Any]] = {}
    for name in ORDER:
        path = results_dir / f"{name}.json"
        if path.exists():
            found[name] = json.loads(path.read_text())
    return found


def load_previous(rev: str) -> dict[str, dict[str, Any]]:
    """The results files as committed at ``rev`` (the last run), by benchmark name."""
    found: dict[str, dict[str, Any]] = {}
    for name in ORDER:
        shown = subprocess.run(
            ["git", "show", f"{rev}:benchmarks/results/{name}.json"],
            capture_output=True,
            text=True,
            cwd=BENCH_DIR.parent,
            check=False,
        )
        if shown.returncode == 0:
            found[name] = json.loads(shown.stdout)
    return found


def _number(cell: str) -> float | None:
    text = cell.replace(",", "").strip().rstrip("x")
    try:
        return float(text)
    except ValueError:
        return None


def _goal_key(goal: str) -> str:
    """A goal with its numbers left out, so that a goal whose threshold moved still pairs."""
    return re.sub(r"\d+(\.\d+)?", "#", goal)


MOVED_AT_LEAST = 0.10
"""A figure is listed as moved when it changed by at least this share."""
MOVED_ROWS = 40


def moved_section(
    results: dict[str, dict[str, Any]], previous: dict[str, dict[str, Any]], rev: str
) -> list[str]:
    """Every figure of a table this run and the last share (same title, row and column) that
    moved by at least `MOVED_AT_LEAST`, largest moves first; ratio columns are left out."""
    moves: list[tuple[float, str]] = []
    for name, r in results.items():
        old_tables = {tb["title"]: tb for tb in previous.get(name, {}).get("tables", [])}
        for table in r["tables"]:
            old = old_tables.get(table["title"])
            if old is None or old["columns"] != table["columns"]:
                continue
            columns: list[str] = table["columns"]
            old_rows = {tuple(row[:2]): row for row in old["rows"]}
            for row in table["rows"]:
                before_row = old_rows.get(tuple(row[:2]))
                if before_row is None:
                    continue
                for col, now_cell, before_cell in zip(columns, row, before_row, strict=False):
                    now, before = _number(now_cell), _number(before_cell)
                    if now is None or not before or "/" in col or col == columns[0]:
                        continue
                    change = now / before
                    if abs(change - 1) >= MOVED_AT_LEAST:
                        where = " · ".join(row[:2])
                        moves.append(
                            (
                                abs(change - 1),
                                f"| {table['title']} | {where} | {col} | {before_cell} | "
                                f"{now_cell} | {change:.2f}x |",
                            )
                        )
    old_goals = {_goal_key(g["goal"]): g for r in previous.values() for g in r.get("goals", [])}
    verdicts = [
        f"- {g['goal']}: last run {old['measured']} ({'met' if old['met'] else 'not met'}"
        f"{'' if old['goal'] == g['goal'] else ' against: ' + old['goal']}), "
        f"now {'met' if g['met'] else 'not met'}"
        for r in results.values()
        for g in r["goals"]
        if (old := old_goals.get(_goal_key(g["goal"]))) is not None
    ]
    out = [
        f"## Moved since the last run ({rev})",
        "",
        f"The committed results at `{rev}` against this run: each figure of a table both have "
        f"that changed by {MOVED_AT_LEAST:.0%} or more (largest first, at most {MOVED_ROWS}).",
        "",
    ]
    if not previous:
        return [*out, "No committed results at that revision.", ""]
    out += [
        "| table | row | column | last run | this run | this / last |",
        "|---|---|---|---:|---:|---:|",
    ]
    out += [line for _, line in sorted(moves, key=lambda m: -m[0])[:MOVED_ROWS]]
    if len(moves) > MOVED_ROWS:
        out.append(f"\n({len(moves) - MOVED_ROWS} smaller moves not listed)")
    out += ["", "Goals measured the same way in both runs:", "", *verdicts, ""]
    return out


def md_table(table: dict[str, Any]) -> str:
    columns: list[str] = table["columns"]
    rows: list[list[str]] = table["rows"]

    def esc(cell: str) -> str:
        return cell.replace("|", "\\|")

    out = [f"**{esc(table['title'])}**", ""]
    out.append("| " + " | ".join(esc(c) for c in columns) + " |")
    out.append("|" + "|".join(["---"] + ["---:"] * (len(columns) - 1)) + "|")
    out.extend("| " + " | ".join(esc(c) for c in row) + " |" for row in rows)
    out.extend(["", *(f"{note}" for note in table.get("notes", []))])
    return "\n".join(out).rstrip() + "\n"


def chart(server: dict[str, Any], path: Path) -> bool:
    """Pairs per second against connections, one line per server, one panel per load shape."""
    cells: list[dict[str, Any]] = server["data"].get("cells", [])
    if not cells:
        return False
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    targets = list(dict.fromkeys(c["target"] for c in cells))
    fig, axes = plt.subplots(1, len(MODES), figsize=(11, 4.2), squeeze=False)
    for ax, mode in zip(axes[0], MODES, strict=True):
        for target in targets:
            points = sorted(
                (c["conns"], c["pairs_per_s"])
                for c in cells
                if c["target"] == target and c["mode"] == mode
            )
            if not points:
                continue
            xs = [p[0] for p in points]
            ys = [p[1] for p in points]
            style = "--" if target == "redis" else "-"
            ax.plot(xs, ys, style, marker="o", label=target)
        ax.set_xscale("log")
        conns = sorted({c["conns"] for c in cells})
        ax.set_xticks(conns, [str(n) for n in conns])
        ax.minorticks_off()
        ax.yaxis.set_major_formatter(matplotlib.ticker.StrMethodFormatter("{x:,.0f}"))
        ax.set_xlabel("connections")
        ax.set_ylabel("acquire+release pairs per second")
        ax.set_title(mode)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
    machine = server["machine"]
    fig.suptitle(
        f"Throughput against connections ({machine['cores']} cores, {server['started']})",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def machine_section(results: dict[str, dict[str, Any]]) -> list[str]:
    first = next(iter(results.values()))
    m = first["machine"]
    out = [
        "## Machine",
        "",
        f"- {m['cores']} cores: {m['cpu']}; {m['kernel']}; {m['python']}",
        "- versions: " + ", ".join(f"{k} {v}" for k, v in m["versions"].items()),
    ]
    run_ids = {r.get("run_id", "") for r in results.values()}
    starts = [r["started"] for r in results.values()]
    out.append(
        f"- run {', '.join(sorted(i for i in run_ids if i)) or '(no run id)'}: "
        f"{min(starts)} to {max(r['finished'] for r in results.values())}"
    )
    if len(run_ids) > 1:
        out.append(
            "- **warning: these results come from different runs** "
            f"({', '.join(sorted(i or '(no run id)' for i in run_ids))}); "
            "run `uv run python -m benchmarks.run_all`"
        )
    if any(r.get("quick") for r in results.values()):
        out.append("- **warning: quick (smoke-test) sizes; these figures mean nothing**")
    return [*out, ""]


def commands_section(results: dict[str, dict[str, Any]]) -> list[str]:
    out = [
        "## Commands",
        "",
        "Everything: `uv run python -m benchmarks.run_all` (then this file is rewritten by "
        "`uv run python -m benchmarks.report`).",
        "",
        "| benchmark | command | duration | load average at start / end |",
        "|---|---|---:|---|",
    ]
    for name, r in results.items():
        start = " ".join(f"{x:.2f}" for x in r["loadavg_start"])
        end = " ".join(f"{x:.2f}" for x in r["loadavg_end"])
        out.append(f"| {name} | `{r['command']}` | {r['duration_s']:.0f} s | {start} / {end} |")
    out += [
        "",
        "The load average shows how busy the machine was besides the benchmark "
        f"(a quiet {first_cores(results)}-core machine starts near 0).",
        "",
    ]
    return out


def first_cores(results: dict[str, dict[str, Any]]) -> int:
    return int(next(iter(results.values()))["machine"]["cores"])


def goals_section(results: dict[str, dict[str, Any]]) -> list[str]:
    out = [
        "## Goals",
        "",
        "Decided by each benchmark from its own figures in this run.",
        "",
        "| goal | measured | verdict |",
        "|---|---|---|",
    ]
    met = total = 0
    for r in results.values():
        for g in r["goals"]:
            total += 1
            met += bool(g["met"])
            verdict = "**met**" if g["met"] else "**not met**"
            detail = f" ({g['detail']})" if g.get("detail") else ""
            out.append(f"| {g['goal']} | {g['measured']}{detail} | {verdict} |")
    out += ["", f"{met} of {total} met.", ""]
    return out


def render(
    results: dict[str, dict[str, Any]],
    chart_name: str | None,
    previous: dict[str, dict[str, Any]] | None = None,
    rev: str = "HEAD",
) -> str:
    out = [
        "# Benchmark results",
        "",
        "<!-- Generated by `uv run python -m benchmarks.report` from benchmarks/results/*.json;"
        " do not edit by hand. -->",
        "",
        "How these were measured, and what each figure means: [README.md](README.md).",
        "",
    ]
    out += goals_section(results)
    if previous is not None:
        out += moved_section(results, previous, rev)
    out += machine_section(results)
    out += commands_section(results)
    for name, r in results.items():
        out += [f"## {SECTIONS[name]}", ""]
        if name == "server" and chart_name:
            out += [f"![Throughput against connections]({chart_name})", ""]
        out.append(f"`{r['command']}`; parameters: `{json.dumps(r['params'])}`")
        out.append("")
        for table in r["tables"]:
            out += [md_table(table)]
    return "\n".join(out).rstrip() + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog=f"python -m benchmarks.{NAME}", description=__doc__)
    parser.add_argument("--results-dir", default=str(RESULTS_DIR))
    parser.add_argument("--output", default=str(BENCH_DIR / "RESULTS.md"))
    parser.add_argument(
        "--previous",
        default="HEAD",
        metavar="REV",
        help="the git revision whose committed results are the last run (default: HEAD)",
    )
    args = parser.parse_args(argv)
    results = load(Path(args.results_dir))
    if not results:
        print(f"no results in {args.results_dir}; run the benchmarks first", file=sys.stderr)
        return 1
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    chart_name: str | None = None
    if "server" in results and chart(results["server"], output.parent / CHART):
        chart_name = CHART
        if output.parent.resolve() == BENCH_DIR.resolve():  # the docs site shows the same plot
            shutil.copyfile(output.parent / CHART, DOCS_CHART)
    output.write_text(render(results, chart_name, load_previous(args.previous), args.previous))
    print(f"wrote {output}" + (f" and {output.parent / CHART}" if chart_name else ""))
    missing = [n for n in ORDER if n not in results]
    if missing:
        print(f"missing results: {', '.join(missing)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("MPLBACKEND", "Agg")
    raise SystemExit(main())
