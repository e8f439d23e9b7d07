"""Fixtures for the beat tests: a lock server, the Redis view of one queue, beat/worker clusters.

Redis-dependent (database 12 of ``CELERY_DFLOCK_TEST_REDIS_URL``, default
``redis://127.0.0.1:6379``): without Redis these tests skip, and fail instead when
``CELERY_DFLOCK_REQUIRE_REDIS=1``.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.beats import Broker, Cluster, base_settings
from tests.support.servers import LockServer


@pytest.fixture
def queue(redis_required: None) -> str:
    return f"beat-test-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def broker(queue: str) -> Iterator[Broker]:
    view = Broker(queue)
    view.cleanup()
    view = Broker(queue)
    yield view
    view.cleanup()


@pytest.fixture
def lock_server() -> Iterator[LockServer]:
    server = LockServer()
    yield server
    server.stop()


@pytest.fixture
def make_cluster(
    tmp_path: Path, queue: str, lock_server: LockServer
) -> Iterator[Callable[..., Cluster]]:
    """``make_cluster(**setting_overrides)``: a Cluster on this test's queue and lock server."""
    clusters: list[Cluster] = []

    def make(**overrides: Any) -> Cluster:
        settings = {**base_settings(queue, lock_server.address), **overrides}
        cluster = Cluster(tmp_path, settings)
        clusters.append(cluster)
        return cluster

    yield make
    for cluster in clusters:
        cluster.close()
