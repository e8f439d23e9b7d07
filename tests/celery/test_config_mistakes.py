"""Config mistakes are caught early and named in the user's terms (issue 13, points 8 and 10):
bad task attributes at bind, misspelt and upper-case settings, a ``dflock_task_locks`` entry
that names no task (warned at worker start, with the close matches), and the held-lock records
that a worker killed with -9 leaves behind (cleaned up at the next worker's start)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from celery import Celery
from celery.signals import before_task_publish

from celery_dflock import Client, LockedTask, _runtime
from celery_dflock._worker_hooks import countdowns_past_visibility
from celery_dflock.config import DflockConfigError, get_config
from dflockd_server.testing import ServerThread
from tests.support.apps import make_app
from tests.support.ports import free_port
from tests.support.processes import python_path
from tests.support.rigs import unique
from tests.support.services import require_redis
from tests.support.workers import (
    CELERY_APPS_DIR,
    REPO,
    EventLog,
    WorkerFactory,
    redis_cleanup,
    redis_settings,
    with_server,
    worker_command,
)


def mistaken_app(**conf: Any) -> Celery:
    return make_app("config-mistakes", eager=True, **conf)


@pytest.mark.parametrize(
    ("attribute", "value", "says"),
    [
        ("on_locked", "nope", "'retry', 'skip', 'raise'"),
        ("lock_ttl", -1, "must be between 1 and"),
        ("on_lock_lost", "explode", "'interrupt', 'flag', 'terminate'"),
        ("lock_limit", 0, "from 1 to"),
        ("lock_max_retries", -2, "whole number of retries"),
        ("lock_from", "queue", "must be 'run'"),
        ("on_duplicate", "skip", "must be 'return'"),
        ("lock_pending_ttl", 0, "must be between 1 and"),
    ],
)
def test_a_bad_task_attribute_fails_when_the_task_is_bound(
    attribute: str, value: object, says: str
) -> None:
    app = mistaken_app()

    @app.task(shared=False, base=LockedTask, lock_key="k", **{attribute: value})
    def job() -> None: ...

    task: Any = job
    with pytest.raises(DflockConfigError, match=f"attribute {attribute} of task") as failure:
        app.finalize()
        _ = app.tasks[task.name]
    assert says in str(failure.value)
    app.close()


def test_a_misspelt_setting_is_refused_with_the_close_match() -> None:
    app = mistaken_app(dflock_server="127.0.0.1:6388")
    with pytest.raises(DflockConfigError, match=r"app\.conf\.dflock_server is not") as failure:
        get_config(app)
    assert "did you mean 'dflock_servers'" in str(failure.value)
    app.close()


def test_a_misspelt_setting_under_the_apps_namespace_is_refused() -> None:
    """Django's way (``config_from_object(settings, namespace="CELERY")``): the settings are
    ``CELERY_DFLOCK_*``, and a typo among them is refused as a bare ``dflock_*`` one is."""

    class DjangoSettings:
        CELERY_DFLOCK_SERVERS = "127.0.0.1:6390"
        CELERY_DFLOCK_LOCK_TLL = 60

    app = mistaken_app()
    app.config_from_object(DjangoSettings, namespace="CELERY")
    with pytest.raises(DflockConfigError, match=r"app\.conf\.CELERY_DFLOCK_LOCK_TLL is not") as e:
        get_config(app)
    assert "did you mean 'dflock_lock_ttl'" in str(e.value)
    del DjangoSettings.CELERY_DFLOCK_LOCK_TLL
    app.config_from_object(DjangoSettings, namespace="CELERY", force=True)
    assert get_config(app).client.servers == (("127.0.0.1", 6390),)
    app.close()


def test_upper_case_settings_are_read(dflock_server: ServerThread) -> None:
    """Celery's old setting style (DFLOCK_SERVERS) is honoured, not silently ignored."""
    app = mistaken_app(
        DFLOCK_SERVERS=f"{dflock_server.host}:{dflock_server.port}",
        DFLOCK_KEY_PREFIX="upper:",
        DFLOCK_ON_LOCKED="raise",
    )
    config = get_config(app)
    assert config.client.servers == ((dflock_server.host, dflock_server.port),)
    assert config.key_prefix == "upper:"
    assert config.defaults.on_locked == "raise"

    @app.task(shared=False, bind=True, base=LockedTask, lock_key="u")
    def job(self: Any) -> str:
        return str(self.request.dflock_key)

    task: Any = job
    assert task.delay().get(timeout=10) == "upper:u"
    app.close()


