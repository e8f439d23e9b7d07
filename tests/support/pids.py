"""A host that can start no more threads, for the thread nemesis of the server and the client:
the process moved into a pids cgroup of its own whose limit it is at (what a container's
``--pids-limit`` or a Kubernetes pod's pid limit does once reached). Root and a pids
controller only: the test is skipped elsewhere, with the reason."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

_HIERARCHIES = (Path("/sys/fs/cgroup/pids"), Path("/sys/fs/cgroup"))
"""Where a pids controller may be: cgroup v1's own hierarchy, or the unified (v2) one."""


def _pids_root() -> Path | None:
    v1, v2 = _HIERARCHIES
    if (v1 / "cgroup.procs").is_file():  # (its children have pids.max)
        return v1
    if "pids" in _read(v2 / "cgroup.subtree_control"):
        return v2
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


@contextlib.contextmanager
def no_more_threads(pid: int) -> Iterator[None]:
    """For the ``with`` block, process ``pid`` can start no thread or process: it is moved
    into a new pids cgroup whose limit is 1 (the threads it has keep running, and one that
    ends frees no room for another); moved back, and the cgroup removed, afterwards."""
    root = _pids_root() if os.geteuid() == 0 else None
    if root is None:
        pytest.skip("limiting a process's threads needs root and a pids cgroup controller")
    group = root / f"dflock-test-{uuid.uuid4().hex[:12]}"
    try:
        group.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot make a pids cgroup here: {exc}")
    try:
        (group / "cgroup.procs").write_text(str(pid))
        (group / "pids.max").write_text("1")
        yield
    finally:
        with contextlib.suppress(OSError):  # the process may be gone already
            (root / "cgroup.procs").write_text(str(pid))
        with contextlib.suppress(OSError):
            group.rmdir()
