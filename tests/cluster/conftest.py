"""Fixtures of the cluster tests: a private, real etcd per module (``tests.support.etcd``) and
a key prefix of each test's own."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from dflockd_server.cluster.etcd import EtcdClient
from tests.support.etcd import EtcdServer, etcd_or_skip


@pytest.fixture(scope="module")
def etcd_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """A private etcd for the module's tests (each test works under its own ``etcd_prefix``)."""
    yield from etcd_or_skip(tmp_path_factory.mktemp("etcd"))


@pytest.fixture
def etcd(etcd_server: EtcdServer) -> EtcdClient:
    return etcd_server.client()


@pytest.fixture
def etcd_prefix() -> str:
    """A key prefix of the test's own, so tests sharing one etcd do not see each other."""
    return f"/test-{uuid.uuid4().hex[:12]}/"