@pytest.fixture
def factory(
    tmp_path: Path, dflock_server: ServerThread, fs_settings: dict[str, Any]
) -> Iterator[Callable[..., WorkerFactory]]:
    made: list[WorkerFactory] = []
    logs: list[EventLog] = []

    def make(**extra: Any) -> WorkerFactory:
        log = EventLog(tmp_path)
        logs.append(log)
        worker_factory = WorkerFactory(
            log=log, directory=tmp_path, settings=with_server(fs_settings, dflock_server, **extra)
        )
        made.append(worker_factory)
        return worker_factory

    yield make
    for worker_factory in made:
        worker_factory.close()
    for log in logs:
        log.close()


def test_a_task_locks_entry_naming_no_task_is_warned_at_worker_start(
    factory: Callable[..., WorkerFactory],
) -> None:
    workers = factory(
        dflock_task_locks={"apps.plain.third_party_reprot": {"lock_key": "r:{customer_id}"}}
    )
    worker = workers.start(app="apps.plain", pool="solo", concurrency=1)
    expected = (
        "dflock_task_locks names 'apps.plain.third_party_reprot', which no task of this app "
        "has, so it is not locked; did you mean 'apps.plain.third_party_report'?"
    )
    assert worker.wait_output(expected, timeout=10), worker.output()[-3000:]
    assert "WARNING" in worker.output()


def test_a_worker_logs_at_start_which_lock_servers_it_reaches(
    factory: Callable[..., WorkerFactory], dflock_server: ServerThread
) -> None:
    worker = factory().start(app="apps.plain", pool="solo", concurrency=1)
    expected = f"dflock: lock servers reached: {dflock_server.host}:{dflock_server.port} ("
    assert worker.wait_output(expected, timeout=30), worker.output()[-3000:]
    assert "cannot reach lock server" not in worker.output()


@pytest.mark.parametrize("app", ["apps.tasks", "apps.plain"])
def test_a_worker_with_a_bad_setting_stops_with_one_line_naming_it(
    tmp_path: Path, fs_settings: dict[str, Any], app: str
) -> None:
    """It died with Celery's 80-line traceback (a `LockedTask` reads the settings when the app
    finalizes, inside ``celery worker``): now click shows the error alone, as it does its own.
    An app that only calls ``install(app)`` met it in a signal handler, which Celery logged and
    then went on: the worker served every locked task with settings that cannot work."""
    settings = {**fs_settings, "dflock_renew_ratio": 2}
    env = {
        **os.environ,
        "DFLOCK_TEST_SETTINGS": json.dumps(settings),
        "PYTHONPATH": python_path(CELERY_APPS_DIR, REPO),
    }
    command = worker_command(
        app, pool="solo", concurrency=1, name="bad@dflock", queue=unique("bad")
    )
    done = subprocess.run(
        command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 1, done.stdout + done.stderr
    # as root, Celery warns of it before worker_init: the error is the last line, alone
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        "Error: dflock_renew_ratio must be a fraction of the lease strictly between 0 and 1 "
        "(e.g. 0.5), got 2"
    ), done.stderr


@pytest.mark.parametrize(
    "setting",
    [
        {"dflock_lock_from": "publish"},
        {"dflock_task_locks": {"apps.tasks.limited": {"lock_from": "publish"}}},
    ],
    ids=["app-wide", "task-locks"],
)
def test_options_that_cannot_work_together_stop_the_worker_at_start(
    tmp_path: Path, fs_settings: dict[str, Any], setting: dict[str, Any]
) -> None:
    """``lock_from="publish"`` app-wide (or in a ``dflock_task_locks`` entry) and a task's
    ``lock_limit`` are each valid, and refused together: the worker started, and every run
    and publish of the semaphore task failed with that ``DflockConfigError``."""
    env = {
        **os.environ,
        "DFLOCK_TEST_SETTINGS": json.dumps({**fs_settings, **setting}),
        "PYTHONPATH": python_path(CELERY_APPS_DIR, REPO),
    }
    command = worker_command(
        "apps.tasks", pool="solo", concurrency=1, name="bad@dflock", queue=unique("bad")
    )
    done = subprocess.run(
        command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("Error: lock options of task 'apps.tasks.limited': "), done.stderr
    assert "lock_from='publish' cannot be combined with lock_limit=2" in last, last


@pytest.mark.parametrize("command", ["status", "locks", "ping", "shards", "release k"])
def test_a_dflock_command_with_a_bad_setting_says_it_in_one_line_exit_1(
    tmp_path: Path, fs_settings: dict[str, Any], command: str
) -> None:
    """A bad ``dflock_*`` setting is the app's, not the command line's: the command says it as
    a worker does (``Error: ...``, exit status 1). It was a usage error (exit status 2, under
    the command's usage and ``Try '... --help' for help``), as if the command had been
    mistyped."""
    env = {
        **os.environ,
        "DFLOCK_TEST_SETTINGS": json.dumps({**fs_settings, "dflock_renew_ratio": 2}),
        "PYTHONPATH": python_path(CELERY_APPS_DIR, REPO),
    }
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "apps.tasks", "dflock", *command.split()],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        "Error: dflock_renew_ratio must be a fraction of the lease strictly between 0 and 1 "
        "(e.g. 0.5), got 2"
    ], done.stderr


