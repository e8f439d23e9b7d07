"""The order the suite's files are handed to pytest-xdist's processes in: the longest first.

The suite runs with ``-n 6 --dist loadfile`` (pyproject.toml): each file goes whole to one
process, and a process takes the next file when it is done with its own. Left to itself, xdist
hands the files out by their number of tests, most first, which puts the suite's longest files
(a handful of tests each, a minute or more per test: the cluster's fault runs, the packaging
tests' wheel builds) at the very end, where a process that draws one runs on alone after the
others are done. So the suite turns that reordering off (``--no-loadscope-reorder``) and orders
the files itself: the files of ``LONGEST_FILES`` first, in that order, then every other file by
its number of tests, most first, as xdist would, with ``AFTER_THE_BUILD`` put in among them. The
tests of a file keep their order.

On CI's 2 cores, saturated for the whole main suite, the order gained little (2026-11-27: the
file durations summed to 4,643 s over 4 processes, about 19.4 minutes each, and the main suite
took 20:20): it bounds the tail when the machine has cores to spare.
"""

from __future__ import annotations

from typing import Final

import pytest

LONGEST_FILES: Final = (
    "tests/test_packaging.py",  # it builds the wheels first
    "tests/cluster/test_cluster_sessions.py",  # about 270 s (alone at -n 2, 2026-11-30)
    "tests/celery/test_outage.py",  # 204 s
    "tests/cluster/test_cluster_server.py",  # 169 s
    "tests/cluster/test_node.py",  # 116 s
    "tests/beat/test_singleton_beat.py",  # 112 s
    "tests/faults/test_lock_faults.py",  # 94 s
    "tests/faults/test_cluster_nemeses.py",  # 92 s
    "tests/faults/test_journal_nemeses.py",  # 84 s
    "tests/cluster/test_cluster_client_handover.py",  # 83 s
    "tests/sim/test_simulation.py",  # 82 s
    "tests/cluster/test_etcd_ha.py",  # 79 s
    "tests/faults/test_cluster_restarts.py",  # 79 s
    "tests/celery/test_locked_task_lost.py",  # 75 s
    "tests/client/test_client_reattach.py",  # 68 s
    "tests/cluster/test_membership.py",  # 63 s
    "tests/client/test_client_faces.py",  # 59 s
    "tests/faults/test_celery_faults.py",  # 56 s
    "tests/client/test_client_session.py",  # 55 s
    "tests/benchmarks/test_benchmarks_smoke.py",  # 48 s
    "tests/celery/test_queue_once_brokers.py",  # 46 s
    "tests/faults/test_cluster_moves.py",  # 41 s
    "tests/faults/test_abuse.py",  # 38 s
    "tests/celery/test_locked_task_endings.py",  # 35 s
    "tests/client/test_client_renewal.py",  # 33 s
    "tests/demo/test_demo_command.py",  # 32 s
    "tests/server/test_lease_promise.py",  # 27 s
    "tests/beat/test_beat_stores.py",  # 26 s
    "tests/beat/test_shared_schedule_file.py",  # 23 s
    "tests/celery/test_locked_task_exclusion.py",  # 23 s
    "tests/celery/test_queue_once_edges.py",  # 23 s
    "tests/fencing/test_paused_holder.py",  # 23 s
    "tests/examples/test_examples.py",  # 22 s
    "tests/server/test_journal_faults.py",  # 21 s
    "tests/test_user_project.py",  # 16 s
    "tests/cluster/test_lease_publish.py",  # 15 s
    "tests/faults/test_fuzz.py",  # 15 s
    "tests/interop/test_interop_celery.py",  # 14 s
    "tests/celery/test_cluster_workers.py",  # 11 s
)
"""The files that take longest, longest first (with their durations as measured alone in a
fresh clone on 2 cores, 2026-11-29, from ``--junitxml``): every file of 20 s or more, and the
files of a few long tests, which the order by number of tests would put last."""

AFTER_THE_BUILD: Final = "tests/server/test_compiled.py"
"""Waits for the wheels ``tests/test_packaging.py`` builds first (``built_dist``, shared by the
processes: a C build of one to two minutes): handed out as the ``BUILD_LEAD``-th file, not among
the first, so that no process sits idle waiting for the build."""
BUILD_LEAD: Final = 16


def longest_first(items: list[pytest.Item]) -> None:
    """Order ``items`` in place as the module's doc says."""
    by_file: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    rank = {path: i for i, path in enumerate(LONGEST_FILES)}
    files = sorted(by_file, key=lambda path: (rank.get(path, len(rank)), -len(by_file[path])))
    if AFTER_THE_BUILD in files:
        files.remove(AFTER_THE_BUILD)
        files.insert(min(BUILD_LEAD, len(files)), AFTER_THE_BUILD)
    items[:] = [item for path in files for item in by_file[path]]
