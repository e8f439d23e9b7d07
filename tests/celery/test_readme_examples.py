# pyright: reportAttributeAccessIssue=false, reportCallIssue=false, reportFunctionMemberAccess=false
# (Celery's @app.task is untyped: pyright takes a task for the plain function it decorates.)
"""The examples of docs/locked-tasks.md (once the README's "Locked tasks" section), checked
more closely than tests/docs runs them: under contention (eager mode, real server).

Each test repeats one example of the page; only the app's broker differs (in-memory,
tasks run eagerly in this process against the real lock server).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from celery import Celery

import celery_dflock.signals
from celery_dflock import (
    DistributedLock,
    DistributedSemaphore,
    LockedTask,
    LockLost,
    LockSkipped,
)
from celery_dflock.config import reset_config
from celery_dflock.pytest_plugin import configure_app
from celery_dflock.signals import lock_lost
from dflockd_server.testing import ServerThread


@pytest.fixture
def server(dflock_server: ServerThread) -> ServerThread:
    # conftest's server: a short shutdown timeout, so stop() (a drain that waits for holders to
    # release) ends soon and the lost-lock example sees its lock lost.
    return dflock_server


def eager_app(server: ServerThread, **kwargs: Any) -> Celery:
    app = Celery("proj", set_as_current=False, **kwargs)
    app.conf.update(
        broker_url="memory://",
        result_backend="cache+memory://",
        task_always_eager=True,
        task_store_eager_result=True,
    )
    return configure_app(app, server)


def test_basic_example(server: ServerThread) -> None:
    app = eager_app(server)
    keys: list[str] = []

    @app.task(shared=False, base=LockedTask, lock_key="report:{customer_id}", lock_ttl=60)
    def build_report(customer_id: int, fmt: str = "pdf") -> str:
        from celery import current_task

        keys.append(current_task.request.dflock_key)
        return f"report {customer_id}.{fmt}"  # one run per customer at a time

    assert build_report.delay(7).get() == "report 7.pdf"
    build_report.delay(customer_id=7)
    build_report.delay(7, "pdf")
    assert keys == ["report:7", "report:7", "report:7"]
    app.conf.dflock_servers = [server.address]  # the list form works too
    reset_config(app)
    assert build_report.delay(8).get() == "report 8.pdf"


def test_skipping_duplicates_example(server: ServerThread) -> None:
    app = eager_app(server)
    ran: list[int] = []

    @app.task(shared=False, base=LockedTask, lock_key="sync:{account_id}", on_locked="skip")
    def sync_account(account_id: int) -> None:
        ran.append(account_id)

    other_sync = DistributedLock("sync:42", servers=[server.address])
    assert other_sync.acquire()
    try:
        result = sync_account.delay(42)
    finally:
        other_sync.release()
    assert result.ready()
    with pytest.raises(LockSkipped):
        result.get(timeout=10)
    assert isinstance(app.AsyncResult(result.id).result, LockSkipped)
    assert ran == []


def test_per_tenant_caps_example(server: ServerThread) -> None:
    app = eager_app(server)

    @app.task(
        shared=False, base=LockedTask, lock_key="tenant:{tenant_id}", lock_limit=3, lock_timeout=30
    )
    def import_batch(tenant_id: str, batch: list[int]) -> int:
        return len(batch)  # at most 3 imports per tenant at once

    others = [DistributedSemaphore("tenant:acme", 3, servers=[server.address]) for _ in range(3)]
    for other in others:
        assert other.acquire()
    freed = threading.Timer(0.2, others[0].release)
    freed.start()
    try:
        # Three imports run: this one waits in the queue until a slot frees.
        assert import_batch.delay("acme", [1, 2, 3]).get() == 3
    finally:
        freed.cancel()
        for other in others:
            other.release()


class FencedStore:
    """A store that rejects writes carrying an older fence than it has seen."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, int, int]] = []
        self.highest: dict[str, int] = {}

    def write_if_newer(self, account: str, entry: int, *, fence: int) -> None:
        if fence < self.highest.get(account, 0):
            raise RuntimeError("stale fence")
        self.highest[account] = fence
        self.rows.append((account, entry, fence))


def test_fencing_tokens_example(server: ServerThread) -> None:
    app = eager_app(server)
    store = FencedStore()

    @app.task(
        shared=False, bind=True, base=LockedTask, lock_key="ledger:{account}", on_lock_lost="flag"
    )
    def post_entries(self: LockedTask, account: str, entries: list[int]) -> int:
        assert self.lock is not None
        fence = self.lock.fence  # also self.request.dflock_fence
        assert fence is not None and fence == self.request.dflock_fence
        for entry in entries:
            if self.lock.lost:  # or wait on self.lock.lost_event
                raise RuntimeError("lock lost: stop writing")
            store.write_if_newer(account, entry, fence=fence)  # the store rejects older fences
        return len(entries)

    assert post_entries.delay("a1", [1, 2]).get() == 2
    assert post_entries.delay("a1", [3]).get() == 1
    fences = [row[2] for row in store.rows]
    assert fences[0] == fences[1] < fences[2]