def test_a_task_locks_template_naming_no_argument_stops_the_worker_at_start(
    tmp_path: Path, fs_settings: dict[str, Any]
) -> None:
    """A ``lock_key`` template on the task is checked against its signature when the task is
    bound; the same template in ``dflock_task_locks`` was not: the worker started, and every
    run of the task failed with ``KeyDerivationError``."""
    task = "apps.plain.third_party_report"
    settings = {**fs_settings, "dflock_task_locks": {task: {"lock_key": "report:{customer}"}}}
    env = {
        **os.environ,
        "DFLOCK_TEST_SETTINGS": json.dumps(settings),
        "PYTHONPATH": python_path(CELERY_APPS_DIR, REPO),
    }
    command = worker_command(
        "apps.plain", pool="solo", concurrency=1, name="bad@dflock", queue=unique("bad")
    )
    done = subprocess.run(
        command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=30, check=False
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"Error: dflock_task_locks[{task!r}]['lock_key']: "), done.stderr
    assert "refers to {customer}, which is not an argument of the task" in last, last


def test_a_worker_that_reaches_no_lock_server_warns_naming_dflock_servers(
    factory: Callable[..., WorkerFactory],
) -> None:
    """Before issue 29 a worker started without a word when its lock servers were down."""
    nowhere = f"127.0.0.1:{free_port()}"  # nothing listens there
    worker = factory(dflock_servers=nowhere).start(app="apps.plain", pool="solo", concurrency=1)
    expected = f"this worker reaches none of its lock servers (dflock_servers = {nowhere})"
    assert worker.wait_output(expected, timeout=30), worker.output()[-3000:]
    output = worker.output()
    assert f"cannot reach lock server {nowhere} (dflock_servers)" in output
    assert "WARNING" in output
    assert "lock servers reached" not in output


def test_a_worker_warns_at_start_about_a_lease_above_the_servers_limit(
    factory: Callable[..., WorkerFactory], dflock_server_factory: Any
) -> None:
    """The limit comes with the servers' hello at the worker's first contact: a task whose
    lock_ttl every run would have refused is named at start, not at its first run."""
    strict: ServerThread = dflock_server_factory(max_lease_ttl_s=30, default_lease_ttl_s=10)
    workers = factory(
        dflock_servers=f"{strict.host}:{strict.port}",
        dflock_task_locks={"apps.plain.third_party_report": {"lock_ttl": 60}},
    )
    worker = workers.start(app="apps.plain", pool="solo", concurrency=1)
    expected = (
        "task 'apps.plain.third_party_report' asks for lock_ttl=60, above the longest lease "
        "its lock servers grant (30 s, --max-lease-ttl)"
    )
    assert worker.wait_output(expected, timeout=30), worker.output()[-3000:]


def test_a_worker_warns_at_start_about_a_session_above_the_servers_limit(
    factory: Callable[..., WorkerFactory], dflock_server_factory: Any
) -> None:
    """``dflock_session_ttl`` is at most the servers' ``--max-lease-ttl``: the client cuts a
    longer one to it, so a worker set for long stalls lost its locks after a shorter one, with
    nothing said."""
    strict: ServerThread = dflock_server_factory(max_lease_ttl_s=30, default_lease_ttl_s=10)
    workers = factory(dflock_servers=f"{strict.host}:{strict.port}", dflock_session_ttl=120)
    worker = workers.start(app="apps.plain", pool="solo", concurrency=1)
    expected = (
        "dflock_session_ttl=120 is above the longest lease its lock servers grant (30 s, "
        "--max-lease-ttl): each session of this worker lasts 30 s"
    )
    assert worker.wait_output(expected, timeout=30), worker.output()[-3000:]


