"""A lock-server outage is a busy key, not a failure (issue 49), on real workers (prefork and
gevent) over Redis, against a real ``dflockd`` started as users start it.

- Runs waiting in busy keys' FIFO queues when the server is killed (SIGKILL) or stopped
  (SIGTERM: it drains) and started again 3 s later run once each after the restart, one at a
  time per key (before: every one failed with ServerUnavailable or ServerDraining). 3 s is
  past the 2 s a run reconnects in its pool slot (issue 69), so they come back as outage
  retries from the broker.
- A worker started while its lock server is down runs every task sent meanwhile once the
  server starts, 20 s later, with every setting at its default (before: each failed at once).
- A release while the server is down does not hold the pool slot: the run's result is in
  while the server is still down, and a warm shutdown does not wait out ``lock_ttl``.
- An acquire that finds the server down gives its pool slot back (issue 69): with the server
  down 20 s under 40 runs on 5 keys (prefork 2x4), a warm shutdown of the workers ends in
  under 10 s (before: 30 s, each waiting run sat out its ``lock_timeout`` in its slot), and
  every run runs once after the server is back, one at a time per key.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_dflock import Client, DflockError, ServerUnavailable
from celery_dflock._outage import OUTAGE_BUDGET_S
from tests.support.ports import free_port
from tests.support.processes import python_path
from tests.support.rigs import Rig, open_rig, unique
from tests.support.servers import dflockd_subprocess
from tests.support.services import require_redis
from tests.support.waiting import wait_until
from tests.support.workers import (
    CELERY_APPS_DIR,
    REPO,
    iter_overlaps,
    redis_cleanup,
    redis_settings,
)

pytestmark = pytest.mark.slow

POOLS = ("prefork", "gevent")
DOWN_S = 3.0
"""How long the server stays down in the restart tests (the issue's 3 s)."""
LATE_START_S = 20.0
"""How long after the worker's start the lock server starts (the issue's 20 s)."""
RESULT_TIMEOUT_S = 120.0
"""Generous: a dropped or hung run fails the test long before it matters."""


@contextlib.contextmanager
def outage_rig(tmp: Path, name: str, port: int) -> Iterator[Rig]:
    """A rig whose workers use the lock server at 127.0.0.1:``port`` (the test runs it)."""
    require_redis()
    queue = unique(f"dflock-outage-{name}")
    with open_rig(
        tmp,
        "apps.tasks",
        redis_settings(queue),
        server=("127.0.0.1", port),
        main=f"outage-{name}",
        cleanup=lambda: redis_cleanup(queue),
    ) as rig:
        yield rig


def waiters(address: tuple[str, int]) -> int:
    """Runs waiting in the lock server's queues now."""
    with Client(servers=[address]) as client:
        (status,) = client.stats()
    stats = status.stats or {}
    return sum(int(lock.get("waiters", 0)) for lock in stats.get("locks", []))


def finished(results: list[Any]) -> list[Any]:
    """Each result's value, waiting for it by reading the backend; an error is raised."""
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    values: list[Any] = []
    for result in results:
        while not result.ready():
            assert time.monotonic() < deadline, f"{result.id} did not finish"
            time.sleep(0.05)
        if result.failed():
            raise result.result
        values.append(result.result)
    return values


def stop_server(proc: subprocess.Popen[bytes], how: str) -> None:
    if how == "kill":
        proc.kill()
    else:
        proc.send_signal(signal.SIGTERM)
    proc.wait(30)


@pytest.mark.parametrize("how", ["kill", "term"])
@pytest.mark.parametrize("pool", POOLS)
def test_waiters_on_busy_keys_run_once_across_a_restart(
    tmp_path: Path, pool: str, how: str
) -> None:
    """6 runs wait on 3 busy keys (2 each, every option at its default) when the server is
    killed -9 or stopped with SIGTERM, and started again 3 s later on its state directory:
    each run runs once, after the restart, one at a time per key (sent again for the outage:
    3 s is past their 2 s reconnect)."""
    port = free_port()
    args = ("--state-dir", str(tmp_path / "state"))
    log = tmp_path / "dflockd.log"
    with outage_rig(tmp_path, f"{pool}-{how}", port) as rig:
        with dflockd_subprocess(log, *args, port=port) as (proc, address):
            rig.start_worker(pool=pool, concurrency=6)
            group = unique("g")
            holders = [rig.holder(f"busy:{group}{k}") for k in range(3)]
            results = [
                rig.app.signature("apps.tasks.busy_default", (n, f"{group}{n % 3}", 0.2)).delay()
                for n in range(6)
            ]
            wait_until(lambda: waiters(address) == 6, timeout=60, what="6 runs waiting")
            stop_server(proc, how)
        down_at = time.time()
        time.sleep(DOWN_S)
        back_at = time.time()  # before the start: a run may be granted as soon as it listens
        with dflockd_subprocess(log, *args, port=port):
            print(f"server down {back_at - down_at:.1f}s ({how})")
            for holder in holders:
                holder.release()
            values = finished(results)
        ids = {result.id for result in results}
        runs = [entry for entry in rig.log.entries("run") if entry["task_id"] in ids]
        assert sorted(values) == list(range(6))
        assert Counter(entry["n"] for entry in runs) == Counter(range(6))
        assert all(entry["start"] > back_at for entry in runs)
        assert not list(iter_overlaps(runs))
        output = rig.worker.output()
        assert "answers again" in output


@pytest.mark.parametrize("pool", POOLS)
def test_tasks_sent_while_the_server_is_down_run_once_it_starts(tmp_path: Path, pool: str) -> None:
    """A worker starts while its lock server is down; 20 tasks are sent (10 with every option
    at its default, which wait for the server within their lock_timeout; 10 with
    ``on_locked="skip"`` and ``lock_timeout=0``, which are sent again for the outage, not
    skipped); the server starts 20 s later: each of the 20 runs once."""
    port = free_port()
    log = tmp_path / "dflockd.log"
    with outage_rig(tmp_path, f"late-{pool}", port) as rig:
        worker = rig.start_worker(pool=pool, concurrency=4)
        group = unique("late")
        results = [
            rig.app.signature(
                "apps.tasks.busy_default" if n % 2 else "apps.tasks.exclusive_skip",
                (n, f"{group}-{n}", 0.05),
            ).delay()
            for n in range(20)
        ]
        time.sleep(LATE_START_S)
        assert not any(result.ready() for result in results)  # none failed meanwhile
        with dflockd_subprocess(log, "--state-dir", str(tmp_path / "state"), port=port):
            started = time.monotonic()
            values = finished(results)
            print(f"20 runs done {time.monotonic() - started:.1f}s after the server started")
            # The worker's own watch of its servers (pinged every 15 s at most) logs it.
            assert worker.wait_output(f"lock server 127.0.0.1:{port} is reachable again", 30)
            status = dflock_status(rig, "--workers")
            print(status)
        ids = {result.id for result in results}
        runs = [entry for entry in rig.log.entries("run") if entry["task_id"] in ids]
        assert sorted(values) == list(range(20))
        assert Counter(entry["n"] for entry in runs) == Counter(range(20))
        output = worker.output()
        assert "sent again in" in output  # the skip runs met the outage, and were not skipped
        assert "answers again" in output
        (line,) = [line for line in status.splitlines() if line.startswith(worker.name)]
        retries = int(line.split(": ", 1)[1].split(" ", 1)[0])
        assert retries >= 1, line  # the skip runs' outage retries, counted by the worker
        assert "cannot reach" not in line


def dflock_status(rig: Rig, *args: str) -> str:
    """``celery -A apps.tasks dflock status ARGS`` on the rig's settings, as a user runs it."""
    env = {
        **os.environ,
        "DFLOCK_TEST_SETTINGS": json.dumps(rig.settings),
        "PYTHONPATH": python_path(CELERY_APPS_DIR, REPO),
    }
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "apps.tasks", "dflock", "status", *args],
        env=env,
        cwd=rig.tmp,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


