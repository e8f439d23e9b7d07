"""Smoke run of ``benchmarks.restart`` (issue 52) at a tiny size: a dflockd and a Redis each
take leases, are killed with SIGKILL and started again with the same command; the run checks
that each came back with every lease (a held key refused, a fresh one granted) and writes its
table and goals. No timing is asserted: the figures of a smoke run mean nothing."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from tests.support.services import unavailable

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 120


def test_restart_benchmark_restores_every_lease_and_decides_its_goal(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:
        unavailable("redis-server is not on PATH (the benchmark starts its own)")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.restart", "--quick", "--results-dir", str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads((tmp_path / "restart.json").read_text())
    assert r["benchmark"] == "restart" and r["quick"] is True
    leases = r["params"]["leases"]
    rounds = r["data"]["rounds"]
    assert {x["server"] for x in rounds} == set(r["params"]["servers"])
    for x in rounds:
        assert x["restored"] == leases, x
        assert 0 < x["listening_s"] <= x["answering_s"] <= x["consistent_s"], x
        assert x["rss_before"] > 0 and x["rss_after"] > 0, x
    (table,) = r["tables"]
    assert len(table["rows"]) == len(r["params"]["servers"])
    for row in table["rows"]:
        assert len(row) == len(table["columns"])
    assert r["goals"]
    for goal in r["goals"]:
        assert isinstance(goal["met"], bool) and goal["measured"]