def test_a_worker_on_redis_warns_when_visibility_timeout_is_below_a_retry_countdown(
    tmp_path: Path, dflock_server: ServerThread
) -> None:
    """On Redis a worker holds a message sent again with a countdown unacknowledged until it is
    due, and the broker delivers it again after its visibility_timeout: a run would run twice.
    A worker whose visibility_timeout is not above the longest countdown its locked tasks may
    wait for (lock_retry_backoff_max, 60 s by default) says so at start, naming the setting;
    one whose timeout is above it says nothing."""
    require_redis()
    queue = unique("visibility")
    log = EventLog(tmp_path)
    settings = with_server(
        redis_settings(queue),
        dflock_server,
        dflock_task_locks={"apps.plain.third_party_report": {"lock_key": "r:{customer_id}"}},
    )
    workers = WorkerFactory(log=log, directory=tmp_path, settings=settings)
    try:
        short = {**settings["broker_transport_options"], "visibility_timeout": 45}
        worker = workers.start(
            app="apps.plain",
            pool="solo",
            concurrency=1,
            settings={"broker_transport_options": short},
        )
        expected = "the Redis broker's visibility_timeout (45 s, broker_transport_options) is not"
        assert worker.wait_output(expected, timeout=30), worker.output()[-3000:]
        assert "the busy-key retries of task 'apps.plain.third_party_report'" in worker.output()
        assert "(lock_retry_backoff_max=60 s)" in worker.output()
        assert "raise visibility_timeout above 60 s" in worker.output()
        long = {**settings["broker_transport_options"], "visibility_timeout": 120}
        quiet = workers.start(
            app="apps.plain",
            pool="solo",
            concurrency=1,
            settings={"broker_transport_options": long},
        )
        assert quiet.wait_output("dflock: lock servers reached", timeout=30), quiet.output()
        assert "visibility_timeout" not in quiet.output()
    finally:
        workers.close()
        log.close()
        redis_cleanup(queue)


@pytest.mark.parametrize(
    ("broker", "warned"),
    [
        ("redis+socket:///run/redis/redis.sock", "Redis"),  # Redis over a unix socket
        ("redis://h1:6379;redis://h2:6379", "Redis"),  # a fail-over list
        (["sentinel://h1:26379", "sentinel://h2:26379"], "Redis"),
        ("sqs://", "SQS"),  # SQS delivers again after its visibility_timeout too
        ("amqp://guest@localhost//", None),  # RabbitMQ acknowledges late, not by a timeout
    ],
)
def test_every_url_of_a_broker_with_a_visibility_timeout_is_checked(
    broker: str | list[str], warned: str | None
) -> None:
    """The check knows the broker by kombu's transport, not by the URL's scheme: Redis over a
    unix socket or behind a fail-over list was not checked, nor SQS (loading kombu's SQS
    transport needs boto3, not AWS: CI's venv at the lowest Celery has none)."""
    if warned == "SQS":
        pytest.importorskip("boto3")
    app = Celery("visibility", broker=broker, set_as_current=False)
    app.conf.broker_transport_options = {"visibility_timeout": 45}

    @app.task(base=LockedTask, shared=False)
    def report() -> None: ...

    said = countdowns_past_visibility(app, LockedTask)
    assert bool(said) == bool(warned), said
    if warned:
        expected = f"the {warned} broker's visibility_timeout (45 s, broker_transport_options)"
        assert expected in said[0]
    app.conf.broker_transport_options = {}  # the defaults (an hour, 30 minutes) are above 60 s
    assert countdowns_past_visibility(app, LockedTask) == []


@pytest.mark.parametrize(
    ("options", "warned"),
    [
        ({"on_locked": "retry"}, True),
        ({"on_locked": "skip"}, False),
        ({"on_locked": "raise"}, False),
        ({"on_locked": "retry", "lock_max_retries": 0}, False),
    ],
)
def test_only_tasks_that_retry_a_busy_key_count_their_backoff_against_visibility_timeout(
    options: dict[str, object], warned: bool
) -> None:
    """A task with on_locked 'skip' or 'raise', or no lock retries, never sends a busy-key
    retry: its lock_retry_backoff_max is no countdown its messages wait for (only an outage
    retry's 30 s is), so a visibility_timeout of 45 s is enough for it."""
    app = Celery("visibility", broker="redis://localhost:6379/0", set_as_current=False)
    app.conf.broker_transport_options = {"visibility_timeout": 45}

    class Counted(LockedTask):  # only this test's task: shared tasks of other modules join app
        pass

    @app.task(base=Counted, shared=False, **options)
    def report() -> None: ...

    said = countdowns_past_visibility(app, Counted)
    assert bool(said) == warned, said
    app.close()


def records_dirs(tmp: Path) -> list[Path]:
    return sorted(tmp.glob("celery-dflock-*"))


