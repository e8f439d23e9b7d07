"""Fixtures for the Celery tests: brokers, the run log, real worker subprocesses.

Harness API (reused by the beat and demo tests):

* ``event_log`` -- :class:`tests.support.workers.EventLog` for this test.
* ``fs_settings`` -- Celery settings for kombu's filesystem broker + file backend
  in this test's tmp dir (always available), with a unique queue name.
* ``redis_settings`` -- the same on the Redis broker/backend (db 11, unique
  queue); skips without Redis, fails instead when CELERY_DFLOCK_REQUIRE_REDIS=1.
* ``lock_server`` (tests/conftest.py) -- a started ``ServerThread`` for this test,
  lease 30 s.
* ``make_workers(settings)`` -- a :class:`tests.support.workers.WorkerFactory`;
  ``.start(app="apps.tasks", pool="prefork", concurrency=2, settings={...})``
  returns a ready :class:`tests.support.workers.Worker`; all are killed at teardown.
* ``client_app(settings)`` -- a Celery app in the test process with the same
  settings, for ``send_task`` and ``AsyncResult``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from tests.support.apps import make_app
from tests.support.services import require_redis
from tests.support.workers import (
    EventLog,
    WorkerFactory,
    close_app,
    filesystem_settings,
    redis_cleanup,
    redis_settings as _redis_settings,
)


@pytest.fixture
def queue_name() -> str:
    return f"dflock-test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def event_log(tmp_path: Path) -> Iterator[EventLog]:
    log = EventLog(tmp_path)
    yield log
    log.close()


@pytest.fixture
def fs_settings(tmp_path: Path, queue_name: str) -> dict[str, Any]:
    return filesystem_settings(tmp_path, queue_name)


@pytest.fixture
def redis_settings(queue_name: str) -> Iterator[dict[str, Any]]:
    require_redis()
    redis_cleanup(queue_name)
    yield _redis_settings(queue_name)
    redis_cleanup(queue_name)


@pytest.fixture
def make_workers(
    tmp_path: Path, event_log: EventLog
) -> Iterator[Callable[[dict[str, Any]], WorkerFactory]]:
    factories: list[WorkerFactory] = []

    def make(settings: dict[str, Any]) -> WorkerFactory:
        factory = WorkerFactory(log=event_log, directory=tmp_path, settings=settings)
        factories.append(factory)
        return factory

    yield make
    for factory in factories:
        factory.close()


@pytest.fixture
def client_app() -> Iterator[Callable[[dict[str, Any]], Celery]]:
    apps: list[Celery] = []

    def make(settings: dict[str, Any]) -> Celery:
        app = make_app("dflock-test-client", settings)
        apps.append(app)
        return app

    yield make
    for app in apps:
        close_app(app)
