# pyright: reportAttributeAccessIssue=false, reportCallIssue=false, reportFunctionMemberAccess=false
# (Celery's @app.task is untyped: pyright takes a task for the plain function it decorates.)
"""``autoretry_for`` on an error taking the lock, in a real worker (celery.contrib.pytest's, on
the memory broker) against a real lock server: the run retries as Celery's own autoretry
retries an error of the body (celery/app/autoretry.py), ``max_retries`` included."""

from __future__ import annotations

from typing import Any

import pytest
from celery import Celery
from celery.signals import task_prerun, task_retry

from celery_dflock import LockedTask, ServerUnavailable
from dflockd_server.testing import ServerThread

pytest_plugins = ("celery.contrib.pytest",)

RESULT_TIMEOUT_S = 30.0


@pytest.fixture
def celery_config(dflock_celery_config: dict[str, Any]) -> dict[str, Any]:
    return {"broker_url": "memory://", "result_backend": "cache+memory://", **dflock_celery_config}


def test_an_autoretried_lock_error_keeps_the_max_retries_a_retry_gave(
    celery_app: Celery, celery_worker: Any, dflock_server: ServerThread
) -> None:
    """A body's ``self.retry(max_retries=3)`` overrides the task's ``max_retries=1`` for
    Celery's autoretry (``override_max_retries``): the lock server then down, the retries'
    ServerUnavailable taking the lock is retried up to 3 times, as an error of the body would
    be. Before, the lock's autoretry used ``max_retries=1``: the run failed after one retry."""
    attempts: list[int] = []

    @celery_app.task(
        shared=False,
        bind=True,
        base=LockedTask,
        lock_key="override-max-retries",
        autoretry_for=(ServerUnavailable,),
        retry_kwargs={"countdown": 0},
        max_retries=1,
    )
    def job(self: LockedTask) -> None:
        raise self.retry(max_retries=3, countdown=0)

    def count(sender: Any = None, **_: Any) -> None:
        if sender is job:
            attempts.append(int(job.request.retries or 0))

    def stop_server(sender: Any = None, **_: Any) -> None:
        if sender is job and len(attempts) == 1:  # the body's retry sent, its lock released
            dflock_server.stop()

    task_prerun.connect(count, weak=False)
    task_retry.connect(stop_server, weak=False)
    try:
        celery_worker.reload()
        result = job.delay()
        with pytest.raises(ServerUnavailable):
            result.get(timeout=RESULT_TIMEOUT_S)
    finally:
        task_prerun.disconnect(count)
        task_retry.disconnect(stop_server)
    assert attempts == [0, 1, 2, 3]