def test_records_left_by_a_killed_worker_are_cleaned_up_at_the_next_start(
    factory: Callable[..., WorkerFactory], tmp_path: Path
) -> None:
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    env = {"TMPDIR": str(private_tmp)}
    workers = factory()
    killed = workers.start(pool="prefork", concurrency=1, env=env)
    name = uuid.uuid4().hex[:8]
    Celery("sender", set_as_current=False, config_source=workers.settings).send_task(
        "apps.tasks.end_block", (name,)
    )
    workers.log.wait_event("body", 30, name=name)
    (left,) = records_dirs(private_tmp)
    assert list(left.glob("*.held")), "the pool child recorded the lock it holds"
    killed.kill()
    time.sleep(0.5)
    assert records_dirs(private_tmp) == [left], "kill -9 leaves the records behind"

    workers.start(pool="prefork", concurrency=1, env=env)
    deadline = time.monotonic() + 15
    while left.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left.exists(), [p.name for p in records_dirs(private_tmp)]
    assert len(records_dirs(private_tmp)) == 1  # the new worker's own


def test_a_worker_frees_only_what_workers_of_its_own_lock_servers_left(
    factory: Callable[..., WorkerFactory],
    tmp_path: Path,
    dflock_server_factory: Callable[..., ServerThread],
) -> None:
    """Two apps on one host, each on its own lock server: a worker of the one took the records
    a killed worker of the other left, sent their release to its own server (which never
    granted them) and deleted them, so the key stayed held until its session ended."""
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    env = {"TMPDIR": str(private_tmp)}
    other = dflock_server_factory()
    on_other = {"dflock_servers": f"{other.host}:{other.port}"}
    workers = factory()
    killed = workers.start(pool="prefork", concurrency=1, settings=on_other, env=env)
    name = uuid.uuid4().hex[:8]
    Celery("sender", set_as_current=False, config_source=workers.settings).send_task(
        "apps.tasks.end_block", (name,)
    )
    workers.log.wait_event("body", 30, name=name)
    killed.kill()
    workers.start(pool="solo", concurrency=1, env=env)  # the app on dflock_server
    again = workers.start(pool="solo", concurrency=1, settings=on_other, env=env)
    said = f"end:{name}' left by dead pool child"
    assert again.wait_output(said, timeout=15), again.output()[-3000:]


def test_records_of_an_earlier_version_are_removed_once_all_their_writers_are_gone(
    factory: Callable[..., WorkerFactory], tmp_path: Path, dflock_server: ServerThread
) -> None:
    """A records directory named as before it named its servers (``celery-dflock-<uid>-<pid>``)
    was never removed after an upgrade: its servers cannot be known, so what it records is not
    released (a hold recorded in it stays held), but once its worker and the pool children
    that wrote its files are gone, nothing reads it; one a live process writes stays."""
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()

    def gone_pid() -> int:
        gone = subprocess.Popen(["true"])
        gone.wait()
        return gone.pid

    def old_dir(owner: int, child: int, *entries: object) -> Path:
        made = private_tmp / f"celery-dflock-{os.getuid()}-{owner}"
        made.mkdir(mode=0o700)
        (made / f"{child}.held").write_text(json.dumps(list(entries)))
        return made

    alive = subprocess.Popen(["sleep", "60"])
    try:
        with Client([dflock_server.address]) as client:
            hold = client.hold("earlier-version", note="old", lease_ttl=60)
            child = gone_pid()
            record = {"task_id": "t", "key": hold.key, "token": hold.token, "pid": child}
            dead = old_dir(gone_pid(), child, record)
            child_alive = old_dir(gone_pid(), alive.pid)
            worker_alive = old_dir(alive.pid, gone_pid())
            worker = factory().start(pool="solo", concurrency=1, env={"TMPDIR": str(private_tmp)})
            said = f"dflock: removed {dead}: held-lock records left by gone workers of an earlier"
            assert worker.wait_output(said, timeout=15), worker.output()[-3000:]
            assert not dead.exists() and child_alive.exists() and worker_alive.exists()
            assert "earlier-version" not in worker.output().replace(said, "")
            assert client.renew(hold.key, hold.token, lease_ttl=60), "not released"
            assert client.release(hold.key, hold.token)
    finally:
        alive.kill()
        alive.wait()


def left_by_a_dead_worker(
    monkeypatch: pytest.MonkeyPatch, tmp: Path, workers: WorkerFactory, *entries: object
) -> Path:
    """The records directory in ``tmp`` of a gone worker main process of ``workers``' lock
    servers, holding ``entries``."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp))
    app = Celery("records", set_as_current=False, config_source=workers.settings)
    servers = get_config(app).client.servers
    app.close()
    left = _runtime.HeldRecords.for_main_process(gone.pid, servers)
    assert left is not None
    (left.directory / "4242.held").write_text(json.dumps(list(entries)))
    return left.directory


def test_a_damaged_record_left_by_a_dead_worker_is_logged_when_dropped(
    factory: Callable[..., WorkerFactory], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A record whose key or token is not text was dropped without a word (it was logged); one
    whose pid is no number ended the clean-up with a ValueError, leaving the rest."""
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    workers = factory()
    no_pid = {"task_id": "t", "key": "k", "token": "0" * 32, "pid": "x"}
    damaged = {"task_id": "t", "key": 7, "token": None, "pid": 0}
    left = left_by_a_dead_worker(monkeypatch, private_tmp, workers, no_pid, damaged)
    worker = workers.start(pool="solo", concurrency=1, env={"TMPDIR": str(private_tmp)})
    said = f"dflock: dropped a damaged held-lock record in {left / '4242.held'}"
    assert worker.wait_output(f"{said}: {damaged!r}", timeout=15), worker.output()[-3000:]
    assert f"{said}: {no_pid!r}" in worker.output()


