"""The simulator's seed budget, its replays, and the historical defects it finds.

A failure prints its seed, the trace's last events and the command that replays it
(``uv run --no-sync python -m tests.sim --seed N --trace``; a cluster's seed with
``--cluster``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.sim.mutations import MUTATIONS
from tests.sim.result import Result
from tests.sim.run import simulate

pytestmark = pytest.mark.timeout(600)
"""A hang guard, not a bound: these tests are bounded in seeds and CPU time (the budgets
below), and a process of the suite gets about a third of a core (six on 2 cores): the cluster
defect's search, replay and control run, 40 s of CPU, took more than the suite's 120 s of
wall time in CI beside a benchmark."""

SEED_BUDGET = 300
"""Seeds each run of the suite simulates (about 30 s on one core; 300 simulated s each)."""
CLUSTER_SEED_BUDGET = 4
"""Cluster seeds each run of the suite simulates (about 4 s each on one core: the members
walk 8192 shards at every step that decides)."""
MUTATION_BUDGET_S = 60.0
"""Each defect put back is found within this many seconds of seeds (the issue's bound), counted
in this process's CPU time: what the seeds cost on one core, whatever else the machine runs
(under the suite's other processes, on 2 loaded cores, a defect found in 30 s of wall time
alone took more than 120)."""


def test_every_seed_of_the_budget_keeps_the_contracts() -> None:
    failed = [r for r in (simulate(seed) for seed in range(SEED_BUDGET)) if not r.ok]
    assert not failed, "\n\n".join(r.report() for r in failed[:3])


FAULTS = (
    "kill", "pause", "reset", "partition", "server_pause", "server_restart", "server_reboot",
    "disk_full", "disk_failing", "dir_fsync_failing", "directory fsync failed", "read timeout",
    "write failed", "fsync failed", "grant undone",
    "journal recovered", "compaction", "compaction failed", "restored", "page cache lost",
    "torn tail read", "reattached", "grant confirmed", "grant not confirmed", "reconfigured",
)  # fmt: skip
"""What the seeds do (``Result.seen``): each happens within the first 30 seeds."""


def test_the_seeds_do_every_fault_and_its_recovery() -> None:
    seen: Counter[str] = Counter()
    for seed in range(30):
        seen.update(simulate(seed).seen)
    assert not [kind for kind in FAULTS if not seen[kind]], seen


@pytest.fixture(scope="module")
def cluster_seeds() -> list[Result]:
    """The cluster seeds of the budget, run once for the tests that judge them."""
    return [simulate(seed, cluster=True) for seed in range(CLUSTER_SEED_BUDGET)]


def test_every_cluster_seed_of_the_budget_keeps_the_contracts(
    cluster_seeds: list[Result],
) -> None:
    failed = [r for r in cluster_seeds if not r.ok]
    assert not failed, "\n\n".join(r.report() for r in failed[:3])


CLUSTER_FAULTS = (
    "member_kill", "member_reboot", "member_pause", "etcd_partition", "etcd_stall",
    "etcd_outage", "member_leave", "member_join", "kill", "pause", "partition", "reset",
    "ticket replayed", "etcd lease expired", "etcd answer lost",
    "member fenced itself", "handover", "failover", "released takeover", "error_ask",
    "asking admitted", "asking refused", "redirected", "map read", "lease bound published",
    "lease bound refused",
)  # fmt: skip
"""What a cluster's seeds do (``Result.seen``): each happens within the budget's seeds."""


def test_the_cluster_seeds_do_every_fault_and_its_recovery(cluster_seeds: list[Result]) -> None:
    seen: Counter[str] = Counter()
    for result in cluster_seeds:
        seen.update(result.seen)
    assert not [kind for kind in CLUSTER_FAULTS if not seen[kind]], seen


def test_a_seed_replays_exactly() -> None:
    first, again, other = simulate(7), simulate(7), simulate(8)
    assert first.digest == again.digest
    assert first.trace == again.trace
    assert first.digest != other.digest
    assert first.grants > 0


HASH_DEPENDENT_SEED = 863
"""A seed whose server restarts without sessions a keep-alive can keep, while locks are held on
one: where the client session's holders were a set, told in their addresses' order (which
string hashing moves), its trace changed with ``PYTHONHASHSEED``."""


def test_a_seed_replays_exactly_in_any_process() -> None:
    """A failure's replay command runs in a new process: the trace must not depend on it."""
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "tests.sim", "--seed", str(HASH_DEPENDENT_SEED)]
    digests = {
        subprocess.run(
            command,
            cwd=root,
            env={**os.environ, "PYTHONHASHSEED": str(hash_seed)},
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        )
        .stdout.split("trace digest ")[1]
        .split()[0]
        for hash_seed in range(4)
    }
    assert digests == {simulate(HASH_DEPENDENT_SEED).digest}


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_each_defect_put_back_is_found_and_replays(name: str) -> None:
    started = time.process_time()
    seed = 0
    found = None
    while time.process_time() - started < MUTATION_BUDGET_S:
        result = simulate(seed, name)
        if not result.ok:
            found = result
            break
        seed += 1
    assert found is not None, f"{name}: not found in {seed} seeds ({MUTATION_BUDGET_S:g} s)"
    assert f"--seed {found.seed} --mutation {name}" in found.report()
    replayed = simulate(found.seed, name)
    assert replayed.digest == found.digest
    assert replayed.violations == found.violations
    # the same seed and scenario with the switch off keeps the contracts: the defect is
    # what was found
    assert simulate(found.seed, name, control=True).ok


def test_the_command_line_replays_a_seed_and_runs_seeds_for_a_while() -> None:
    """``python -m tests.sim`` as docs/testing.md shows it (``--hours`` cut to a second)."""
    root = Path(__file__).resolve().parents[2]
    one = subprocess.run(
        [sys.executable, "-m", "tests.sim", "--seed", "7", "--trace"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert f"seed 7: ok, trace digest {simulate(7).digest}" in one.stdout
    assert "replay: uv run --no-sync python -m tests.sim --seed 7" in one.stdout
    timed = subprocess.run(
        [sys.executable, "-m", "tests.sim", "--hours", "0.0003", "--first", "100"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert "seeds from 100: 0 failed" in timed.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "tests.sim", "--seeds", "3", "--mutation", "fence-from-wall-clock"],
        cwd=root,
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert bad.returncode == 1 and "--mutation fence-from-wall-clock" in bad.stdout
    cluster = subprocess.run(
        [sys.executable, "-m", "tests.sim", "--cluster", "--seed", "1", "--duration", "20"],
        cwd=root,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    digest = simulate(1, duration=20, cluster=True).digest
    assert f"seed 1: ok, trace digest {digest}" in cluster.stdout
