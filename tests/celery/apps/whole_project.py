# pyright: reportAttributeAccessIssue=false, reportCallIssue=false, reportFunctionMemberAccess=false
# (Celery's @app.task is untyped: pyright takes a task for the plain function it decorates.)
"""A whole project on ``task_cls="celery_dflock:LockedTask"`` (docs/locked-tasks.md, "A whole
project") whose tasks use Celery's own retry options (``retry_backoff_max``, ``retry_jitter``,
``max_retries``): one locked, one not. Each fails its first run and succeeds on its retry, so a
result shows that Celery's options reached Celery (issue 50: they were refused as misspelt lock
options, and the app could not load)."""

from __future__ import annotations

from typing import Any

from tests.support.apps import make_app

from .common import record, settings_from_env

app = make_app(
    "apps.whole_project",
    settings_from_env(),
    celery_kwargs={"task_cls": "celery_dflock:LockedTask"},
)


class FirstRunFails(Exception):
    """Raised by a task's first run, so that ``autoretry_for`` sends it again."""


@app.task(
    bind=True,
    lock_key="export:{report_id}",
    autoretry_for=(FirstRunFails,),
    retry_backoff=True,
    retry_backoff_max=600,
    retry_jitter=False,
    max_retries=3,
)
def export(self: Any, report_id: int) -> str:
    """Locked (it has a lock option)."""
    record(
        "export_run", retries=self.request.retries, key=getattr(self.request, "dflock_key", None)
    )
    if self.request.retries == 0:
        raise FirstRunFails(report_id)
    return f"exported {report_id}"


@app.task(
    bind=True,
    autoretry_for=(FirstRunFails,),
    retry_backoff=1,
    retry_backoff_max=600,
    retry_jitter=False,
)
def ping(self: Any) -> str:
    """Not locked (no lock option)."""
    record("ping_run", retries=self.request.retries, key=getattr(self.request, "dflock_key", None))
    if self.request.retries == 0:
        raise FirstRunFails
    return "pong"