BODY_S = 2.0
RELEASED_WITHIN_S = 45.0
"""Shorter than the tasks' 60 s lease: a release that waited for the lease misses it."""


def reported_runtimes(output: str, ids: set[str]) -> list[float]:
    """The "succeeded in X s" Celery reports for the runs ``ids``."""
    found: list[float] = []
    for line in output.splitlines():
        if "succeeded in " in line and any(task_id in line for task_id in ids):
            found.append(float(line.split("succeeded in ", 1)[1].split("s", 1)[0]))
    return found


@pytest.mark.parametrize("pool", POOLS)
def test_a_release_while_the_server_is_down_does_not_hold_the_pool_slot(
    tmp_path: Path, pool: str
) -> None:
    """4 bodies of 2 s under a 60 s lease; the server is killed while they run and stays
    down: each run's result arrives while it is still down (before: each release waited for
    the lease, 60 s). Then, with 4 more bodies running and the server killed again, a warm
    shutdown (SIGTERM) ends while the server is down. Times are printed, not asserted."""
    port = free_port()
    args = ("--state-dir", str(tmp_path / "state"))
    log = tmp_path / "dflockd.log"
    with outage_rig(tmp_path, f"release-{pool}", port) as rig:
        with dflockd_subprocess(log, *args, port=port) as (proc, _):
            worker = rig.start_worker(pool=pool, concurrency=4)
            names = [unique("rel") for _ in range(4)]
            results = [
                rig.app.signature("apps.tasks.slow_body", (name, BODY_S)).delay() for name in names
            ]
            for name in names:
                rig.log.wait_event("body", 60, name=name)
            proc.kill()
            proc.wait(30)
        down_at = time.monotonic()
        deadline = down_at + RELEASED_WITHIN_S
        for result in results:  # the server stays down meanwhile
            while not result.ready():
                assert time.monotonic() < deadline, "a run's release held its pool slot"
                time.sleep(0.05)
        print(f"{pool}: results in {time.monotonic() - down_at:.1f}s after the kill")
        assert finished(results) == names
        ids = {result.id for result in results}
        assert worker.wait_output("succeeded in", 10)
        times = reported_runtimes(worker.output(), ids)
        print(f"{pool}: reported runtimes {', '.join(f'{t:.2f}s' for t in times)}")
        with dflockd_subprocess(log, *args, port=port) as (proc, _):
            more = [unique("rel") for _ in range(4)]
            for name in more:
                rig.app.signature("apps.tasks.slow_body", (name, BODY_S)).delay()
            for name in more:
                rig.log.wait_event("body", 60, name=name)
            proc.kill()
            proc.wait(30)
        stopping = time.monotonic()
        worker.stop(signal.SIGTERM, timeout=RELEASED_WITHIN_S)  # the server still down
        print(f"{pool}: warm shutdown took {time.monotonic() - stopping:.1f}s")
        assert len(rig.log.entries("body_done")) == 8  # every body finished


