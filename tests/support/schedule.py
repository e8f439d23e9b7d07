"""The order the suite's files are handed to pytest-xdist's processes in: the longest first.

The suite runs with ``-n 4 --dist loadfile`` (pyproject.toml): each file goes whole to one
process, and a process takes the next file when it is done with its own. Left to itself, xdist
hands the files out by their number of tests, most first, which puts the suite's longest files
(a handful of tests each, a minute or more per test: the cluster's fault runs, the packaging
tests' wheel builds) at the very end, where a process that draws one runs on alone after the
others are done. So the suite turns that reordering off (``--no-loadscope-reorder``) and orders
the files itself: the files of ``LONGEST_FILES`` first, in that order, then every other file by
its number of tests, most first, as xdist would. The tests of a file keep their order.

On CI's 2 cores, saturated for the whole main suite, the order gained little (2026-11-27: the
file durations summed to 4,643 s over 4 processes, about 19.4 minutes each, and the main suite
took 20:20): it bounds the tail when the machine has cores to spare.
"""

from __future__ import annotations

from typing import Final

import pytest

LONGEST_FILES: Final = (
    "tests/test_packaging.py",
    "tests/faults/test_cluster_moves.py",
    "tests/faults/test_cluster_nemeses.py",
    "tests/faults/test_cluster_restarts.py",
    "tests/cluster/test_cluster_client_handover.py",
    "tests/server/test_compiled.py",
    "tests/faults/test_cluster_faults.py",
    "tests/beat/test_shared_schedule_file.py",
)
"""The files that take longest, longest first (measured in CI, in the durations it prints).
``tests/server/test_compiled.py`` waits for the wheels ``tests/test_packaging.py`` builds
(``built_dist``, shared by the processes), so it comes a few files after it."""


def longest_first(items: list[pytest.Item]) -> None:
    """Order ``items`` in place as the module's doc says."""
    by_file: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    rank = {path: i for i, path in enumerate(LONGEST_FILES)}
    files = sorted(by_file, key=lambda path: (rank.get(path, len(rank)), -len(by_file[path])))
    items[:] = [item for path in files for item in by_file[path]]
