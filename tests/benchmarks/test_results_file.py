"""A benchmark run in parts (``contention``, then ``contention --only busy``, one run id)
writes one results file holding both parts: the second part used to replace the first."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks._common import BenchRun, Goal, Table


def part(tmp_path: Path, run_id: str, title: str, goal: str, argv: list[str]) -> Path:
    args = argparse.Namespace(results_dir=str(tmp_path), run_id=run_id, quick=False)
    run = BenchRun("contention", args, argv, params={title: 1})
    run.tables.append(Table(title, ["a"], [["1"]]))
    run.goals.append(Goal(goal, "measured", True))
    run.data[title] = [1]
    return run.write(with_same_run=True)


def test_parts_of_one_run_share_the_file_and_a_part_run_again_replaces_its_own(
    tmp_path: Path,
) -> None:
    part(tmp_path, "R1", "handoff", "fifo", [])
    part(tmp_path, "R1", "busy", "busy keys", ["--only", "busy"])
    path = part(tmp_path, "R1", "busy", "busy keys", ["--only", "busy"])
    written = json.loads(path.read_text())
    assert [t["title"] for t in written["tables"]] == ["handoff", "busy"]
    assert [g["goal"] for g in written["goals"]] == ["fifo", "busy keys"]
    assert set(written["data"]) == {"handoff", "busy"}
    assert written["command"].count("benchmarks.contention") == 3


def test_a_new_run_id_starts_the_file_afresh(tmp_path: Path) -> None:
    part(tmp_path, "R1", "handoff", "fifo", [])
    path = part(tmp_path, "R2", "busy", "busy keys", ["--only", "busy"])
    written = json.loads(path.read_text())
    assert [t["title"] for t in written["tables"]] == ["busy"]
