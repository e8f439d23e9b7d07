# pyright: reportAttributeAccessIssue=false, reportCallIssue=false, reportFunctionMemberAccess=false
# (Celery's @app.task is untyped: pyright takes a task for the plain function it decorates.)
"""A task defined without LockedTask, locked only by ``dflock_task_locks`` in the settings."""

from __future__ import annotations

import time

from celery import current_task

from celery_dflock.signals import install, lock_skipped

from .common import record, record_skipped, wait_for_release, worker_app

app = worker_app("apps.plain")
install(app)  # the one line a project adds to lock tasks it cannot edit
lock_skipped.connect(record_skipped)


@app.task
def third_party_report(customer_id: int, hold: float = 0.0, release_file: str | None = None) -> int:
    """Stands for a task in a library the project cannot change. Runs ``hold`` seconds, then
    until ``release_file`` exists (if given): a test that must see a second call meet the held
    key ends the first only once it has, as a timed hold can end first on a loaded machine."""
    record(
        "plain_run",
        customer_id=customer_id,
        fence=current_task.request.dflock_fence,
        task_id=current_task.request.id,
    )
    time.sleep(hold)
    wait_for_release(release_file)
    return customer_id