def test_a_run_fails_saying_so_once_its_outage_budget_is_spent(tmp_path: Path) -> None:
    """A run whose lock server has been unreachable for longer than the outage budget (its
    ``dflock_outage`` header says since when: a run sent again for an outage carries it)
    fails with ServerUnavailable naming the server, how long, and what to do; a run of the
    same worker still within its budget is sent again instead."""
    port = free_port()
    with outage_rig(tmp_path, "budget", port) as rig:
        worker = rig.start_worker(pool="prefork", concurrency=2)
        group = unique("budget")
        spent = {"since": time.time() - OUTAGE_BUDGET_S - 100, "retries": 9}
        failed = rig.app.signature("apps.tasks.exclusive_skip", (1, f"{group}-1")).apply_async(
            headers={"dflock_outage": spent}
        )
        kept = rig.app.signature("apps.tasks.exclusive_skip", (2, f"{group}-2")).delay()
        with pytest.raises(ServerUnavailable) as raised:
            finished([failed])
        message = str(raised.value)
        assert f"the lock server at 127.0.0.1:{port}" in message
        assert "9 outage retries spent" in message
        assert "Start the lock server (`dflockd`) or set dflock_servers" in message
        assert worker.wait_output(f"{kept.id}] retry", 30)  # sent again, not failed
        assert not kept.ready()


