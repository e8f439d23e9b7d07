"""Smoke run of ``benchmarks.held`` (issue 69, acceptance 1) at tiny sizes: both sides of its
A/B (A: this clone's HEAD extracted by the benchmark, B: the working tree), each with a process
holding a few locks and a gevent worker running a few plain and a few locked sleeping tasks, all
at once over one short window. The test checks that every figure is produced and sane: each
side ran its own code, no lock was lost, every key was still held at the window's end, CPU and
write figures non-negative, the tables and goals in shape. No timing is asserted: the figures
of a smoke run mean nothing."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from tests.support.services import unavailable

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 90


def test_held_benchmark_measures_both_sides_and_loses_no_lock(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        unavailable("redis-server is not on PATH (the benchmark starts its own broker)")
    command = [sys.executable, "-m", "benchmarks.held", "--quick", "--baseline", "HEAD"]
    proc = subprocess.run(
        [*command, "--results-dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "held.json").read_text())
    assert r["benchmark"] == "held" and r["quick"] is True
    data = r["data"]

    sides = data["sides"]
    assert set(sides) == {"A", "B"}
    for name, side in sides.items():  # each side's processes imported that side's packages
        assert set(side["imports"]) == {"celery_dflock", "dflockd_server"}
        assert all(f"site-{name}" in path for path in side["imports"].values()), side
    assert sides["B"]["source"] == str(REPO)

    sizes = r["params"]["locks"]
    holding = data["holding"]
    assert sorted((h["side"], h["locks"]) for h in holding) == sorted(
        (side, n) for side in "AB" for n in sizes
    )
    for h in holding:
        assert h["lost"] == 0 and h["not_owned"] == 0, h
        assert h["held_at_end"] == h["locks"] and h["released"] == h["locks"], h
        assert h["window_s"] > 0, h
        for figure in ("server_cpu_pct", "holder_cpu_pct", "server_write_bytes_per_min"):
            assert h[figure] >= 0, (figure, h)
        assert h["server_wchar_per_min"] >= 0, h  # (a 1 s window may hold no renewal at all)
        assert h["holder_threads"] >= 1, h

    tasks = r["params"]["gevent_tasks"]
    keeping = data["keeping"]
    assert sorted((k["side"], k["variant"]) for k in keeping) == [
        (side, variant) for side in "AB" for variant in ("LockedTask", "plain")
    ]
    for k in keeping:
        assert k["tasks"] == tasks and k["ended_early"] == 0, k
        assert k["worker_cpu_pct"] >= 0 and k["ramp_s"] > 0, k
        assert k["held_at_end"] == (tasks if k["variant"] == "LockedTask" else -1), k

    assert len(r["tables"]) == 2
    for table in r["tables"]:
        assert len(table["rows"]) >= 2, table["title"]  # a row per side at least
        for row in table["rows"]:
            assert len(row) == len(table["columns"]), (table["title"], row)
        assert table["title"] in proc.stdout, "the table was not printed"
    assert len(r["goals"]) == 4
    for goal in r["goals"]:
        assert isinstance(goal["met"], bool) and goal["measured"].startswith("side B"), goal
        assert "issue 69" in goal["goal"], goal
