# pyright: reportAttributeAccessIssue=false, reportCallIssue=false, reportFunctionMemberAccess=false
# (Celery's @app.task is untyped: pyright takes a task for the plain function it decorates.)
"""The Celery app of the Celery-level fault tests: a fenced read-modify-write workload.

Workers load it as ``-A tests.faults.celery_faults_app`` (the repository is on their
``PYTHONPATH``); it is configured from the environment like the apps of tests/celery, and its
task bodies write to the same run log (``tests.celery.apps.common.record``).

:func:`fenced_increment` is one step of the workload. Under its lock it *reads* the account
with its fence (``FencedLedger.add(account, 0, fence)``: the ledger records the fence, so any
later access with a lower one is refused), works for a while, then *writes* ``+1`` with the
same fence. A run whose write lands on a balance other than the one it read (``after !=
before + 1``) had another writer in between: in a store that sets values, that is a lost
update. The fault tests count those, and compare each account's balance with its accepted
writes.

:func:`publish_fenced_increment` is the same step with ``lock_from="publish"`` (queue once,
issue 17): published through the task by ``tests.faults.publish_workload``'s processes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from celery import bootsteps

from celery_dflock import LockedTask, LockLost
from celery_dflock.signals import lock_lost
from examples.proj.ledger import FencedLedger, StaleFenceError
from tests.celery.apps.common import hold_header, record, record_lock_lost, worker_app

app = worker_app("tests.faults.celery_faults_app")
lock_lost.connect(record_lock_lost)


class ConsumerStarted(bootsteps.StartStopStep):
    """Logs ``consumer_started`` each time the worker's consumer (re)connects to the broker."""

    requires = frozenset({"celery.worker.consumer.tasks:Tasks"})

    def start(self, parent: Any) -> None:
        record("consumer_started")


steps: Any = app.steps
steps["consumer"].add(ConsumerStarted)

FENCED_INCREMENT = "faults.fenced_increment"
"""The task's name, for ``send_task``."""
PUBLISH_FENCED_INCREMENT = "faults.publish_fenced_increment"
"""The same step with ``lock_from="publish"`` (published through the task, not send_task)."""
PUBLISH_PENDING_TTL_S = 8
"""``lock_pending_ttl`` of the publish-time workload: a hold whose publisher died before it
sent the message is free again after this."""
ACCOUNT_KEY = "acct:{account}"
"""Lock key template: one lock per ledger account."""
QUEUE_WAIT_S = 30
"""How long a run waits in the key's FIFO queue before it fails (``lock_timeout``)."""
GO_POLL_S = 0.02
STEP_LIMIT_S = 60.0
"""Longest step of any run (a test that never lets a run go on still ends)."""


def _step(go_file: str | None, hold_s: float) -> None:
    """The work between the read and the write: until ``go_file`` exists, or ``hold_s``."""
    if go_file is None:
        time.sleep(hold_s)
        return
    deadline = time.monotonic() + STEP_LIMIT_S
    go = Path(go_file)
    while not go.exists() and time.monotonic() < deadline:
        time.sleep(GO_POLL_S)


class _FencedTask(LockedTask):
    """Records how a failed run ended once its body is over, where no interrupt can land.

    ``on_lock_lost="interrupt"`` raises `LockLost` asynchronously, at any bytecode of the
    body, including inside the body's own ``except`` clauses. A run whose stale write was
    refused can take the interrupt while it logs the refusal: logging in the body then loses
    the event. `on_failure` runs after the body (the interrupt, if not delivered by then, is
    dropped), and reads the body's stage and the exception chain instead.
    """

    def on_failure(self, exc: Exception, task_id: str, args: Any, kwargs: Any, einfo: Any) -> None:
        run: dict[str, Any] | None = getattr(self.request, "fault_run", None)
        if run is None:  # failed before the body (the lock was not taken)
            return
        stage = run.pop("stage")
        stale = next((e for e in _chain(exc) if isinstance(e, StaleFenceError)), None)
        if stale is not None:  # the write (or read) was refused, interrupted or not after
            lock = getattr(self.request, "fault_lock", None)
            record("refused", stage=stage, lost=bool(lock and lock.lost), message=str(stale), **run)
        elif isinstance(exc, LockLost):  # on_lock_lost="interrupt", before any refusal
            record("interrupted", stage=stage, error=type(exc).__name__, **run)


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised while handling."""
    seen: BaseException | None = exc
    while seen is not None:
        yield seen
        seen = seen.__context__


def _fenced_step(
    task: LockedTask,
    account: str,
    ledger: str,
    label: str,
    go_file: str | None,
    hold_s: float,
) -> int:
    """Read ``account`` with the lock's fence, step, then add 1 with the same fence.

    A refused access or an interrupt is logged by `_FencedTask.on_failure`, after the body.
    Besides wall-clock times, the run logs ``mono_start``/``mono_end`` (``time.monotonic()``,
    one clock for every process of the host: the history checker compares them with the
    publishers'), and the token it holds and the one its message's ``dflock_hold`` header
    named (a publish-time hold taken over by the run has the same).
    """
    lock = task.lock
    assert lock is not None and lock.fence is not None
    fence = lock.fence
    request: Any = task.request
    task_id = request.id
    key = request.dflock_key
    store = FencedLedger(Path(ledger))
    start = time.time()
    common = {"label": label, "account": account, "key": key, "fence": fence, "task_id": task_id}
    run = {"stage": "read", **common}
    request.fault_run = run
    request.fault_lock = lock
    hold = hold_header(request)
    record(
        "granted",
        start=start,
        mono_start=time.monotonic(),
        token=lock.token,
        hold_token=None if hold is None else hold.get("token"),
        **common,
    )
    before = store.add(account, 0, fence)  # the fenced read
    record("read", before=before, **common)
    _step(go_file, hold_s)
    run["stage"] = "write"
    after = store.add(account, 1, fence)
    record(
        "applied",
        before=before,
        after=after,
        start=start,
        end=time.time(),
        mono_end=time.monotonic(),
        lost=lock.lost,
        **common,
    )
    return after


@app.task(
    bind=True,
    base=_FencedTask,
    name=FENCED_INCREMENT,
    lock_key=ACCOUNT_KEY,
    on_locked="raise",
    lock_timeout=QUEUE_WAIT_S,
)
def fenced_increment(
    self: LockedTask,
    account: str,
    ledger: str,
    label: str,
    go_file: str | None = None,
    hold_s: float = 0.0,
) -> int:
    """One step of the fenced workload, locked while it runs (see `_fenced_step`)."""
    return _fenced_step(self, account, ledger, label, go_file, hold_s)


@app.task(
    bind=True,
    base=_FencedTask,
    name=PUBLISH_FENCED_INCREMENT,
    lock_key=ACCOUNT_KEY,
    lock_from="publish",
    lock_pending_ttl=PUBLISH_PENDING_TTL_S,
    on_locked="raise",
    lock_timeout=QUEUE_WAIT_S,
)
def publish_fenced_increment(
    self: LockedTask,
    account: str,
    ledger: str,
    label: str,
    go_file: str | None = None,
    hold_s: float = 0.0,
) -> int:
    """The same step, its key held from publish (queue once): a publish while the account's
    key is held sends nothing and returns the holder's id."""
    return _fenced_step(self, account, ledger, label, go_file, hold_s)
