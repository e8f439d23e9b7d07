"""A lock and a semaphore on one key exclude each other (issue 13, point 7), over real prefork
workers on the Redis broker: a key is one resource on the server, so a run asking for another
``lock_limit`` than the runs holding the key is refused, and ``on_locked`` applies to it as to
a busy key, with a message that says what to change."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.result import AsyncResult

from celery_dflock import LockNotAcquired
from celery_dflock.beat import _nonoverlap_options  # pyright: ignore[reportPrivateUsage]
from celery_dflock.task import LOCK_OPTIONS_HEADER
from dflockd_server.testing import ServerThread
from tests.support.waiting import wait_until
from tests.support.workers import EventLog, WorkerFactory, with_server

RESULT_TIMEOUT_S = 60.0
REFUSED_TIMEOUT_S = 30.0
MISMATCH_HINT = "is in use by runs with another lock_limit"


def send(
    app: Celery, task: str, n: int, group: str, release_file: Path | None, limit: int | None
) -> AsyncResult:
    headers = {LOCK_OPTIONS_HEADER: {"lock_limit": limit}} if limit is not None else None
    args = (n, group, str(release_file) if release_file is not None else None)
    return app.send_task(f"apps.tasks.{task}", args, headers=headers)


@pytest.mark.redis
@pytest.mark.parametrize(
    ("first_limit", "second_limit"),
    [(2, None), (None, 2)],
    ids=["semaphore-then-lock", "lock-then-semaphore"],
)
def test_a_lock_and_a_semaphore_on_one_key_never_overlap(
    redis_settings: dict[str, Any],
    lock_server: ServerThread,
    make_workers: Callable[[dict[str, Any]], WorkerFactory],
    client_app: Callable[[dict[str, Any]], Celery],
    event_log: EventLog,
    tmp_path: Path,
    first_limit: int | None,
    second_limit: int | None,
) -> None:
    settings = with_server(redis_settings, lock_server)
    worker = make_workers(settings).start(pool="prefork", concurrency=2)
    app = client_app(settings)
    group = uuid.uuid4().hex[:8]
    release = tmp_path / "release-first"
    first = send(app, "shared_key_retry", 0, group, release, first_limit)
    event_log.wait_event("started", task_id=first.id, timeout=RESULT_TIMEOUT_S)
    second = send(app, "shared_key_retry", 1, group, None, second_limit)
    # The second run is refused while the first holds the key (it would run at once if the
    # key were two resources), and says why; only then does the first run end.
    assert worker.wait_output(MISMATCH_HINT, timeout=REFUSED_TIMEOUT_S), worker.output()[-3000:]
    assert not event_log.events("started", task_id=second.id)
    said = [line for line in worker.output().splitlines() if MISMATCH_HINT in line]
    assert len([line for line in said if "dflock:" in line]) == 1, said  # said once, not twice
    release.touch()
    assert first.get(timeout=RESULT_TIMEOUT_S) == 0
    assert second.get(timeout=RESULT_TIMEOUT_S) == 1  # retried once the key was free
    runs = {r["n"]: r for r in event_log.entries("run") if r["task_id"] in (first.id, second.id)}
    assert runs[0]["key"] == runs[1]["key"]
    assert runs[1]["start"] >= runs[0]["end"], runs
    assert runs[1]["lock_retries"] >= 1
    assert runs[1]["fence"] > runs[0]["fence"]


@pytest.mark.redis
def test_on_locked_raise_names_the_other_lock_limit(
    redis_settings: dict[str, Any],
    lock_server: ServerThread,
    make_workers: Callable[[dict[str, Any]], WorkerFactory],
    client_app: Callable[[dict[str, Any]], Celery],
    event_log: EventLog,
    tmp_path: Path,
) -> None:
    settings = with_server(redis_settings, lock_server)
    make_workers(settings).start(pool="prefork", concurrency=2)
    app = client_app(settings)
    group = uuid.uuid4().hex[:8]
    release = tmp_path / "release-first"
    semaphore = send(app, "shared_key_retry", 0, group, release, 2)
    event_log.wait_event("started", task_id=semaphore.id, timeout=RESULT_TIMEOUT_S)
    try:
        lock = send(app, "shared_key_raise", 1, group, None, None)
        with pytest.raises(LockNotAcquired, match=MISMATCH_HINT) as info:
            lock.get(timeout=RESULT_TIMEOUT_S)
        message = str(info.value)
        assert "this run asked for a lock" in message
        assert "same lock_limit" in message
        assert not event_log.events("started", task_id=lock.id)
    finally:
        release.touch()
    assert semaphore.get(timeout=RESULT_TIMEOUT_S) == 0


def run_behind(
    worker: Any,
    event_log: EventLog,
    first: AsyncResult,
    release: Path,
    send_second: Callable[[], AsyncResult],
    *,
    task: str,
    key: str,
    refusals: int,
) -> dict[int, dict[str, Any]]:
    """Once ``first`` (``task``, run 0) started holding ``key``: send the second run (run 1),
    which is refused ``refusals`` times and does not start; then let the first end (``release``)
    and see the second run after it. The two runs' records, by ``n``."""
    event_log.wait_event("started", task_id=first.id, timeout=RESULT_TIMEOUT_S)
    second = send_second()
    busy = f"lock '{key}' is held by task {first.id}"
    assert worker.wait_output(busy, timeout=REFUSED_TIMEOUT_S), worker.output()[-3000:]
    refused = f"dflock: task {task}[{second.id}] retries in"
    wait_until(
        lambda: worker.output().count(refused) >= refusals,
        what=f"the second run refused {refusals} time(s)",
        timeout=REFUSED_TIMEOUT_S,
    )
    assert not event_log.events("started", task_id=second.id)
    release.touch()
    assert first.get(timeout=RESULT_TIMEOUT_S) == 0
    assert second.get(timeout=RESULT_TIMEOUT_S) == 1
    runs = {r["n"]: r for r in event_log.entries("run") if r["task_id"] in (first.id, second.id)}
    assert runs[0]["key"] == runs[1]["key"] == key
    assert runs[1]["start"] >= runs[0]["end"], runs
    assert runs[1]["lock_retries"] >= refusals
    return runs


