# pyright: reportAttributeAccessIssue=false, reportCallIssue=false, reportFunctionMemberAccess=false
# (Celery's @app.task is untyped: pyright takes a task for the plain function it decorates.)
"""The user-facing pytest plugin, used as docs/testing.md shows (with celery.contrib.pytest)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_dflock import DistributedLock, LockedTask

pytest_plugins = ("celery.contrib.pytest",)


@pytest.fixture
def celery_config(dflock_celery_config: dict[str, Any]) -> dict[str, Any]:
    return {"broker_url": "memory://", "result_backend": "cache+memory://", **dflock_celery_config}


def test_celery_worker_runs_a_locked_task_against_dflock_server(
    celery_app: Celery, celery_worker: Any, dflock_server: Any
) -> None:
    @celery_app.task(shared=False, bind=True, base=LockedTask, lock_key="plugin:{n}")
    def job(self: LockedTask, n: int) -> int | None:
        return self.request.dflock_fence

    celery_worker.reload()
    fence = job.delay(1).get(timeout=10)
    assert isinstance(fence, int)
    lock = DistributedLock("plugin:1", acquire_timeout_s=0, servers=[dflock_server.address])
    assert lock.acquire()  # released after the run
    lock.release()


def test_dflock_configure_points_an_existing_app(dflock_configure: Any, dflock_server: Any) -> None:
    app = dflock_configure(Celery("mine", set_as_current=False))
    assert app.conf.dflock_servers == f"{dflock_server.host}:{dflock_server.port}"


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one-process", "xdist"])
def test_without_the_server_extra_the_fixtures_stop_the_run_saying_so(
    tmp_path: Path, workers: list[str]
) -> None:
    """docs/testing.md: without ``celery-dflock[server]`` the fixtures stop the run, with an
    error naming the extra (in one process: one error, the run not going on), also under
    pytest-xdist, whose workers do not carry a ``pytest.exit`` message back."""
    (tmp_path / "sitecustomize.py").write_text(  # read by the xdist workers too
        "import sys\n\nsys.modules['dflockd_server'] = None  # not installed\n"
    )
    (tmp_path / "test_user.py").write_text(
        "def test_one(dflock_server):\n    pass\n\n\ndef test_two(dflock_server):\n    pass\n"
    )
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:randomly", "-q"]
        + (workers or ["-p", "no:xdist"]),
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    said = run.stdout + run.stderr
    assert run.returncode != 0, said
    assert "INTERNALERROR" not in said, said
    assert "install celery-dflock's `server` extra" in said, said
    if not workers:
        assert re.search(r"\b1 error in ", said), said  # (the summary repeats it under CI)
        assert "test_two" not in said, said
