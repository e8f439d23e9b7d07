# pyright: reportMissingTypeStubs=false, reportAttributeAccessIssue=false, reportUnknownMemberType=false, reportUnknownVariableType=false, reportUnknownArgumentType=false, reportGeneralTypeIssues=false
# (Celery's @app.task and Django's managers and transaction.atomic are untyped.)
"""A locked task sent when Django's transaction commits (``delay_on_commit``,
``apply_async_on_commit``, as a Django project's other tasks have them from Celery's
``DjangoTask``), run by a real worker: nothing is sent before the commit, nothing on a rollback.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_dflock import LockedTask
from dflockd_server import Config
from tests.fencing.stores import CREDIT, SCHEMA_ENV
from tests.support.rigs import open_rig, unique
from tests.support.services import require_redis
from tests.support.workers import redis_cleanup, redis_settings

pytestmark = pytest.mark.slow

EVENT_TIMEOUT_S = 60.0


class RolledBack(Exception):
    pass


def _sender(app: Celery) -> dict[str, Any]:
    """``fencing_app.credit`` as the sending side declares it: a ``LockedTask`` (the worker's
    own body runs)."""

    def credit(store: str, account: int, label: str, go_file: str | None = None) -> int:
        raise AssertionError("runs on the worker")

    task = app.task(base=LockedTask, name=CREDIT, lock_key="fencing:{store}:{account}")(credit)
    return {"credit": task}


def _waiting(broker_url: str, queue: str) -> int:
    """Messages in ``queue`` (kombu's Redis transport keeps them in a list of its name)."""
    with redis.Redis.from_url(broker_url) as broker:
        return int(broker.llen(queue))


def test_a_locked_task_is_sent_when_the_django_transaction_commits(
    django_schema: str, tmp_path: Path
) -> None:
    from django.db import transaction

    from tests.fencing.models import Account

    require_redis()
    Account.objects.create(id=1, balance=0)
    queue = unique("on-commit")
    settings = redis_settings(queue)
    with open_rig(
        tmp_path,
        "tests.fencing.fencing_app",
        settings,
        server=Config(host="127.0.0.1", port=0),
        define_tasks=_sender,
        cleanup=lambda: redis_cleanup(queue),
    ) as rig:
        credit = rig.tasks["credit"]
        run = {"store": "django", "account": 1}
        with contextlib.suppress(RolledBack), transaction.atomic():
            credit.delay_on_commit(**run, label="rolled-back")
            raise RolledBack
        with transaction.atomic():
            credit.apply_async_on_commit(kwargs={**run, "label": "committed"})
            assert _waiting(settings["broker_url"], queue) == 0  # not before the commit
        assert _waiting(settings["broker_url"], queue) == 1  # the committed one alone

        rig.start_worker(concurrency=1, env={SCHEMA_ENV: django_schema})
        applied = rig.log.wait_event("applied", EVENT_TIMEOUT_S, label="committed")
        assert applied["fence"] is not None and not applied["lost"]
        assert Account.objects.get(pk=1).balance == 1
        assert not rig.log.entries("granted", label="rolled-back")
