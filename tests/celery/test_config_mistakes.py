"""Config mistakes are caught early and named in the user's terms (issue 13, points 8 and 10):
bad task attributes at bind, misspelt and upper-case settings, a ``dflock_task_locks`` entry
that names no task (warned at worker start, with the close matches), and the held-lock records
that a worker killed with -9 leaves behind (cleaned up at the next worker's start)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from celery_dflock import LockedTask
from celery_dflock.config import DflockConfigError, get_config
from dflockd_server.testing import ServerThread
from tests.support.workers import EventLog, WorkerFactory, with_server


def make_app(**conf: Any) -> Celery:
    app = Celery("config-mistakes", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        result_backend="cache+memory://",
        task_always_eager=True,
        **conf,
    )
    return app


@pytest.mark.parametrize(
    ("attribute", "value", "says"),
    [
        ("on_locked", "nope", "'retry', 'skip', 'raise'"),
        ("lock_ttl", -1, "must be > 0"),
        ("on_lock_lost", "explode", "'interrupt', 'flag', 'terminate'"),
        ("lock_limit", 0, "from 1 to"),
        ("lock_max_retries", -2, "whole number of retries"),
        ("lock_from", "queue", "must be 'run'"),
        ("on_duplicate", "skip", "must be 'return'"),
        ("lock_pending_ttl", 0, "must be > 0"),
    ],
)
def test_a_bad_task_attribute_fails_when_the_task_is_bound(
    attribute: str, value: object, says: str
) -> None:
    app = make_app()

    @app.task(shared=False, base=LockedTask, lock_key="k", **{attribute: value})
    def job() -> None: ...

    task: Any = job
    with pytest.raises(DflockConfigError, match=f"attribute {attribute} of task") as failure:
        app.finalize()
        _ = app.tasks[task.name]
    assert says in str(failure.value)
    app.close()


def test_a_misspelt_setting_is_refused_with_the_close_match() -> None:
    app = make_app(dflock_server="127.0.0.1:6388")
    with pytest.raises(DflockConfigError, match=r"app\.conf\.dflock_server is not") as failure:
        get_config(app)
    assert "did you mean dflock_servers" in str(failure.value)
    app.close()


def test_upper_case_settings_are_read(dflock_server: ServerThread) -> None:
    """Celery's old setting style (DFLOCK_SERVERS) is honoured, not silently ignored."""
    app = make_app(
        DFLOCK_SERVERS=f"{dflock_server.host}:{dflock_server.port}",
        DFLOCK_KEY_PREFIX="upper:",
        DFLOCK_ON_LOCKED="raise",
    )
    config = get_config(app)
    assert config.servers == ((dflock_server.host, dflock_server.port),)
    assert config.key_prefix == "upper:"
    assert config.defaults["on_locked"] == "raise"

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


def test_upper_case_beat_settings_are_read() -> None:
    from celery_dflock.beat import BeatSettings

    app = make_app(DFLOCK_BEAT_LOCK_KEY="beat-upper", DFLOCK_BEAT_LEASE_TTL=7)
    settings = BeatSettings.from_app(app, get_config(app))
    assert settings.lock_key == "beat-upper"
    assert settings.lease_ttl_s == 7
    app.close()
