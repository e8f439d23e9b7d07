"""SingletonScheduler around the schedulers whose schedule is edited while beat runs, on their
real stores: django-celery-beat's ``DatabaseScheduler`` on PostgreSQL (a schema of the test's
own) and celery-redbeat on Redis (a key prefix of the test's own).

Each test configures its beats with docs/beat.md's block for that scheduler, as written (the
test's own lock server, Redis and names put over it), starts three real ``celery beat``
processes, and checks: one beat sends; an entry added by the page's edit block while they run
(its 30 s period made 1 s; made while a send of that beat leaves late, as on a loaded machine,
so that a reload of the entries follows a late send) is sent by it; ``kill -9`` of that beat
hands over within the beat's session (a 60 s lease, far longer: the session's end freed the
lock); no run is sent twice. One start of three beats per scheduler covers all of it. With no
worker consuming, what the beats send stays in the Redis queue, stamped with the sender's pid,
the send time and the run's time (tests/beat/beatapp.py).
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.docs.docs_blocks import DOCS, blocks
from tests.fencing.stores import create_schema, django_database, drop_schema, new_schema_name
from tests.support.beats import (
    ACTIVE,
    REDIS_URL,
    Broker,
    Cluster,
    Sent,
    assert_no_double_send,
)
from tests.support.services import require_postgres

# 33 s and 19 s on a quiet machine, five or six interpreters started one after the other (a
# migration, three beats, the edit): room for CI's load above the suite's 120 s.
pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(240)]

BEAT_PAGE = DOCS / "beat.md"
PERIOD_S = 1.0
"""The period of both entries: the app's ``every-second`` and the one the edit adds."""
SCHEDULED = "beatapp.tick"
"""The task of the app's ``beat_schedule`` entry (tests/support/beats.py)."""
ADDED = "proj.refresh_rates"
"""The task of the entry the page's edit block adds (no worker needs to know it)."""
SESSION_TTL_S = 6
"""The beats' session with the lock server (``dflock_session_ttl``): a beat killed outright
keeps the lock this long (docs/beat.md). Short, so that the test waits little, yet a stall of a
beat on a loaded machine shorter than about 4 s (two thirds of it) costs it nothing."""
LEASE_TTL_S = 60
"""The leader lock's lease: far longer than the session, so a takeover well before it comes
from the session's end."""
TAKEOVER_BOUND_S = 30.0
"""Bound on the kill -> first send of the new leader: the session (6 s), the grant, at most one
period before the first send, and a loaded machine's slack (a release at once took 5 s there),
and still half the lease: a takeover after the lease would take over 60 s."""
OUTPUT_LAG_S = 10.0
"""How long to wait for a line a beat has already written (read by a thread that a loaded
machine lets fall behind)."""
START_FROM_NOW = "runs next one period from now"
CONTINUES = "continues from the last run its store recorded"
EDIT_TIMEOUT_S = 30.0
"""How long the added entry may take to be sent twice: the active beat sees the change at its
next tick (``beat_max_loop_interval``, 1 s here)."""


def page_block(*needles: str) -> str:
    """The one python block of docs/beat.md that contains every one of ``needles``."""
    found = [
        b.code
        for b in blocks(BEAT_PAGE)
        if b.lang == "python" and all(needle in b.code for needle in needles)
    ]
    assert len(found) == 1, f"docs/beat.md: {len(found)} python blocks contain {needles}"
    return found[0]


def with_period_of_one_second(code: str, written: str, fast: str) -> str:
    """The page's edit block with its 30 s period made 1 s (nothing else changed)."""
    assert written in code, f"the page's edit block no longer says {written!r}:\n{code}"
    return code.replace(written, fast)


def beat_settings(**more: Any) -> dict[str, Any]:
    """What the test puts over the page's block: a 1 s loop, the session and lease above."""
    return {
        "beat_max_loop_interval": 1,
        "dflock_session_ttl": SESSION_TTL_S,
        "dflock_beat_lease_ttl": LEASE_TTL_S,
        **more,
    }