def test_lock_lost_signal_example(server: ServerThread) -> None:
    app = eager_app(server)
    alerts: list[str] = []
    started = threading.Event()

    @lock_lost.connect
    def alert(sender: Any, task_id: str, key: str, lock: Any, policy: str, **kwargs: Any) -> None:
        alerts.append(f"task {sender.name}[{task_id}] lost {key} (fence {lock.fence}): {policy}")

    @app.task(shared=False, bind=True, base=LockedTask, lock_key="lost-demo", lock_ttl=2)
    def long_job(self: LockedTask) -> None:
        started.set()
        assert self.lock is not None
        deadline = time.monotonic() + 20  # interrupted long before 20 s
        while time.monotonic() < deadline:  # (once lost, the event no longer waits)
            self.lock.lost_event.wait(0.05)

    outcome: list[BaseException] = []

    def run() -> None:
        outcome.append(long_job.delay().result)  # eager: the failure is the result

    try:
        thread = threading.Thread(target=run)
        thread.start()
        assert started.wait(10)
        server.stop()
        thread.join(15)
    finally:
        lock_lost.disconnect(alert)
    assert len(outcome) == 1
    assert isinstance(outcome[0], LockLost)
    assert len(alerts) == 1
    assert "lost lost-demo" in alerts[0]
    assert alerts[0].endswith(": interrupt")


def test_whole_project_example(server: ServerThread) -> None:
    app = configure_app(Celery("proj", task_cls="celery_dflock:LockedTask"), server)
    app.conf.task_always_eager = True
    seen: dict[str, int | None] = {}

    @app.task(shared=False, lock_key="invoice:{invoice_id}")  # locked: it has a lock option
    def send_invoice(invoice_id: int) -> None:
        from celery import current_task

        seen["send_invoice"] = current_task.request.dflock_fence

    @app.task(shared=False)  # not locked: no lock option
    def ping() -> str:
        from celery import current_task

        seen["ping"] = getattr(current_task.request, "dflock_fence", None)
        return "pong"

    send_invoice.delay(1)
    assert ping.delay().get() == "pong"
    assert seen["send_invoice"] is not None
    assert seen["ping"] is None


def test_tasks_you_cannot_edit_example(server: ServerThread) -> None:
    app = eager_app(server)
    fences: list[int | None] = []

    @app.task(shared=False, name="thirdparty.tasks.rebuild_index")
    def rebuild_index(index: str) -> str:
        from celery import current_task

        fences.append(current_task.request.dflock_fence)
        return index

    app.conf.dflock_task_locks = {
        "thirdparty.tasks.rebuild_index": {"lock_key": "rebuild:{index}", "on_locked": "skip"},
    }
    celery_dflock.signals.install(app)
    app.finalize()  # a worker finalizes the app itself; an eager test must do it

    assert rebuild_index.delay("products").get() == "products"
    assert fences and fences[0] is not None
    other = DistributedLock("rebuild:products", servers=[server.address])
    assert other.acquire()
    try:
        skipped = rebuild_index.delay("products")
        assert skipped.state == "FAILURE"
        assert type(skipped.result).__name__ == "LockSkipped"
    finally:
        other.release()
    assert len(fences) == 1


def test_per_call_options_example(server: ServerThread) -> None:
    app = eager_app(server)
    keys: list[str] = []

    @app.task(shared=False, base=LockedTask, lock_key="report:{customer_id}", lock_ttl=60)
    def build_report(customer_id: int, fmt: str = "pdf") -> str:
        from celery import current_task

        keys.append(current_task.request.dflock_key)
        return f"report {customer_id}.{fmt}"

    build_report.apply_async((7,), lock_ttl=300, on_locked="raise")
    build_report.apply_async((7,), lock_key="report:{customer_id}:urgent")
    assert keys == ["report:7", "report:7:urgent"]


def test_direct_calls_example(server: ServerThread) -> None:
    app = eager_app(server)

    @app.task(shared=False, base=LockedTask, lock_key="report:{customer_id}")
    def build_report(customer_id: int) -> str:
        return f"report {customer_id}"

    assert build_report(7) == "report 7"
    holder = DistributedLock("report:7", servers=[server.address])
    assert holder.acquire()
    try:
        from celery_dflock import LockNotAcquired

        with pytest.raises(LockNotAcquired):
            build_report(7)  # a direct call cannot be retried
    finally:
        holder.release()
