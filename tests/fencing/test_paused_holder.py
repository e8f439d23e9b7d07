"""The paused holder, on real prefork workers, for each fenced store and write (PostgreSQL
through Django and through SQLAlchemy, an update and an insert-or-update each; SQLAlchemy's
asyncio face; Redis, blocking and ``redis.asyncio``; the asyncio ones from an async task body),
all on one pair of workers: a run of ``fencing_app.credit`` on worker A holds its
account with a 2 s lease; A's process group is stopped (SIGSTOP) past the lease; a run on
worker B gets the lock and writes; A resumes (SIGCONT) and writes with its old fence. The store
refuses that write (nothing of it lands: the account has B's write alone), and A's run fails
with `StaleFence`, which its result carries.

A's body is held at a go file between its grant and its write, and let go while A is stopped:
A writes as soon as it resumes, before (or while) its renewal thread learns of the loss
(``on_lock_lost="flag"``), so only the store's fence stands between it and a stale write.
"""

from __future__ import annotations

import contextlib
import itertools
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import sqlalchemy as sa

from celery_dflock.fencing import StaleFence
from dflockd_server import Config
from tests.fencing.stores import (
    ACCOUNTS,
    CREDIT,
    SCHEMA_ENV,
    STORE_REDIS_URL,
    create_schema,
    drop_schema,
    engine_for,
    new_schema_name,
    redis_key,
)
from tests.support.processes import signal_group
from tests.support.rigs import Rig, open_rig, unique
from tests.support.services import require_postgres, require_redis
from tests.support.workers import Worker, redis_cleanup, redis_settings

pytestmark = pytest.mark.slow

EVENT_TIMEOUT_S = 60.0
"""Generous: the machine is shared and loaded."""
ACCOUNTS_SEEN = itertools.count(1)


class PausedRig(Rig):
    engine: sa.Engine | None = None
    worker_a: Worker | None = None
    queue_a: str = ""
    queue_b: str = ""
    schema: str = ""


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PausedRig]:
    require_postgres()
    require_redis()
    schema = new_schema_name()
    create_schema(schema)
    queue = unique("fencing")
    queue_a, queue_b = f"{queue}-a", f"{queue}-b"
    settings = {**redis_settings(queue), "dflock_renew_ratio": 0.5}
    try:
        with open_rig(
            tmp_path_factory.mktemp("paused"),
            "tests.fencing.fencing_app",
            settings,
            server=Config(host="127.0.0.1", port=0, shutdown_timeout_s=2.0),
            rig_class=PausedRig,
            cleanup=lambda: [redis_cleanup(q) for q in (queue, queue_a, queue_b)],
        ) as made:
            env = {SCHEMA_ENV: schema}
            made.worker_a = made.start_worker(
                settings={"task_default_queue": queue_a}, concurrency=1, env=env
            )
            made.start_worker(settings={"task_default_queue": queue_b}, concurrency=1, env=env)
            made.queue_a, made.queue_b, made.schema = queue_a, queue_b, schema
            made.engine = engine_for(schema)
            try:
                yield made
            finally:
                made.engine.dispose()
    finally:
        drop_schema(schema)


@contextlib.contextmanager
def stopped(worker: Worker) -> Iterator[None]:
    """SIGSTOP the worker's whole process group (main process and pool child); SIGCONT it on
    the way out."""
    signal_group(worker.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        signal_group(worker.proc.pid, signal.SIGCONT)


def sql_state(engine: sa.Engine, table: str, account: int) -> tuple[int, int]:
    with engine.connect() as db:
        found = db.execute(
            sa.text(f"SELECT balance, dflock_fence FROM {table} WHERE id = :id"), {"id": account}
        ).one()
    return int(found[0]), int(found[1])


TABLES = {
    "django": "fencing_account",
    "django-upsert": "fencing_account",
    "sqlalchemy": ACCOUNTS.name,
    "sqlalchemy-upsert": ACCOUNTS.name,
    "sqlalchemy-aio": ACCOUNTS.name,
}
"""The table each SQL store writes (the Redis ones write a hash)."""
UPSERTS = frozenset({"django-upsert", "sqlalchemy-upsert", "sqlalchemy-aio"})
"""The stores whose write inserts the row: no row before the runs (the later run's inserts it)."""


@pytest.mark.parametrize(
    "store",
    ["django", "sqlalchemy", "redis", *sorted(UPSERTS), "redis-aio"],
)
def test_a_holder_paused_past_its_lease_is_refused_by_the_store(rig: PausedRig, store: str) -> None:
    assert rig.engine is not None and rig.worker_a is not None
    account = next(ACCOUNTS_SEEN)
    table = TABLES.get(store)
    if table is not None and store not in UPSERTS:
        with rig.engine.begin() as db:
            db.execute(
                sa.text(f"INSERT INTO {table} (id, balance) VALUES (:id, 0)"), {"id": account}
            )
    label_a, label_b = f"{store}-{account}-a", f"{store}-{account}-b"
    go = Path(rig.tmp) / f"go-{label_a}"
    run: dict[str, Any] = {"store": store, "account": account}
    result_a = rig.app.send_task(
        CREDIT, kwargs={**run, "label": label_a, "go_file": str(go)}, queue=rig.queue_a
    )
    granted_a = rig.log.wait_event("granted", EVENT_TIMEOUT_S, label=label_a)
    with stopped(rig.worker_a):
        result_b = rig.app.send_task(CREDIT, kwargs={**run, "label": label_b}, queue=rig.queue_b)
        applied_b = rig.log.wait_event("applied", EVENT_TIMEOUT_S, label=label_b)
        go.touch()  # A goes straight on to its write when it resumes
    assert result_b.get(timeout=EVENT_TIMEOUT_S) == 1
    assert applied_b["fence"] > granted_a["fence"]

    # A's run fails, and says why: the store refused its stale write.
    result_a.get(timeout=EVENT_TIMEOUT_S, propagate=False)
    assert result_a.state == "FAILURE", result_a.result
    refusal = result_a.result
    assert isinstance(refusal, StaleFence), repr(refusal)
    assert f"its fence {granted_a['fence']} is lower than {applied_b['fence']}" in str(refusal)
    assert not rig.log.entries("applied", label=label_a)

    # 0 stale writes: the store holds B's write alone, under B's fence.
    if table is not None:
        assert sql_state(rig.engine, table, account) == (1, applied_b["fence"])
    else:
        with redis.Redis.from_url(STORE_REDIS_URL) as client:
            key = redis_key(rig.schema, account)
            assert client.hget(key, "writer") == label_b.encode()
            assert int(client.hget(key, "dflock_fence") or 0) == applied_b["fence"]
            assert client.get(f"{key}:writes") == b"1"
            client.delete(key, f"{key}:writes")