def edit_during_a_late_send(edit: str) -> str:
    """``edit`` (its imports first), made while the leader's next send of the app's entry is
    held back :data:`tests.beat.beatapp.LATE_SEND_S` after beat reserved its run, so the leader
    meets the change (``DatabaseScheduler`` reloads its entries) right after a late send."""
    lines = edit.splitlines(keepends=True)
    body = next(i for i, line in enumerate(lines) if not line.startswith(("import ", "from ")))
    late = (
        "import pathlib, time\n"
        "late = pathlib.Path('late-send')\n"
        "late.touch()\n"
        "while late.exists():\n"
        "    time.sleep(0.005)\n"
    )
    return "".join(lines[:body]) + late + "".join(lines[body:])


def by_task(sent: list[Sent], task: str) -> list[Sent]:
    return [m for m in sent if m.entry == task]


def three_beats_follow_an_edit_and_hand_over(
    cluster: Cluster, broker: Broker, edit: str, wrapped: str, takeover: str
) -> None:
    """The scenario both tests run (see the module documentation); ``takeover``: what the new
    leader logs of the entries' last runs when it takes over."""
    beats = cluster.start_beats(3)
    leader = cluster.by_pid(broker.wait_sent(2, timeout=60, entry=SCHEDULED)[0].pid)
    for beat in beats:
        assert f"Singleton{wrapped}" in beat.output(200)  # the banner

    cluster.run_python(edit_during_a_late_send(edit))  # the page's edit, while the beats run
    broker.wait_sent(2, timeout=EDIT_TIMEOUT_S, entry=ADDED)

    leader.send(signal.SIGKILL)
    killed_at = time.time()
    leader.kill()
    taken = broker.wait_sent(1, timeout=TAKEOVER_BOUND_S + 10, after=killed_at)[0]
    latency = taken.at - killed_at
    print(f"kill -9 -> first send of the new leader: {latency:.2f}s")
    assert latency < TAKEOVER_BOUND_S, (
        f"the new leader sent {latency:.2f}s after the kill: it waited for the lease "
        f"({LEASE_TTL_S} s), not the session ({SESSION_TTL_S} s)"
    )
    successor = cluster.by_pid(taken.pid)
    assert successor is not leader
    successor.wait_line(re.compile(re.escape(takeover)), timeout=OUTPUT_LAG_S)
    for task in (SCHEDULED, ADDED):  # both entries, the edited one included, carry on
        broker.wait_sent(2, timeout=EDIT_TIMEOUT_S, entry=task, pid=successor.pid)

    sent = broker.sent()
    assert {m.pid for m in sent} == {leader.pid, successor.pid}, "a third beat sent"
    assert all(m.at < killed_at for m in sent if m.pid == leader.pid)
    assert all(m.at > killed_at for m in sent if m.pid == successor.pid)
    for task in (SCHEDULED, ADDED):
        assert_no_double_send(by_task(sent, task), PERIOD_S)
    third = next(b for b in beats if b not in (leader, successor))
    assert third.count(ACTIVE) == 0, third.output()


@pytest.fixture
def postgres_schema() -> Iterator[str]:
    """A PostgreSQL schema of this test's own (CI runs tests side by side on one database)."""
    require_postgres()
    schema = new_schema_name()
    create_schema(schema, tables=False)
    yield schema
    drop_schema(schema)


def test_django_celery_beat_database_scheduler_on_postgresql(
    postgres_schema: str, make_cluster: Callable[..., Cluster], broker: Broker
) -> None:
    pytest.importorskip("django_celery_beat", reason="django-celery-beat is not installed")
    config = page_block("dflock_beat_scheduler", "DatabaseScheduler")
    edit = with_period_of_one_second(page_block("PeriodicTask.objects"), "every=30,", "every=1,")
    cluster = make_cluster(**beat_settings())
    cluster.extra_env["BEAT_TEST_CONFIG"] = config
    cluster.extra_env["BEAT_TEST_DJANGO_DATABASE"] = json.dumps(django_database(postgres_schema))
    cluster.run_python(
        "import beatapp\n"
        "from django.core.management import call_command\n"
        "call_command('migrate', verbosity=0)\n"
    )
    three_beats_follow_an_edit_and_hand_over(
        cluster, broker, "import beatapp\n" + edit, "DatabaseScheduler", START_FROM_NOW
    )
    sent = broker.sent()
    names = {m.entry: m.headers.get("periodic_task_name") for m in sent}
    assert names == {SCHEDULED: "every-second", ADDED: "refresh-rates"}, names


