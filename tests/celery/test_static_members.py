# pyright: reportAttributeAccessIssue=false, reportCallIssue=false, reportFunctionMemberAccess=false
# (Celery's @app.task is untyped: pyright takes a task for the plain function it decorates.)
"""Static members in Celery (issue 16, acceptance 4): a worker whose ``dflock_servers``
disagree with the servers' ``--members`` gets a clear error naming both lists; one whose list
agrees spreads its keys over every server. Real servers, LockedTask runs in this process;
``celery dflock shards`` through the app's settings."""

from __future__ import annotations

import zlib
from typing import Any

from celery import Celery

from celery_dflock import LockedTask, ShardingMismatchError
from celery_dflock.cli import collect_shards, format_shards, shards_json
from celery_dflock.config import get_config
from dflockd_server.testing import ServerThread
from tests.support.apps import make_app


def static_app(servers: list[tuple[str, int]], **conf: Any) -> Celery:
    return make_app("static", eager=True, servers=servers, task_store_eager_result=True, **conf)


def test_a_locked_task_on_a_disagreeing_list_fails_naming_both_lists(
    static_fleet: list[ServerThread],
) -> None:
    servers = [s.address for s in static_fleet]
    app = static_app(servers[::-1])

    @app.task(shared=False, base=LockedTask, lock_key="static:{n}", on_locked="raise")
    def job(n: int) -> int:
        return n

    failed = 0
    for n in range(12):
        result = job.apply(args=(n,))
        if result.failed():
            failed += 1
            error = result.result
            assert isinstance(error, ShardingMismatchError)
            message = str(error)
            assert "dflock_servers" in message
            assert "--members " + ",".join(f"{h}:{p}" for h, p in servers) in message
            assert ",".join(f"{h}:{p}" for h, p in servers[::-1]) in message
        else:
            assert result.result == n  # the keys both lists give to the same server
    assert failed > 0


def test_a_locked_task_on_the_agreeing_list_runs_on_every_server(
    static_fleet: list[ServerThread],
) -> None:
    servers = [s.address for s in static_fleet]
    app = static_app(servers)
    seen: set[tuple[str, int]] = set()

    @app.task(shared=False, bind=True, base=LockedTask, lock_key="static:{n}")
    def job(self: LockedTask, n: int) -> int:
        assert self.lock is not None
        seen.add(self.lock.server)
        assert self.lock.server == servers[zlib.crc32(f"static:{n}".encode()) % 3]
        return n

    for n in range(12):
        assert job.apply(args=(n,)).get() == n
    assert seen == set(servers)


def test_celery_dflock_shards_reports_every_server(static_fleet: list[ServerThread]) -> None:
    servers = [s.address for s in static_fleet]
    answers = collect_shards(get_config(static_app(servers)))
    members = [f"{h}:{p}" for h, p in servers]
    assert [a.shards.members if a.shards else None for a in answers] == [tuple(members)] * 3
    shown = format_shards(answers)
    for member in members:
        assert f"{member}: mode static, self {member}, members {','.join(members)}" in shown
    rows = shards_json(answers)
    assert [row["mode"] for row in rows] == ["static"] * 3
    assert [row["server"] for row in rows] == members  # as `status --json` names a server


def test_the_cluster_strategy_is_a_setting() -> None:
    config = get_config(static_app([("127.0.0.1", 1)], dflock_sharding_strategy="cluster"))
    assert config.client.sharding_strategy == "cluster"
    with config.new_client() as client:
        assert client.router is not None
        assert client.settings.sharding_strategy == "cluster"