OUTAGE_S = 20.0
"""How long the lock server stays down in the shutdown test: twice ``SHUTDOWN_WITHIN_S``. A run
that sat in its pool slot waiting for the server would hold the warm shutdown until the server
came back (20 s) or its ``lock_timeout`` (30 s) ran out, whichever came first: either way past
the bound."""
SHUTDOWN_WITHIN_S = 10.0
"""Issue 69's acceptance 5: a warm shutdown during the outage ends within this."""


def test_a_warm_shutdown_during_an_outage_does_not_wait_out_lock_timeout(tmp_path: Path) -> None:
    """40 runs (every option at its default: ``lock_timeout`` 30 s) on 5 keys, two prefork
    workers of concurrency 4: the test holds the 5 keys, so 8 runs wait in the keys' queues
    and 32 are queued in the broker; the server is killed and stays down 20 s. A warm shutdown
    (SIGTERM to both main processes) ends in under 10 s; a worker started again meanwhile runs
    every run once after the server is back, one at a time per key."""
    port = free_port()
    args = ("--state-dir", str(tmp_path / "state"))
    log = tmp_path / "dflockd.log"
    with outage_rig(tmp_path, "shutdown", port) as rig:
        with dflockd_subprocess(log, *args, port=port) as (proc, address):
            workers = [rig.start_worker(pool="prefork", concurrency=4) for _ in range(2)]
            group = unique("down")
            holders = [rig.holder(f"busy:{group}{k}") for k in range(5)]
            results = [
                rig.app.signature("apps.tasks.busy_default", (n, f"{group}{n % 5}", 0.05)).delay()
                for n in range(40)
            ]
            wait_until(lambda: waiters(address) == 8, timeout=60, what="8 runs waiting")
            proc.kill()
            proc.wait(30)
        down_at = stopping = time.monotonic()
        for worker in workers:  # a warm shutdown of both at once
            worker.send_signal(signal.SIGTERM)
        for worker in workers:
            worker.proc.wait(OUTAGE_S)
        shutdown_s = time.monotonic() - stopping
        print(f"warm shutdown of 2 workers {shutdown_s:.1f}s into a {OUTAGE_S:.0f}s outage")
        assert shutdown_s < SHUTDOWN_WITHIN_S
        assert time.monotonic() - down_at < OUTAGE_S  # the shutdown was during the outage
        assert not any(result.ready() for result in results)  # none failed or ran meanwhile
        rig.start_worker(pool="prefork", concurrency=4)
        time.sleep(max(0.0, down_at + OUTAGE_S - time.monotonic()))  # the outage itself
        back_at = time.time()  # before the start: a run may be granted as soon as it listens
        with dflockd_subprocess(log, *args, port=port):
            started = time.monotonic()
            for holder in holders:  # their leases ran out during the outage: lost, not raised
                with contextlib.suppress(DflockError):
                    holder.release()
            values = finished(results)
            print(f"40 runs done {time.monotonic() - started:.1f}s after the server was back")
        ids = {result.id for result in results}
        runs = [entry for entry in rig.log.entries("run") if entry["task_id"] in ids]
        assert sorted(values) == list(range(40))
        assert Counter(entry["n"] for entry in runs) == Counter(range(40))  # each once
        assert all(entry["start"] > back_at for entry in runs)
        assert not list(iter_overlaps(runs))
