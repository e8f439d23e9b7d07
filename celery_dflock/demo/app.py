# pyright: reportMissingTypeStubs=false
"""The Celery app the demo's workers and beats load (``-A celery_dflock.demo.app``).

Everything comes from the environment the demo sets: the broker (``DFLOCK_DEMO_BROKER``,
``filesystem://`` in a scratch folder unless ``--broker`` is given), the lock server
(``DFLOCK_SERVERS``), the event file (``DFLOCK_DEMO_EVENTS``) and this process's name
(``DFLOCK_DEMO_NAME``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

from celery import Celery
from celery.beat import PersistentScheduler

from celery_dflock._celery import signals as celery_signals
from celery_dflock.beat import SingletonScheduler
from celery_dflock.demo.fsbroker import TRANSPORT as FILESYSTEM_TRANSPORT
from celery_dflock.demo.timeline import Event, record
from celery_dflock.signals import lock_skipped
from celery_dflock.task import LockedTask

BEAT_PERIOD_S = 1.0
"""How often the demo's periodic task is due."""


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise RuntimeError(f"{name} is not set: run the demo with `celery-dflock demo`")
    return value


def _events() -> Path:
    return Path(_env("DFLOCK_DEMO_EVENTS"))


def _name() -> str:
    return os.environ.get("DFLOCK_DEMO_NAME", f"pid{os.getpid()}")


def _broker_options(broker: str) -> dict[str, Any]:
    if not broker.startswith("filesystem://"):
        return {}
    folders = ("data_folder_in", "data_folder_out", "processed_folder", "control_folder")
    options = dict.fromkeys(folders, _env("DFLOCK_DEMO_BROKER_DIR"))  # one scratch folder
    return {**options, "store_processed": False, "polling_interval": 0.05}


_BROKER = os.environ.get("DFLOCK_DEMO_BROKER", "filesystem://")

app: Any = Celery("dflock-demo")
app.conf.update(
    broker_url=_BROKER,
    # kombu's filesystem transport with atomic puts (see fsbroker); None: the URL's own.
    broker_transport=FILESYSTEM_TRANSPORT if _BROKER.startswith("filesystem://") else None,
    broker_transport_options=_broker_options(_BROKER),
    broker_connection_retry_on_startup=True,
    task_default_queue=os.environ.get("DFLOCK_DEMO_QUEUE", "dflock-demo"),
    worker_prefetch_multiplier=1,
    task_acks_late=True,
    worker_hijack_root_logger=False,
    dflock_servers=os.environ.get("DFLOCK_SERVERS", "127.0.0.1:6388"),
    dflock_lock_ttl=10,
    beat_max_loop_interval=0.2,
    dflock_beat_lease_ttl=3,
    beat_schedule={
        "heartbeat": {"task": "celery_dflock.demo.app.heartbeat", "schedule": BEAT_PERIOD_S}
    },
)


def _hold(task: LockedTask, key: str, seconds: float) -> None:
    lock = task.lock
    fence = lock.fence if lock is not None and lock.fence is not None else 0
    task_id = str(task.request.id)
    record(_events(), Event("start", key, time.time(), task_id, fence, _name()))
    time.sleep(seconds)
    record(_events(), Event("end", key, time.time(), task_id, fence, _name()))


@app.task(
    base=LockedTask, bind=True, lock_key="account:{account}", on_locked="retry", max_retries=200
)
def sync_account(self: LockedTask, account: str, seconds: float) -> None:
    """Sync one account: never two at once per account; a busy account is waited for in its
    queue (up to ``lock_timeout``, 30 s), then retried."""
    _hold(self, f"account:{account}", seconds)


@app.task(base=LockedTask, bind=True, lock_key="report:{name}", on_locked="skip")
def build_report(self: LockedTask, name: str, seconds: float) -> None:
    """Build a report: a run that finds the previous one still going is skipped."""
    _hold(self, f"report:{name}", seconds)


@app.task
def heartbeat() -> None:
    """The periodic task the singleton beat sends."""


@celery_signals.task_retry.connect
def _on_retry(sender: Any = None, request: Any = None, **_: Any) -> None:
    if getattr(sender, "name", None) == sync_account.name and request is not None:
        account = str(request.kwargs.get("account", "?"))
        record(_events(), Event("retry", f"account:{account}", time.time(), str(request.id)))


@celery_signals.worker_ready.connect
def _on_ready(**_: Any) -> None:
    (Path(_env("DFLOCK_DEMO_DIR")) / f"ready-{_name()}").touch()


@lock_skipped.connect
def _on_skipped(sender: Any = None, task_id: Any = None, key: Any = None, **_: Any) -> None:
    record(_events(), Event("skip", str(key), time.time(), str(task_id)))


class DemoScheduler(SingletonScheduler, PersistentScheduler):
    """The singleton beat, recording which beat process sent each periodic task."""

    def apply_async(
        self, entry: Any, producer: Any = None, advance: bool = True, **kwargs: Any
    ) -> Any:
        result = super().apply_async(entry, producer, advance, **kwargs)
        if result is not None:  # None: this beat is not the active one and sent nothing
            record(_events(), Event("beat", str(entry.name), time.time(), "", 0, _name()))
        return result