def test_upper_case_beat_settings_are_read() -> None:
    from celery_dflock.beat import BeatSettings

    app = mistaken_app(DFLOCK_BEAT_LOCK_KEY="beat-upper", DFLOCK_BEAT_LEASE_TTL=7)
    settings = BeatSettings.from_app(app, get_config(app))
    assert settings.lock_key == "beat-upper"
    assert settings.lease_ttl_s == 7
    app.close()


@pytest.mark.parametrize(
    ("misspelt", "meant"),
    [("lock_tll", "lock_ttl"), ("lock_timout", "lock_timeout"), ("on_lockd", "on_locked")],
)
def test_a_misspelt_task_option_fails_when_the_task_is_bound_naming_the_option(
    misspelt: str, meant: str
) -> None:
    """Celery keeps an unknown ``@app.task`` keyword as a class attribute without a word, so
    ``lock_tll=60`` used to run on the default lease (issue 29)."""
    app = mistaken_app()

    @app.task(shared=False, base=LockedTask, lock_key="k", **{misspelt: 60})
    def job() -> None: ...

    task: Any = job
    with pytest.raises(DflockConfigError, match=f"'{misspelt}' is not a lock option") as failure:
        app.finalize()
        _ = app.tasks[task.name]
    assert f"did you mean '{meant}'" in str(failure.value)
    app.close()


def test_a_misspelt_class_attribute_fails_when_the_task_is_bound() -> None:
    app = mistaken_app()

    class Report(LockedTask):
        name = "proj.report"
        lock_tll = 60

        def run(self) -> None: ...

    with pytest.raises(DflockConfigError, match="did you mean 'lock_ttl'"):
        app.register_task(Report())
    app.close()


def test_a_misspelt_call_option_is_refused_at_the_call_naming_the_option() -> None:
    app = mistaken_app()
    app.conf.task_always_eager = False

    @app.task(shared=False, base=LockedTask, lock_key="k")
    def job() -> str:
        return "ran"

    task: Any = job
    with pytest.raises(DflockConfigError, match="did you mean 'lock_ttl'") as failure:
        task.apply_async(lock_tll=60)
    assert "apply_async options of" in str(failure.value)
    with pytest.raises(DflockConfigError, match="did you mean 'lock_timeout'"):
        task.s().set(lock_timout=5).apply_async()
    app.close()


def test_a_call_s_template_naming_no_argument_is_refused_at_the_call_nothing_sent(
    dflock_server: ServerThread,
) -> None:
    """A per-call ``lock_key`` template is checked against the task's signature at the call,
    as the task's own is at the bind: it was sent, and its run failed in the worker with
    ``KeyDerivationError`` (an ``apply()`` ran and failed the same way)."""
    from celery_dflock.keys import KeyDerivationError

    app = mistaken_app(dflock_servers=[dflock_server.address])
    app.conf.task_always_eager = False
    sent: list[object] = []

    def publishing(**kwargs: object) -> None:
        sent.append(kwargs)

    @app.task(shared=False, base=LockedTask, lock_key="report:{customer_id}")
    def report(customer_id: int, kind: str = "daily") -> str:
        return f"{customer_id}:{kind}"

    task: Any = report
    app.finalize()
    before_task_publish.connect(publishing)
    calls = {
        "apply_async": lambda key: task.apply_async((7,), lock_key=key),
        "a signature": lambda key: task.s(7).set(lock_key=key).apply_async(),
        "apply": lambda key: task.apply((7,), lock_key=key),
    }
    for how, call in calls.items():
        for key, says in (
            ("report:{customer}", "its signature is report(customer_id, kind='daily')"),
            ("report:{", "is not a valid format string"),
        ):
            with pytest.raises(KeyDerivationError, match=re.escape(key)) as failure:
                call(key)
            assert says in str(failure.value), how
    before_task_publish.disconnect(publishing)
    assert sent == []
    assert task.apply((7,), lock_key="report:{customer_id}:{kind}").get() == "7:daily"
    app.close()


