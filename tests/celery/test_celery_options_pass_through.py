"""Celery's own task options pass through a LockedTask untouched (issue 50): only ``lock_*``
options are checked. ``retry_backoff_max`` and ``retry_jitter`` used to be refused as misspelt
``lock_retry_backoff_max`` / ``lock_retry_jitter``, so under ``task_cls="celery_dflock:LockedTask"``
no task that used them could bind and the app could not load.

The list of Celery's options is read from the installed Celery (its ``Task`` class, ``app.task``'s
keywords, what ``autoretry_for`` reads from a task, ``apply_async``'s documented options), so an
option a new Celery adds is walked too."""

from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Callable
from typing import Any

import celery.app.autoretry
import celery.app.base
import celery.app.task
import pytest
from celery.exceptions import CDeprecationWarning

from celery_dflock import LockedTask
from celery_dflock._settings import LOCK_OPTIONS, check_option_names
from celery_dflock.config import DflockConfigError
from dflockd_server.testing import ServerThread
from tests.support.apps import make_app
from tests.support.workers import EventLog, WorkerFactory, with_server


def celery_task_options() -> list[str]:
    """Every option name the installed Celery knows of a task or a call."""
    names = {name for name in dir(celery.app.task.Task) if not name.startswith("_")}
    names |= set(inspect.signature(celery.app.base.Celery._task_from_fun).parameters)  # pyright: ignore[reportPrivateUsage]
    source = inspect.getsource(celery.app.autoretry)
    names |= set(re.findall(r"getattr\(task, '(\w+)'", source))
    names |= set(re.findall(r"options\.get\('(\w+)'", source))
    names |= set(inspect.signature(celery.app.task.Task.apply_async).parameters)
    names |= set(re.findall(r"^\s+(\w+) \(", celery.app.task.Task.apply_async.__doc__ or "", re.M))
    names |= set(inspect.signature(celery.app.base.Celery.send_task).parameters)
    return sorted(names - {"self", "options", "kwargs", "args", "fun"})


CELERY_OPTIONS = celery_task_options()


def test_the_walk_finds_celerys_options() -> None:
    """Guards the introspection: the options of the issue are among what it finds."""
    assert {"retry_backoff_max", "retry_jitter", "max_retries", "autoretry_for"} <= set(
        CELERY_OPTIONS
    )
    assert {"countdown", "queue", "expires", "priority"} <= set(CELERY_OPTIONS)
    assert not set(CELERY_OPTIONS) & set(LOCK_OPTIONS)


@pytest.mark.parametrize("option", CELERY_OPTIONS)
def test_no_option_of_celery_is_taken_for_a_misspelt_lock_option(option: str) -> None:
    check_option_names([option], "task 'proj.job'")


def test_every_option_of_celery_given_to_app_task_binds_a_locked_task(
    dflock_server: ServerThread,
) -> None:
    """``app.task`` keeps each keyword that is not its own argument as a class attribute of the
    task, where the bind-time check reads it; Celery's ``Task`` attributes are inherited and
    never read as a misspelling. Every other option of Celery, given at once to one task."""
    app = make_app("pass-through", eager=True, servers=dflock_server)
    own = set(inspect.signature(celery.app.base.Celery._task_from_fun).parameters)  # pyright: ignore[reportPrivateUsage]
    given: dict[str, object] = {
        name: None
        for name in CELERY_OPTIONS
        if name not in own and name not in vars(celery.app.task.Task)
    }
    assert {"retry_backoff_max", "retry_jitter"} <= given.keys()
    given |= {
        "autoretry_for": (ValueError,),
        "dont_autoretry_for": (),
        "retry_kwargs": {},
        "retry_backoff": True,
        "retry_backoff_max": 600,
        "retry_jitter": False,
        "max_retries": 3,
    }

    @app.task(shared=False, base=LockedTask, lock_key="k", name="pass.through", **given)
    def job() -> str:
        return "ran"

    with warnings.catch_warnings():  # Celery's own: queue, priority... as task attributes
        warnings.simplefilter("ignore", CDeprecationWarning)
        app.finalize()
        task: Any = app.tasks["pass.through"]
    assert (task.retry_backoff_max, task.retry_jitter, task.max_retries) == (600, False, 3)
    assert task.apply().get() == "ran"
    app.close()


def test_celerys_call_options_pass_through_apply_async(dflock_server: ServerThread) -> None:
    """Celery's call options next to lock options: none refused, the lock options applied."""
    app = make_app("pass-through-calls", eager=True, servers=dflock_server)

    @app.task(shared=False, base=LockedTask, lock_key="k", name="pass.calls")
    def job() -> str:
        return "ran"

    options: dict[str, Any] = {"retry_backoff_max": 600, "retry_jitter": False, "max_retries": 2}
    task: Any = job
    assert task.apply_async((), lock_ttl=30, **options).get() == "ran"
    app.close()


def test_a_misspelt_lock_option_of_a_run_here_is_refused(dflock_server: ServerThread) -> None:
    """``apply`` (a run in the caller's process) refuses a misspelt lock option as
    ``apply_async`` does; it ran on the default lease without a word."""
    app = make_app("misspelt-apply", eager=True, servers=dflock_server)

    @app.task(shared=False, base=LockedTask, lock_key="k", name="misspelt.apply")
    def job() -> str:
        return "ran"

    task: Any = job
    with pytest.raises(
        DflockConfigError, match=re.escape("apply options of 'misspelt.apply': 'lock_tll'")
    ):
        task.apply((), lock_tll=60)
    assert task.apply((), lock_ttl=60).get() == "ran"
    app.close()


@pytest.mark.parametrize(
    "misspelt", ["lock_tll", "lockttl", "on_lockd", "lock_retry_jiter", "lock_retry_backof_max"]
)
def test_a_misspelt_lock_option_is_still_refused(misspelt: str) -> None:
    with pytest.raises(Exception, match=f"'{misspelt}' is not a lock option"):
        check_option_names([misspelt], "task 'proj.job'")


def test_a_whole_project_under_task_cls_loads_and_runs_in_a_worker(
    tmp_path: Any, dflock_server: ServerThread, fs_settings: dict[str, Any]
) -> None:
    """The docs' "a whole project": every task a LockedTask, two of them with Celery's retry
    options; the worker loads the app, both tasks fail once and succeed on Celery's retry."""
    settings = with_server(fs_settings, dflock_server)
    log = EventLog(tmp_path)
    factory = WorkerFactory(log=log, directory=tmp_path, settings=settings)
    client = make_app("whole-project-client", settings)
    try:
        factory.start(app="apps.whole_project", pool="prefork", concurrency=2)
        sent: Callable[..., Any] = client.send_task
        export = sent("apps.whole_project.export", (7,))
        ping = sent("apps.whole_project.ping")
        assert export.get(timeout=60) == "exported 7"
        assert ping.get(timeout=60) == "pong"
        runs = [e for e in log.entries() if e["event"] in {"export_run", "ping_run"}]
        exports = [e for e in runs if e["event"] == "export_run"]
        assert [e["retries"] for e in exports] == [0, 1]
        assert {e["key"] for e in exports} == {"export:7"}
        assert [e["retries"] for e in runs if e["event"] == "ping_run"] == [0, 1]
    finally:
        factory.close()
        client.close()
        log.close()