ONE_OFF = "proj.once"
"""The task of the clocked one-off entry the test below adds (no worker needs to know it)."""


def test_a_django_celery_beat_one_off_sent_before_a_kill_is_not_sent_again(
    postgres_schema: str, make_cluster: Callable[..., Cluster], broker: Broker
) -> None:
    """A clocked one-off entry (``one_off=True``) that the leader sent, then ``kill -9`` at
    once: the next leader does not send it again. ``DatabaseScheduler`` writes a run to the
    database only at its next sync (every 3 minutes), so the next leader read the entry as
    never run and sent it a second time; the singleton beat now syncs just before sending a
    one-off entry."""
    pytest.importorskip("django_celery_beat", reason="django-celery-beat is not installed")
    cluster = make_cluster(**beat_settings())
    cluster.extra_env["BEAT_TEST_CONFIG"] = page_block("dflock_beat_scheduler", "DatabaseScheduler")
    cluster.extra_env["BEAT_TEST_DJANGO_DATABASE"] = json.dumps(django_database(postgres_schema))
    cluster.run_python(
        "import datetime\n"
        "import beatapp\n"
        "from django.core.management import call_command\n"
        "from django.utils import timezone\n"
        "call_command('migrate', verbosity=0)\n"
        "from django_celery_beat.models import ClockedSchedule, PeriodicTask\n"
        "at = timezone.now() + datetime.timedelta(seconds=15)  # once both beats run\n"
        "clocked = ClockedSchedule.objects.create(clocked_time=at)\n"
        f"PeriodicTask.objects.create(name='once', task={ONE_OFF!r}, clocked=clocked,\n"
        "                            one_off=True)\n"
    )
    cluster.start_beats(2)
    once = broker.wait_sent(1, timeout=60, entry=ONE_OFF)[0]
    leader = cluster.by_pid(once.pid)
    leader.send(signal.SIGKILL)
    killed_at = time.time()
    leader.kill()
    taken = broker.wait_sent(1, timeout=TAKEOVER_BOUND_S + 10, after=killed_at)[0]
    successor = cluster.by_pid(taken.pid)
    assert successor is not leader
    successor.wait_line(re.compile(re.escape(START_FROM_NOW)), timeout=OUTPUT_LAG_S)
    # Ticks of the new leader (a 1 s loop) past its takeover: each sends the app's entry.
    broker.wait_sent(3, timeout=EDIT_TIMEOUT_S, entry=SCHEDULED, pid=successor.pid)
    sent = by_task(broker.sent(), ONE_OFF)
    assert [m.pid for m in sent] == [leader.pid], sent


def test_redbeat_scheduler_on_redis(
    queue: str, make_cluster: Callable[..., Cluster], broker: Broker
) -> None:
    pytest.importorskip("redbeat", reason="celery-redbeat is not installed")
    config = page_block("dflock_beat_scheduler", "redbeat:RedBeatScheduler")
    edit = with_period_of_one_second(
        page_block("RedBeatSchedulerEntry("), "schedule(30.0)", "schedule(1.0)"
    )
    prefix = f"{queue}:redbeat:"  # under the queue's name: the broker view's cleanup removes it
    cluster = make_cluster(
        **beat_settings(
            redbeat_redis_url=REDIS_URL,
            redbeat_key_prefix=prefix,
            redbeat_redis_options={},  # not the broker's transport options (RedBeat warns)
        )
    )
    cluster.extra_env["BEAT_TEST_CONFIG"] = config
    three_beats_follow_an_edit_and_hand_over(
        cluster, broker, "from beatapp import app\n" + edit, "RedBeatScheduler", CONTINUES
    )
    assert broker.client.exists(f"{prefix}:schedule"), "the schedule is not in Redis"


def test_the_migration_page_shows_the_redbeat_config_run_here() -> None:
    """docs/migration.md's RedBeat "after" block is the one the test above runs on real beats."""
    migration = [
        b.code
        for b in blocks(DOCS / "migration.md")
        if b.lang == "python" and not b.not_run and "redbeat:RedBeatScheduler" in b.code
    ]
    assert migration == [page_block("dflock_beat_scheduler", "redbeat:RedBeatScheduler")]