@pytest.mark.redis
def test_a_beat_sent_run_of_a_task_with_its_own_key_takes_that_key(
    redis_settings: dict[str, Any],
    lock_server: ServerThread,
    make_workers: Callable[[dict[str, Any]], WorkerFactory],
    client_app: Callable[[dict[str, Any]], Celery],
    event_log: EventLog,
    tmp_path: Path,
) -> None:
    """``dflock_beat_nonoverlap`` gives beat's messages the entry's key and ``skip``, below the
    task's own lock options: a beat run of a task keyed ``shared:{group}`` is excluded by a
    ``delay()`` run holding that key. The entry's key was sent as a call option, above the
    task's: the beat run took ``beat-entry:<entry>`` and ran beside the other at once."""
    settings = with_server(redis_settings, lock_server)
    worker = make_workers(settings).start(pool="prefork", concurrency=2)
    app = client_app(settings)
    group = uuid.uuid4().hex[:8]
    release = tmp_path / "release-first"
    task = "apps.tasks.shared_key_retry"
    first = send(app, "shared_key_retry", 0, group, release, None)
    # As SingletonScheduler sends a run of entry "nightly" with dflock_beat_nonoverlap on; the
    # entry gives a lock option of its own (kept): no wait in the key's queue. Its key is busy:
    # the task's own on_locked ("retry") counts, not the entry's "skip".
    beat_options = _nonoverlap_options("nightly", {"lock_timeout": 0})
    run_behind(
        worker,
        event_log,
        first,
        release,
        lambda: app.send_task(task, (1, group, None), **beat_options),
        task=task,
        key=f"shared:{group}",
        refusals=1,
    )


@pytest.mark.redis
def test_a_beat_sent_run_sent_again_for_its_busy_key_keeps_the_entry_s_key(
    redis_settings: dict[str, Any],
    lock_server: ServerThread,
    make_workers: Callable[[dict[str, Any]], WorkerFactory],
    client_app: Callable[[dict[str, Any]], Celery],
    event_log: EventLog,
    tmp_path: Path,
) -> None:
    """A task with no key of its own, ``on_locked="retry"``: two runs of one beat entry (other
    arguments, so other keys of their own) exclude each other by the entry's key, also after
    the second is sent again for its busy key (refused twice: the message sent again names the
    entry too)."""
    settings = with_server(redis_settings, lock_server)
    worker = make_workers(settings).start(pool="prefork", concurrency=2)
    app = client_app(settings)
    group = uuid.uuid4().hex[:8]
    entry = f"every-minute-{group}"
    release = tmp_path / "release-first"
    beat_options = _nonoverlap_options(entry, {"lock_timeout": 0})
    task = "apps.tasks.keyless_retry"
    first = app.send_task(task, (0, group, str(release)), **beat_options)
    run_behind(
        worker,
        event_log,
        first,
        release,
        lambda: app.send_task(task, (1, group, None), **beat_options),
        task=task,
        key=f"beat-entry:{entry}",
        refusals=2,
    )
