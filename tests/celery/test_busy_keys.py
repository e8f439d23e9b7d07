"""Busy keys on real prefork workers over Redis: defaults drop no run, lock retries have a
budget of their own, and a skipped run is a finished one (groups, chains and chords end)."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from celery import chain, chord, group
from celery.exceptions import ChordError

from celery_dflock import LockNotAcquired, LockSkipped
from dflockd_server import Config
from tests.support.rigs import Rig, open_rig
from tests.support.services import require_redis
from tests.support.workers import (
    iter_overlaps,
    redis_cleanup,
    redis_settings,
)

pytestmark = pytest.mark.slow

RESULT_TIMEOUT_S = 120.0
"""Generous: a run that is dropped or hangs fails the test long before it matters."""
SKIP_SETTLES_S = 10.0
"""A canvas with a skipped member must end within a few seconds, never hang."""


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    """Two prefork workers with -c 3 (the issue's set-up), every dflock option at its default."""
    require_redis()
    queue = f"dflock-busy-{time.monotonic_ns()}"
    with open_rig(
        tmp_path_factory.mktemp("busy"),
        "apps.tasks",
        redis_settings(queue),
        server=Config(host="127.0.0.1", port=0),
        main="busy-client",
        cleanup=lambda: redis_cleanup(queue),
    ) as made:
        made.start_worker(pool="prefork", concurrency=3)
        made.start_worker(pool="prefork", concurrency=3)
        yield made


def sig(rig: Rig, task: str, *args: Any, **kwargs: Any) -> Any:
    return rig.app.signature(f"apps.tasks.{task}", args, kwargs)


def test_defaults_drop_no_run_under_contention(rig: Rig) -> None:
    """30 tasks of 0.5 s on 3 keys, two workers of 3 processes: all run, one at a time per key
    (Celery's max_retries=3 dropped 4-5 of them before lock retries had their own budget)."""
    started = time.monotonic()
    results = [sig(rig, "busy_default", n, n % 3).delay() for n in range(30)]
    values = [outcome(r, RESULT_TIMEOUT_S) for r in results]
    print(f"30 runs on 3 keys took {time.monotonic() - started:.1f}s")
    assert sorted(values) == list(range(30))
    ids = {r.id for r in results}
    runs = [e for e in rig.log.entries("run") if e["task_id"] in ids]
    assert Counter(e["n"] for e in runs) == Counter(range(30))
    assert not list(iter_overlaps(runs))
    assert any(e["retries"] == 0 for e in runs)
    assert all(e["retries"] == 0 for e in runs), "lock retries used Celery's retries"


def test_lock_retries_say_when_their_budget_ran_out(rig: Rig) -> None:
    other = rig.holder("budget:1")
    try:
        result = sig(rig, "busy_budget", 1, 1).delay()
        with pytest.raises(LockNotAcquired) as failure:
            outcome(result, RESULT_TIMEOUT_S)
    finally:
        other.release()
    message = str(failure.value)
    assert "after 2 lock retries (lock_max_retries=2)" in message
    assert "raise lock_max_retries" in message
    assert not [e for e in rig.log.entries("run") if e["task_id"] == result.id]


def test_lock_retries_leave_celerys_max_retries_alone(rig: Rig) -> None:
    """max_retries=0 and no lock_max_retries: the run waits out the busy key and runs."""
    other = rig.holder("budget:2")
    releaser = threading.Timer(1.5, other.release)
    releaser.start()
    try:
        result = sig(rig, "busy_patient", 2, 2).delay()
        assert outcome(result, RESULT_TIMEOUT_S) == 2
    finally:
        releaser.cancel()
        other.release()
    (run,) = [e for e in rig.log.entries("run") if e["task_id"] == result.id]
    assert run["retries"] == 0  # the body sees its own retries only


def test_a_run_refused_in_the_restart_grace_says_so_in_its_log_and_error(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The lock server is in its restart grace (it grants no key): each lock retry's log line
    and the error once they run out say so, not that the key is busy."""
    queue = f"dflock-grace-{time.monotonic_ns()}"
    with open_rig(
        tmp_path_factory.mktemp("grace"),
        "apps.tasks",
        redis_settings(queue),
        server=Config(host="127.0.0.1", port=0, restart_grace_s=600.0),
        main="grace-client",
        cleanup=lambda: redis_cleanup(queue),
    ) as graced:
        worker = graced.start_worker(pool="prefork", concurrency=1)
        result = sig(graced, "busy_budget", 3, 3).delay()
        with pytest.raises(LockNotAcquired) as failure:
            outcome(result, RESULT_TIMEOUT_S)
        retried = [line for line in worker.output().splitlines() if "retries in" in line]
    assert len(retried) == 2, worker.output()
    assert all("is in its restart grace, granting no key" in line for line in retried), retried
    assert "after 2 lock retries (lock_max_retries=2)" in str(failure.value)
    assert "is in its restart grace" in str(failure.value)


def outcome(result: Any, timeout: float) -> Any:
    """``result.get()``, by reading the backend (see `settle`): its value, or its error raised."""
    deadline = time.monotonic() + timeout
    while not result.ready():
        assert time.monotonic() < deadline, f"{result.id} did not finish within {timeout}s"
        time.sleep(0.05)
    if result.failed():
        raise result.result
    return result.result


def settle(result: Any, what: str) -> None:
    """Wait until ``result`` is ready, reading its state from the backend (``.get()`` waits on
    Redis pub/sub, and Celery's result consumer can miss a result published just before it
    subscribed: it then waits for its whole timeout, whatever the task did)."""
    started = time.monotonic()
    while not result.ready():
        assert time.monotonic() - started < SKIP_SETTLES_S, f"{what} did not finish"
        time.sleep(0.05)
    print(f"{what} finished in {time.monotonic() - started:.2f}s")


def test_a_skipped_member_ends_its_group_chain_and_chord(rig: Rig) -> None:
    other = rig.holder("mx:4")
    try:
        skipped = sig(rig, "exclusive_skip", 0, 4).delay()
        settle(skipped, "a skipped run")
        assert skipped.state == "FAILURE"
        assert isinstance(skipped.result, LockSkipped)
        assert "'mx:4' is held by another run" in str(skipped.result)

        members: Any = group(
            sig(rig, "exclusive_skip", 1, 3), sig(rig, "exclusive_skip", 2, 4)
        ).delay()
        settle(members, "a group with a skipped member")
        assert members.results[0].result == 1
        assert isinstance(members.results[1].result, LockSkipped)

        steps: Any = chain(sig(rig, "exclusive_skip", 3, 4), sig(rig, "collect")).delay()
        settle(steps, "a chain whose first step was skipped")
        assert steps.state == "FAILURE"
        assert isinstance(steps.result, LockSkipped)  # the skipped step's error, passed on

        header = [sig(rig, "exclusive_skip", 4, 3), sig(rig, "exclusive_skip", 5, 4)]
        joined: Any = chord(header)(sig(rig, "collect"))
        settle(joined, "a chord's callback, a header member skipped")
        assert joined.state == "FAILURE"
        assert isinstance(joined.result, ChordError)
        assert "LockSkipped" in str(joined.result)  # it names the skipped member's error
    finally:
        other.release()
    assert not rig.log.entries("collected")
