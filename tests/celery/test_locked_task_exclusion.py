"""Mutual exclusion on real workers (acceptance 1), renewal (2) and config-only locking (6)."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_dflock import LockSkipped
from celery_dflock.client import DistributedLock
from dflockd_server.testing import ServerThread
from tests.support.workers import Entry, EventLog, WorkerFactory, iter_overlaps, with_server

KEYS = 5
RUN_TIMEOUT_S = 120.0


def send_batch(app: Celery, task: str, count: int, **kwargs: Any) -> list[str]:
    ids: list[str] = []
    for n in range(count):
        result = app.send_task(f"apps.tasks.{task}", (n, n % KEYS), kwargs)
        ids.append(result.id)
    return ids


def assert_exclusive(runs: list[Entry]) -> None:
    """No two runs of one key overlap, and fences grow in the order runs started."""
    overlaps = list(iter_overlaps(runs))
    assert not overlaps, f"overlapping runs: {overlaps[:3]}"
    by_key: dict[str, list[Entry]] = {}
    for run in runs:
        by_key.setdefault(run["key"], []).append(run)
    for key_runs in by_key.values():
        key_runs.sort(key=lambda r: r["start"])
        fences = [r["fence"] for r in key_runs]
        assert all(f is not None for f in fences)
        assert fences == sorted(fences) and len(set(fences)) == len(fences)


def run_retry_batch(app: Celery, log: EventLog, count: int, hold: float = 0.01) -> list[Entry]:
    ids = send_batch(app, "exclusive_retry", count, hold=hold)
    log.wait_for(
        lambda evs: len({e["task_id"] for e in evs if e["event"] == "run"} & set(ids)) == count,
        RUN_TIMEOUT_S,
        f"{count} retry runs",
    )
    runs = [r for r in log.entries("run") if r["task_id"] in set(ids)]
    assert Counter(r["n"] for r in runs) == Counter(range(count))  # each ran exactly once
    assert len({r["key"] for r in runs}) == KEYS
    assert_exclusive(runs)
    return runs


def run_skip_batch(
    app: Celery, log: EventLog, count: int, hold: float = 0.05
) -> tuple[list[Entry], list[Entry]]:
    ids = set(send_batch(app, "exclusive_skip", count, hold=hold))

    def settled(evs: list[Entry]) -> bool:
        done = {e.get("task_id") for e in evs if e["event"] in ("run", "skipped")}
        return len(done & ids) == count

    log.wait_for(settled, RUN_TIMEOUT_S, f"{count} skip-policy tasks settled")
    runs = [r for r in log.entries("run") if r["task_id"] in ids]
    skipped = [s for s in log.entries("skipped") if s["task_id"] in ids]
    # Every task either ran or was skipped, exactly once: none silently lost.
    assert Counter(e["task_id"] for e in runs + skipped) == Counter(ids)
    assert_exclusive(runs)
    return runs, skipped


@pytest.mark.redis
@pytest.mark.slow
def test_two_prefork_workers_on_redis_retry_and_skip(
    redis_settings: dict[str, Any],
    lock_server: ServerThread,
    make_workers: Callable[[dict[str, Any]], WorkerFactory],
    event_log: EventLog,
    client_app: Callable[[dict[str, Any]], Celery],
) -> None:
    settings = with_server(redis_settings, lock_server)
    workers = make_workers(settings)
    workers.start(pool="prefork", concurrency=4)
    workers.start(pool="prefork", concurrency=4)
    app = client_app(settings)

    # 50 ms bodies, as the skip batch's: with 10 ms ones a loaded CI machine ran the 200 tasks
    # of 8 processes without two of one key ever overlapping, and so never retried.
    retried = [r for r in run_retry_batch(app, event_log, 200, hold=0.05) if r["lock_retries"]]
    assert retried, "8 processes over 5 keys with 50 ms bodies never collided"  # on_locked=retry
    runs, skipped = run_skip_batch(app, event_log, 200)
    assert skipped, "8 processes over 5 keys with 50 ms bodies never collided"
    assert runs
    assert {s["key"] for s in skipped} <= {f"mx:{k}" for k in range(KEYS)}
    # A skip is a finished run (ready at once), told apart from a real one by its error.
    skipped_result = app.AsyncResult(skipped[0]["task_id"])
    assert skipped_result.ready()
    assert skipped_result.state == "FAILURE"
    assert isinstance(skipped_result.result, LockSkipped)


@pytest.mark.parametrize(
    ("broker", "pool", "workers", "concurrency"),
    [
        ("filesystem", "prefork", 1, 4),
        ("filesystem", "threads", 1, 4),
        ("filesystem", "solo", 2, 1),
        pytest.param("redis", "threads", 1, 4, marks=pytest.mark.redis),
        pytest.param("redis", "solo", 2, 1, marks=pytest.mark.redis),
    ],
)
def test_exclusion_per_pool(
    broker: str,
    pool: str,
    workers: int,
    concurrency: int,
    request: pytest.FixtureRequest,
    lock_server: ServerThread,
    make_workers: Callable[[dict[str, Any]], WorkerFactory],
    event_log: EventLog,
    client_app: Callable[[dict[str, Any]], Celery],
) -> None:
    broker_settings: dict[str, Any] = request.getfixturevalue(
        "fs_settings" if broker == "filesystem" else "redis_settings"
    )
    settings = with_server(broker_settings, lock_server)
    factory = make_workers(settings)
    for _ in range(workers):
        factory.start(pool=pool, concurrency=concurrency)
    app = client_app(settings)
    run_retry_batch(app, event_log, 30)
    run_skip_batch(app, event_log, 30)


def test_semaphore_lets_limit_runs_overlap_and_no_more(
    fs_settings: dict[str, Any],
    lock_server: ServerThread,
    make_workers: Callable[[dict[str, Any]], WorkerFactory],
    event_log: EventLog,
    client_app: Callable[[dict[str, Any]], Celery],
) -> None:
    settings = with_server(fs_settings, lock_server)
    make_workers(settings).start(pool="threads", concurrency=4)
    app = client_app(settings)
    ids = {app.send_task("apps.tasks.limited", (n, 0)).id for n in range(8)}
    event_log.wait_for(
        lambda evs: (
            len({e.get("task_id") for e in evs if e["event"] in ("run", "skipped")} & ids) == 8
        ),
        RUN_TIMEOUT_S,
        "8 semaphore tasks settled",
    )
    runs = [r for r in event_log.entries("run") if r["task_id"] in ids]
    # At no instant did more than 2 runs hold the semaphore.
    points = sorted([(r["start"], 1) for r in runs] + [(r["end"], -1) for r in runs])
    active = peak = 0
    for _, delta in points:
        active += delta
        peak = max(peak, active)
    assert 1 <= peak <= 2


def test_a_run_three_times_its_lease_keeps_the_lock(
    fs_settings: dict[str, Any],
    lock_server: ServerThread,
    make_workers: Callable[[dict[str, Any]], WorkerFactory],
    event_log: EventLog,
    client_app: Callable[[dict[str, Any]], Celery],
) -> None:
    settings = with_server(fs_settings, lock_server)
    make_workers(settings).start(pool="prefork", concurrency=2)
    app = client_app(settings)
    name = uuid.uuid4().hex[:8]
    result = app.send_task("apps.tasks.long_runner", (name, 3.0))  # lease 1 s
    started = event_log.wait_event("started", 30, name=name)
    # Past two whole leases, the key is still held: a competitor gets nothing.
    event_log.wait_for(
        lambda evs: any(e.get("name") == name and e.get("elapsed", 0) >= 2.0 for e in evs),
        30,
        "the run to pass two leases",
    )
    competitor = DistributedLock(
        f"renew:{name}", acquire_timeout_s=0, servers=[lock_server.address]
    )
    assert not competitor.acquire()
    outcome = result.get(timeout=30)
    assert outcome == {"lost": False, "fence": started["fence"]}
    ticks = event_log.entries("tick", name=name)
    assert ticks and not any(t["lost"] for t in ticks)
    assert competitor.acquire()  # released at the end
    competitor.release()


def test_config_only_locking_of_a_plain_task(
    fs_settings: dict[str, Any],
    lock_server: ServerThread,
    make_workers: Callable[[dict[str, Any]], WorkerFactory],
    event_log: EventLog,
    client_app: Callable[[dict[str, Any]], Celery],
    tmp_path: Path,
) -> None:
    settings = with_server(
        fs_settings,
        lock_server,
        dflock_task_locks={
            "apps.plain.third_party_report": {
                "lock_key": "plain:{customer_id}",
                "on_locked": "skip",
            }
        },
    )
    make_workers(settings).start(app="apps.plain", pool="prefork", concurrency=2)
    app = client_app(settings)
    # `first` holds the key until the test has seen `second` skipped: a timed hold (it was
    # 1 s) had to outlast the skipped event, the send through the broker, the worker's pick-up
    # and the child's try, which a loaded CI machine did not always fit in, so `second` ran.
    release = tmp_path / "release-first"
    first = app.send_task("apps.plain.third_party_report", (7,), {"release_file": str(release)})
    try:
        started = event_log.wait_event("plain_run", 30, customer_id=7)
        assert started["fence"] is not None  # the body ran under a lock
        second = app.send_task("apps.plain.third_party_report", (7,), {"hold": 0})
        skipped = event_log.wait_event("skipped", 30, task_id=second.id)
        assert skipped["key"] == "plain:7"
    finally:
        release.touch()
    assert first.get(timeout=30) == 7
    with pytest.raises(LockSkipped, match=f"'plain:7' is held by task {first.id}"):
        second.get(timeout=10)
    third = app.send_task("apps.plain.third_party_report", (7,), {"hold": 0})
    assert third.get(timeout=30) == 7


@pytest.mark.parametrize("task", ["in_context", "in_context_super"])
def test_config_only_locking_runs_the_tasks_own_call_under_the_lock(
    fs_settings: dict[str, Any],
    lock_server: ServerThread,
    make_workers: Callable[[dict[str, Any]], WorkerFactory],
    event_log: EventLog,
    client_app: Callable[[dict[str, Any]], Celery],
    task: str,
) -> None:
    """A task locked by ``dflock_task_locks`` alone whose class has a ``__call__`` of its own
    (the app's ``task_cls``: Flask's runs the body in the app context) ran without it:
    `LockedTask`'s ``__call__`` took its place."""
    name = f"apps.tasks.{task}"
    settings = with_server(fs_settings, lock_server, dflock_task_locks={name: {}})
    make_workers(settings).start(app="apps.tasks", pool="prefork", concurrency=1)
    result = client_app(settings).send_task(name, ("a",))
    assert result.get(timeout=30) == "app context"
    ran = event_log.wait_event("in_context", 30, name="a")
    assert ran["task_id"] == result.id
    assert ran["fence"] is not None  # under its lock