def test_a_misspelt_option_in_task_locks_is_refused_with_the_close_match() -> None:
    app = mistaken_app(dflock_task_locks={"proj.report": {"lock_tll": 60}})
    with pytest.raises(DflockConfigError, match="did you mean 'lock_ttl'"):
        get_config(app)
    app.close()


def test_a_template_field_missing_from_the_signature_names_field_and_signature() -> None:
    app = mistaken_app()
    from celery_dflock.keys import KeyDerivationError

    with pytest.raises(KeyDerivationError) as failure:

        @app.task(shared=False, base=LockedTask, lock_key="report:{customer}")
        def report(customer_id: int, kind: str = "daily") -> None: ...

        app.finalize()
        _ = app.tasks[cast("Any", report).name]
    message = str(failure.value)
    assert "{customer}" in message
    assert "its signature is report(customer_id, kind='daily')" in message
    app.close()


def test_each_lock_option_setting_is_the_option_name_with_the_prefix() -> None:
    from celery_dflock.config import SETTINGS

    assert SETTINGS, "no lock option has an app-wide setting"
    for option, setting in SETTINGS.items():
        assert setting == f"dflock_{option}"


@pytest.mark.parametrize(
    ("old", "new", "value", "field"),
    [
        ("dflock_default_ttl", "dflock_lock_ttl", 45, "lock_ttl"),
        ("dflock_default_timeout", "dflock_lock_timeout", 3, "lock_timeout"),
        ("dflock_max_retries", "dflock_lock_max_retries", 4, "lock_max_retries"),
        ("DFLOCK_RETRY_JITTER", "dflock_lock_retry_jitter", False, "lock_retry_jitter"),
    ],
)
def test_an_old_setting_name_is_still_read_with_a_deprecation_warning(
    old: str, new: str, value: object, field: str
) -> None:
    app = mistaken_app(**{old: value})
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated: rename it to {new}"):
        config = get_config(app)
    assert config.defaults.by_name()[field] == value
    app.close()


@pytest.mark.parametrize(
    ("first", "second"),
    [("dflock_default_ttl", "dflock_lock_ttl"), ("dflock_lock_ttl", "DFLOCK_LOCK_TTL")],
)
def test_one_setting_under_two_names_with_two_values_is_refused_naming_both(
    first: str, second: str
) -> None:
    """Which one counted was a guess made without a word (the new name's, the old one
    ignored)."""
    app = mistaken_app(**{first: 45, second: 60})
    with pytest.raises(DflockConfigError, match="given twice") as refused:
        get_config(app)
    assert f"app.conf.{first}=45" in str(refused.value) or f"app.conf.{second}=60" in str(
        refused.value
    )
    assert first in str(refused.value) and second in str(refused.value)
    app.close()
    same = mistaken_app(**{first: 45, second: 45})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert get_config(same).defaults.by_name()["lock_ttl"] == 45
    same.close()


def test_a_bad_value_under_an_old_setting_name_is_refused_naming_that_name() -> None:
    app = mistaken_app(DFLOCK_DEFAULT_TTL=0)
    with (
        pytest.warns(DeprecationWarning),
        pytest.raises(DflockConfigError, match=r"^app\.conf\.DFLOCK_DEFAULT_TTL must be between 1"),
    ):
        get_config(app)
    app.close()


def test_a_session_time_no_keep_alive_can_keep_is_refused_naming_the_setting() -> None:
    """1 s: every lock held on the session was reported lost within a second of its acquire
    (tests/client/test_client_session.py says why)."""
    app = mistaken_app(dflock_session_ttl=1)
    with pytest.raises(DflockConfigError, match=r"dflock_session_ttl must be between 2 and"):
        get_config(app)
    app.close()


@pytest.mark.parametrize("where", ["attribute", "setting"])
def test_a_lock_ttl_above_the_servers_max_lease_is_refused_naming_what_to_change(
    dflock_server_factory: Any, where: str
) -> None:
    """The server's --max-lease-ttl comes with its hello; a run asking for a longer lease is
    refused before the request, naming where the lease was set and --max-lease-ttl (before
    issue 29 the request was sent, and the server's bare 'error' became a ProtocolError that
    could only guess at the cause)."""
    from celery_dflock import InvalidValueError

    server: ServerThread = dflock_server_factory(max_lease_ttl_s=30, default_lease_ttl_s=10)
    conf: dict[str, Any] = {"dflock_servers": f"{server.host}:{server.port}"}
    options: dict[str, Any] = {}
    if where == "setting":
        conf["dflock_lock_ttl"] = 60
    else:
        options["lock_ttl"] = 60
    app = mistaken_app(**conf)

    @app.task(shared=False, base=LockedTask, lock_key="long-lease", **options)
    def job() -> str:
        return "ran"

    task: Any = job
    with pytest.raises(InvalidValueError) as refused:
        task()
    message = str(refused.value)
    assert "the lease asked for (60 s) is above the longest lease server" in message
    assert "(30 s, its --max-lease-ttl" in message
    # The lease names where it was set: the setting, or the task's attribute.
    named = "app.conf.dflock_lock_ttl" if where == "setting" else "attribute lock_ttl of task"
    assert f"Ask for a shorter lease ({named}" in message
    app.close()


