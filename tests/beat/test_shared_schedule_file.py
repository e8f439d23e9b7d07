"""Singleton beats that share beat's default schedule file: failover after failover.

Two ``celery beat -S celery_dflock.beat:SingletonScheduler`` in one folder, with no ``-s``: both
keep the default ``celerybeat-schedule`` there (``PersistentScheduler``'s shelve). The active one
is stopped (SIGTERM) ten times in a row, a new beat started each time so there are always two;
the broker is the record of what was sent, when (see ``beatapp``).
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Callable

import pytest

from celery_dflock.beat import DEFAULT_BEAT_LEASE_TTL_S
from tests.support.beats import Broker, Cluster, Proc, Sent, assert_no_double_send

pytestmark = [pytest.mark.redis, pytest.mark.slow]

PERIOD_S = 1.0
ROUNDS = 10
SLACK_S = 15.0
"""Generous: beat start-up, Redis polling and a loaded 2-core machine, on top of the bound."""
MAX_GAP_S = PERIOD_S + DEFAULT_BEAT_LEASE_TTL_S + SLACK_S
FAILED = re.compile(r"Traceback|ERROR/|CRITICAL/|\w+Error\b|corrupted")


def _wait_new_sends(broker: Broker, cluster: Cluster, after: int, count: int) -> list[Sent]:
    """Wait for ``count`` sends beyond the first ``after``; fail at once if a live beat dies."""
    deadline = time.monotonic() + MAX_GAP_S + 30
    while True:
        sent = broker.sent()
        if len(sent) >= after + count:
            return sent
        running = [b for b in cluster.beats() if b.proc.returncode is None]
        dead = [b for b in running if not b.alive()]
        assert not dead, "\n\n".join(f"{b.name} died:\n{b.output()}" for b in dead)
        assert time.monotonic() < deadline, (
            f"no {count} new sends within {MAX_GAP_S + 30:.0f}s:\n"
            + "\n\n".join(f"{b.name}:\n{b.output(30)}" for b in running)
        )
        time.sleep(0.05)


@pytest.mark.timeout(600)  # ~25 s on an idle machine; ten beat start-ups on a loaded one
def test_ten_failovers_with_beats_sharing_the_default_schedule_file(
    make_cluster: Callable[..., Cluster], broker: Broker
) -> None:
    cluster = make_cluster()
    del cluster.settings["dflock_beat_lease_ttl"]  # the default lease
    cluster.start_beats(2, own_schedule_file=False)
    sent = _wait_new_sends(broker, cluster, after=0, count=2)

    stopped: list[Proc] = []
    for _ in range(ROUNDS):
        active = cluster.by_pid(sent[-1].pid)
        code = active.stop()
        stopped.append(active)
        assert code == 0, f"{active.name} exited with {code}:\n{active.output()}"
        before = len(broker.sent())
        cluster.start_beat(own_schedule_file=False)
        sent = _wait_new_sends(broker, cluster, after=before, count=2)
        assert sent[-1].pid != active.pid

    times = sorted(m.at for m in broker.sent())
    gaps = [after - before for before, after in itertools.pairwise(times)]
    print(f"{len(times)} sends; gaps (s): {' '.join(f'{g:.2f}' for g in gaps)}")
    print(f"largest gap {max(gaps):.2f}s (bound {MAX_GAP_S:.0f}s)")

    assert (cluster.directory / "celerybeat-schedule.dat").exists() or (
        cluster.directory / "celerybeat-schedule"
    ).exists(), "the beats did not use the default schedule file"
    for beat in cluster.beats():
        failed = [line for line in beat.lines() if FAILED.search(line)]
        assert not failed, f"{beat.name} logged an error:\n{beat.output()}"
    running = [b for b in cluster.beats() if b not in stopped]
    assert len(running) == 2
    assert all(b.alive() for b in running), [b.output() for b in running if not b.alive()]
    assert max(gaps) <= MAX_GAP_S, f"sending stopped for {max(gaps):.2f}s"
    assert_no_double_send(broker.sent(), PERIOD_S)  # no run sent again across the failovers
