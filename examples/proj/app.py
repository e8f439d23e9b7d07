# pyright: reportMissingTypeStubs=false
"""A small Celery project using celery-dflock, configured from the environment.

``CELERY_BROKER_URL`` (default ``redis://127.0.0.1:6379/0``), ``DFLOCK_SERVERS``
(default ``127.0.0.1:6388``), ``DFLOCK_SHARDING_STRATEGY`` (default ``stable_hash``;
``cluster`` when ``DFLOCK_SERVERS`` are members of a lock cluster), ``DFLOCK_AUTH_TOKEN``
(optional), ``EXAMPLE_LEDGER`` (the SQLite file of the fenced ledger, default
``./example-ledger.sqlite3``).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from celery import Celery

from celery_dflock import LockedTask
from examples.proj.ledger import FencedLedger

app = Celery("proj")
app.conf.update(
    broker_url=os.environ.get("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0"),
    broker_connection_retry_on_startup=True,
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    dflock_servers=os.environ.get("DFLOCK_SERVERS", "127.0.0.1:6388"),
    dflock_sharding_strategy=os.environ.get("DFLOCK_SHARDING_STRATEGY", "stable_hash"),
    dflock_auth_token=os.environ.get("DFLOCK_AUTH_TOKEN") or None,
    dflock_lock_ttl=30,
    # Every beat-sent run is skipped while the previous run of the same entry is going.
    dflock_beat_nonoverlap=True,
    beat_schedule={
        "nightly-report": {
            "task": "examples.proj.app.nightly_report",
            "schedule": float(os.environ.get("EXAMPLE_REPORT_EVERY_S", "60")),
        },
    },
)


def _ledger() -> FencedLedger:
    return FencedLedger(Path(os.environ.get("EXAMPLE_LEDGER", "example-ledger.sqlite3")))


@app.task(base=LockedTask, bind=True, lock_key="account:{account_id}", on_locked="retry")
def sync_account(self: LockedTask, account_id: int) -> str:
    """Never two syncs of one account at once; a busy account is retried with backoff."""
    time.sleep(0.2)
    return f"account {account_id} synced"


@app.task(base=LockedTask, lock_key="charge:{invoice_id}", on_locked="raise")
def charge_invoice(invoice_id: str) -> str:
    """A second charge of the same invoice while one runs fails with LockNotAcquired."""
    time.sleep(0.2)
    return f"invoice {invoice_id} charged"


@app.task(base=LockedTask, lock_key="report", on_locked="skip", lock_ttl=60)
def nightly_report() -> str:
    """The periodic report: a run that finds the previous one still going is skipped."""
    time.sleep(0.5)
    return "report built"


@app.task(base=LockedTask, lock_key="export:{tenant}", lock_limit=2, lock_timeout=30)
def export_tenant(tenant: str, seconds: float = 0.5) -> str:
    """At most two exports per tenant at once; a third waits its turn (FIFO, up to 30 s)."""
    time.sleep(seconds)
    return f"{tenant} exported"


@app.task(base=LockedTask, bind=True, lock_key="balance:{account}")
def add_to_balance(self: LockedTask, account: str, amount: int) -> int:
    """A write guarded by the lock's fencing token: a stale holder's write is refused."""
    lock = self.lock
    if lock is None:
        raise RuntimeError("add_to_balance runs only under its lock")
    return _ledger().add(account, amount, fence=lock.fence)  # refused when the fence is None