@pytest.mark.parametrize(
    ("pending_ttl", "asked", "named"),
    [
        # "Ask for a shorter lease (lease_ttl)", the client's internal argument, was named
        # instead of what the user set (or left to its default).
        (None, 300, "lock_pending_ttl (dflock_lock_pending_ttl), by default"),
        (40, 40, "app.conf.dflock_lock_pending_ttl"),
        (20, 40, "the message's countdown/eta"),
    ],
    ids=["default", "setting", "countdown"],
)
def test_a_publish_hold_above_the_servers_max_lease_is_refused_before_sending(
    dflock_server_factory: Any, pending_ttl: int | None, asked: int, named: str
) -> None:
    from celery_dflock import InvalidValueError

    server: ServerThread = dflock_server_factory(max_lease_ttl_s=30, default_lease_ttl_s=10)
    pending = {} if pending_ttl is None else {"dflock_lock_pending_ttl": pending_ttl}
    app = mistaken_app(dflock_servers=f"{server.host}:{server.port}", **pending)
    app.conf.task_always_eager = False

    @app.task(shared=False, base=LockedTask, lock_key="long-hold", lock_from="publish")
    def job() -> str:
        return "ran"

    task: Any = job
    with pytest.raises(InvalidValueError) as refused:
        task.apply_async(countdown=None if pending_ttl == asked else 40)
    message = str(refused.value)
    assert "was not sent: its hold of 'long-hold' would last" in message
    assert "lock_pending_ttl" in message and "(30 s, its --max-lease-ttl" in message
    assert f"the lease asked for ({asked} s) is above" in message
    assert f"Ask for a shorter lease ({named})" in message, message
    app.close()


@pytest.mark.parametrize("sent", [["lock_ttl", 60], "lock_ttl=60", 60])
def test_a_lock_options_header_that_is_no_mapping_is_refused_naming_the_header(
    sent: object,
) -> None:
    """``headers={"dflock_options": <not a mapping>}`` with lock keyword options was merged
    as it was (a raw TypeError from the merge)."""
    app = mistaken_app()
    app.conf.task_always_eager = False

    @app.task(shared=False, base=LockedTask, lock_key="k")
    def job() -> str:
        return "ran"

    task: Any = job
    for call in (task.apply_async, task.apply):
        with pytest.raises(DflockConfigError, match="'dflock_options' header") as failure:
            call(headers={"dflock_options": sent}, lock_timeout=5)
        assert "must be a mapping of lock options" in str(failure.value)
    app.close()


def test_task_attributes_are_checked_once_where_they_enter_with_one_text(
    monkeypatch: pytest.MonkeyPatch, dflock_server: ServerThread
) -> None:
    """The attributes a task is bound with are checked at the bind, and a run takes them as
    checked; attributes changed on the task later are checked at the next run, in the same
    words as at the bind."""
    app = mistaken_app()
    conflicting = {"lock_from": "publish", "lock_limit": 2}

    @app.task(shared=False, base=LockedTask, lock_key="k", name="proj.conflict", **conflicting)
    def conflict() -> None: ...

    with pytest.raises(DflockConfigError, match="cannot be combined") as at_bind:
        app.finalize()
        _ = app.tasks["proj.conflict"]
    app.close()

    app = mistaken_app(dflock_servers=[dflock_server.address])

    @app.task(shared=False, base=LockedTask, lock_key="k", name="proj.conflict", lock_ttl=20)
    def changed() -> str:
        return "ran"

    task: Any = changed
    app.finalize()
    checks: list[object] = []
    real = _runtime.read_attributes
    monkeypatch.setattr(_runtime, "read_attributes", lambda *a: checks.append(a) or real(*a))
    assert task.apply(throw=True).get() == "ran"
    assert checks == []  # taken as checked at the bind
    for option, value in conflicting.items():
        setattr(task, option, value)
    with pytest.raises(DflockConfigError, match="cannot be combined") as at_run:
        task.apply(throw=True)
    assert str(at_run.value) == str(at_bind.value)
    assert len(checks) == 1
    app.close()
