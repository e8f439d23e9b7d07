"""SingletonScheduler in-process: settings, class composition, the takeover gate, headers.

A real Celery app on kombu's in-memory broker and a real lock server (port 0); what beat
publishes is caught with Celery's ``before_task_publish`` signal.
"""

from __future__ import annotations

import logging
import shelve
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from celery import Celery, signals
from celery.beat import PersistentScheduler, Scheduler

from celery_dflock import Client, DistributedLock
from celery_dflock._request import read_message_options
from celery_dflock.beat import BEAT_ENTRY_HEADER, Leadership, SingletonScheduler
from celery_dflock.config import DflockConfigError
from celery_dflock.task import LOCK_OPTIONS_HEADER
from dflockd_server.testing import ServerThread
from tests.support.apps import make_app

ACTIVE_TIMEOUT_S = 10.0


class CustomScheduler(PersistentScheduler):
    """Stands for any scheduler a project already uses."""


class ExplicitSingleton(SingletonScheduler, CustomScheduler):
    """A project may also compose the class itself."""


def beat_app(server: ServerThread | None = None, main: str = "proj", **conf: Any) -> Celery:
    servers = f"{server.host}:{server.port}" if server else "127.0.0.1:9"
    return make_app(main, broker_url="memory://", beat_max_loop_interval=1, servers=servers, **conf)


def test_default_wraps_persistent_scheduler(tmp_path: Path, dflock_server: ServerThread) -> None:
    app = beat_app(dflock_server)
    scheduler = SingletonScheduler(app=app, schedule_filename=str(tmp_path / "s"), lazy=True)
    assert isinstance(scheduler, SingletonScheduler)
    assert isinstance(scheduler, PersistentScheduler)
    assert type(scheduler).__name__ == "SingletonPersistentScheduler"
    host, port = dflock_server.address
    assert f". dflock -> lock 'celery-beat:proj' on {host}:{port}" in scheduler.info
    assert f". db -> {tmp_path / 's'}" in scheduler.info


def test_the_configured_scheduler_class_is_wrapped(tmp_path: Path) -> None:
    app = beat_app(dflock_beat_scheduler=CustomScheduler)
    scheduler = SingletonScheduler(app=app, schedule_filename=str(tmp_path / "s"), lazy=True)
    assert isinstance(scheduler, CustomScheduler)
    assert type(scheduler).__mro__[1:3] == (SingletonScheduler, CustomScheduler)

    by_path = beat_app(dflock_beat_scheduler="celery.beat:Scheduler")
    plain = SingletonScheduler(app=by_path, lazy=True)
    assert type(plain).__mro__[1:3] == (SingletonScheduler, Scheduler)


def test_unset_it_wraps_the_apps_beat_scheduler(tmp_path: Path) -> None:
    """A project that names its scheduler in ``beat_scheduler`` (django-celery-beat's and
    RedBeat's setups) and starts beat with ``-S celery_dflock.beat:SingletonScheduler`` gets
    that scheduler wrapped (the persistent one, ignoring the schedule it keeps, was); a
    ``beat_scheduler`` naming SingletonScheduler itself leaves the default."""
    app = beat_app(beat_scheduler=CustomScheduler)
    scheduler = SingletonScheduler(app=app, schedule_filename=str(tmp_path / "s"), lazy=True)
    assert type(scheduler).__mro__[1:3] == (SingletonScheduler, CustomScheduler)
    by_path = beat_app(beat_scheduler="celery.beat:Scheduler")
    assert type(SingletonScheduler(app=by_path, lazy=True)).__mro__[1:3] == (
        SingletonScheduler,
        Scheduler,
    )
    itself = beat_app(beat_scheduler="celery_dflock.beat:SingletonScheduler")
    default = SingletonScheduler(app=itself, schedule_filename=str(tmp_path / "d"), lazy=True)
    assert type(default).__mro__[1:3] == (SingletonScheduler, PersistentScheduler)
    chosen = beat_app(beat_scheduler=CustomScheduler, dflock_beat_scheduler="celery.beat:Scheduler")
    assert type(SingletonScheduler(app=chosen, lazy=True)).__mro__[1:3] == (
        SingletonScheduler,
        Scheduler,
    )


_ALIASED = """
import django
from django.conf import settings

settings.configure(
    INSTALLED_APPS=["django_celery_beat"],
    DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
)
django.setup()
from celery import Celery
from django_celery_beat.schedulers import DatabaseScheduler

from celery_dflock.beat import BeatSettings
from celery_dflock.config import get_config

for conf in ({"beat_scheduler": "django"}, {"dflock_beat_scheduler": "django"}):
    app = Celery("proj", broker="memory://")
    app.conf.update(dflock_servers=["127.0.0.1:9"], **conf)
    assert BeatSettings.from_app(app, get_config(app)).scheduler is DatabaseScheduler, conf
print("ok")
"""


def test_a_scheduler_s_alias_names_the_class_celery_would_load() -> None:
    """``beat_scheduler = "django"`` (the alias django-celery-beat registers, which ``celery
    beat -S`` takes) is the class Celery would load: SingletonScheduler wraps it (it refused
    the start, taking the alias for the module ``django``)."""
    pytest.importorskip("django_celery_beat", reason="django-celery-beat is not installed")
    done = subprocess.run(
        [sys.executable, "-c", _ALIASED], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.stdout.strip() == "ok", done.stderr[-2000:]


def test_a_composed_subclass_is_used_as_it_is(tmp_path: Path) -> None:
    app = beat_app(dflock_beat_scheduler="celery.beat:Scheduler")  # ignored: Mine brings one
    scheduler = ExplicitSingleton(app=app, schedule_filename=str(tmp_path / "s"), lazy=True)
    assert type(scheduler) is ExplicitSingleton


def test_lock_key_default_prefix_and_safety() -> None:
    assert "'celery-beat:proj'" in SingletonScheduler(app=beat_app(), lazy=True).lock_description
    spaced = SingletonScheduler(app=beat_app(main="my proj", dflock_key_prefix="t1:"), lazy=True)
    key = spaced.lock_description.split("'")[1]
    assert key.startswith("t1:celery-beat:my_proj")
    assert " " not in key
    named = SingletonScheduler(app=beat_app(dflock_beat_lock_key="beat:eu"), lazy=True)
    assert "'beat:eu'" in named.lock_description


@pytest.mark.parametrize(
    ("setting", "value", "message"),
    [
        ("dflock_beat_scheduler", "no_such_module:Sched", "cannot import"),
        ("dflock_beat_scheduler", "celery_dflock.beat:BEAT_ENTRY_HEADER", "Scheduler subclass"),
        ("dflock_beat_scheduler", SingletonScheduler, "already is a SingletonScheduler"),
        ("dflock_beat_lease_ttl", 0, "must be between 1 and"),
        ("dflock_beat_lease_ttl", "10", "must be a whole number of seconds"),
        ("dflock_beat_nonoverlap", "yes", "True or False"),
        ("dflock_beat_lock_key", " ", "non-empty string"),
        ("dflock_servers", "localhost", "not 'host:port'"),
    ],
)
def test_bad_settings_are_named(setting: str, value: object, message: str) -> None:
    app = beat_app()
    app.conf[setting] = value
    with pytest.raises(DflockConfigError, match=message) as info:
        SingletonScheduler(app=app, lazy=True)
    assert setting in str(info.value)


# --------------------------------------------------------------------------- an active beat


@pytest.fixture
def published() -> Iterator[list[dict[str, Any]]]:
    """Headers of every message published in this process during the test."""
    seen: list[dict[str, Any]] = []

    def record(headers: dict[str, Any] | None = None, **_: Any) -> None:
        seen.append(dict(headers or {}))

    signals.before_task_publish.connect(record, weak=False)
    yield seen
    signals.before_task_publish.disconnect(record)


def run_until(scheduler: Scheduler, condition: Any, timeout: float = ACTIVE_TIMEOUT_S) -> None:
    """Tick like beat's loop (sleeping what tick asks, at most 0.1 s) until ``condition()``."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        interval = scheduler.tick()
        if interval > 0:
            time.sleep(min(interval, 0.1))


@pytest.fixture
def make_active(tmp_path: Path, dflock_server: ServerThread) -> Iterator[Any]:
    schedulers: list[Scheduler] = []

    def make(schedule: dict[str, Any], **conf: Any) -> Scheduler:
        app = beat_app(dflock_server, beat_schedule=schedule, **conf)
        scheduler = SingletonScheduler(app=app, schedule_filename=str(tmp_path / "s"))
        schedulers.append(scheduler)
        return scheduler

    yield make
    for scheduler in schedulers:
        scheduler.close()


def test_a_run_that_fell_due_before_the_takeover_is_not_sent(
    make_active: Any, published: list[dict[str, Any]], caplog: pytest.LogCaptureFixture
) -> None:
    scheduler = make_active({"e": {"task": "proj.noop", "schedule": 0.2}})
    run_until(scheduler, lambda: len(published) >= 1)
    taken_over = scheduler.schedule["e"].last_run_at

    # A scheduler that re-reads its store may bring back a last_run_at older than the takeover.
    stale = scheduler.schedule["e"]
    stale.last_run_at = taken_over - timedelta(hours=1)
    scheduler._heap = None  # pyright: ignore[reportAttributeAccessIssue]
    caplog.set_level(logging.INFO, logger="celery_dflock.beat")
    sent_before = len(published)
    scheduler.tick()

    assert len(published) == sent_before
    assert "fell due before this beat took over" in caplog.text
    assert scheduler.schedule["e"].last_run_at > taken_over  # reserve moved it on to now
    run_until(scheduler, lambda: len(published) > sent_before)  # and it runs again after that


def test_nonoverlap_marks_every_message_with_its_entry(
    make_active: Any, published: list[dict[str, Any]]
) -> None:
    options = {"lock_ttl": 60, "headers": {"tenant": "t1"}}
    scheduler = make_active(
        {
            "every {x}": {"task": "proj.noop", "schedule": 0.2, "options": options},
            "opted out": {
                "task": "proj.noop",
                "schedule": 0.2,
                "options": {"headers": {BEAT_ENTRY_HEADER: None}},
            },
        },
        dflock_beat_nonoverlap=True,
    )
    run_until(scheduler, lambda: len(published) >= 4)

    marked = [h for h in published if h.get(BEAT_ENTRY_HEADER) == "every {x}"]
    assert marked
    for headers in marked:
        assert headers["tenant"] == "t1"
        # The entry's own options (per call), and the entry, named for the worker.
        sent = headers[LOCK_OPTIONS_HEADER]
        assert sent == {"lock_ttl": 60, BEAT_ENTRY_HEADER: "every {x}"}
        call, beat = read_message_options(sent, "the entry's message")
        assert call.by_name() == {"lock_ttl": 60}
        # The entry's key and "skip": the worker ranks them below the task's own options.
        assert beat is not None
        assert beat.by_name() == {
            "lock_key": "beat-entry:every {{x}}",  # a template with no fields: the literal name
            "on_locked": "skip",
        }
    opted_out = [h for h in published if BEAT_ENTRY_HEADER in h and not h[BEAT_ENTRY_HEADER]]
    assert opted_out
    assert all(LOCK_OPTIONS_HEADER not in h for h in opted_out)
    assert scheduler.schedule["every {x}"].options == options  # the stored entry is untouched


@pytest.mark.parametrize(
    ("headers", "named"),
    [
        ("x", "options['headers']"),
        ({LOCK_OPTIONS_HEADER: "x"}, "options['headers']['dflock_options']"),
    ],
)
def test_an_entry_whose_headers_are_no_mapping_is_named_in_the_log(
    make_active: Any,
    published: list[dict[str, Any]],
    caplog: pytest.LogCaptureFixture,
    headers: object,
    named: str,
) -> None:
    """It logged Python's ``dictionary update sequence element #0 has length 1; 2 is
    required`` at every run, naming neither the entry nor the option."""
    caplog.set_level(logging.WARNING)
    scheduler = make_active(
        {
            "bad": {"task": "proj.noop", "schedule": 0.2, "options": {"headers": headers}},
            "good": {"task": "proj.noop", "schedule": 0.2},
        },
        dflock_beat_nonoverlap=True,
    )
    run_until(scheduler, lambda: len(published) >= 2)
    assert all(h[BEAT_ENTRY_HEADER] == "good" for h in published)  # the others go on
    assert f"beat entry 'bad': {named} must be a mapping (a dict), not str 'x'" in caplog.text


def test_a_standby_leaves_the_schedule_file_alone_until_it_is_active(
    tmp_path: Path, dflock_server: ServerThread, published: list[dict[str, Any]]
) -> None:
    from celery_dflock import DistributedLock

    app = beat_app(dflock_server, beat_schedule={"e": {"task": "proj.noop", "schedule": 0.2}})
    holder = DistributedLock("celery-beat:proj", servers=[dflock_server.address])
    assert holder.acquire()
    path = tmp_path / "celerybeat-schedule"
    # Built as beat builds it (lazy=False); with the lock held elsewhere it is a standby.
    scheduler = SingletonScheduler(app=app, schedule_filename=str(path))
    try:
        scheduler.tick()
        scheduler._do_sync()  # pyright: ignore[reportAttributeAccessIssue]  # beat's loop does
        assert not list(tmp_path.iterdir()), "a standby opened the schedule store"

        holder.release()
        run_until(scheduler, lambda: len(published) >= 1)
        assert list(tmp_path.glob("celerybeat-schedule*")), "the active beat has its store"
    finally:
        scheduler.close()
        holder.release()
    with shelve.open(str(path)) as stored:  # written and closed before the lock was released
        assert "e" in stored["entries"]


def test_a_send_the_lock_server_does_not_confirm_is_declined_without_error(
    make_active: Any,
    published: list[dict[str, Any]],
    dflock_server: ServerThread,
    caplog: pytest.LogCaptureFixture,
) -> None:
    scheduler = make_active({"e": {"task": "proj.noop", "schedule": 0.2}})
    run_until(scheduler, lambda: len(published) >= 1)
    dflock_server.stop()
    caplog.set_level(logging.INFO)
    sent_before = len(published)

    # What Celery's tick does with a due entry. Celery 5.3.0-5.3.1 read ``.id`` of the
    # result of apply_async unchecked in apply_entry: a declined send must not get there.
    scheduler.apply_entry(scheduler.schedule["e"], producer=scheduler.producer)  # pyright: ignore[reportAttributeAccessIssue]
    scheduler.tick()  # and beat goes on, as a standby

    assert len(published) == sent_before
    assert "not sending 'e'" in caplog.text
    assert "Sending due task" not in caplog.text


def test_a_wrapped_redbeat_with_its_own_lock_on_is_refused() -> None:
    """RedBeat's own Redis lock would hold every standby in beat's start-up (and a killed
    beat's place for redbeat_lock_timeout): the error says to turn it off."""
    pytest.importorskip("redbeat", reason="celery-redbeat is not installed")

    def redbeat_app(**conf: Any) -> Celery:
        return beat_app(
            dflock_beat_scheduler="redbeat:RedBeatScheduler",
            redbeat_redis_url="redis://127.0.0.1:9/0",
            **conf,
        )

    with pytest.raises(DflockConfigError, match=r"redbeat_lock_key = None") as info:
        SingletonScheduler(app=redbeat_app(), lazy=True)
    assert "'redbeat::lock'" in str(info.value)
    scheduler = SingletonScheduler(app=redbeat_app(redbeat_lock_key=None), lazy=True)
    assert type(scheduler).__name__ == "SingletonRedBeatScheduler"


def test_a_leader_whose_lock_was_gone_when_it_stopped_says_so(
    dflock_server: ServerThread, caplog: pytest.LogCaptureFixture
) -> None:
    """A leader stopping whose lock the server no longer held (its lease lapsed while it was
    paused, or an operator released it) warns that another beat may have been sending; it
    logged "released", as for a lock it had handed on."""
    made: list[DistributedLock] = []
    with Client([dflock_server.address]) as client, Client([dflock_server.address]) as other:

        def make_lock(on_lost: Any) -> DistributedLock:
            made.append(client.lock("beat-gone", lease_ttl_s=30, on_lost=on_lost))
            return made[-1]

        leadership = Leadership(make_lock, "lock 'beat-gone'")
        leadership.start()
        assert leadership.wait_active(ACTIVE_TIMEOUT_S)
        token = made[-1].token
        assert token is not None
        assert other.release("beat-gone", token)  # the server no longer holds it for the beat
        caplog.set_level(logging.INFO, logger="celery_dflock.beat")
        leadership.stop()
    assert "beat: released" not in caplog.text
    assert "was no longer held when this beat stopped" in caplog.text


def test_a_message_naming_no_entry_reads_as_its_call_options_alone() -> None:
    """An entry header present but empty (an entry that opted out, forwarded by hand) is no
    unknown lock option: the options read as given, without beat's."""
    call, beat = read_message_options({"lock_ttl": 60, BEAT_ENTRY_HEADER: None}, "a message")
    assert call.by_name() == {"lock_ttl": 60} and beat is None
    call, beat = read_message_options({"lock_ttl": 60}, "a message")
    assert call.by_name() == {"lock_ttl": 60} and beat is None
