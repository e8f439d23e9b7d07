# pyright: reportAttributeAccessIssue=false, reportCallIssue=false, reportFunctionMemberAccess=false
# (Celery's @app.task is untyped: pyright takes a task for the plain function it decorates.)
"""LockedTask in this process: direct calls, eager mode, options and policies (real server)."""

from __future__ import annotations

import contextvars
import re
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, Task

from celery_dflock import (
    LockedTask,
    LockLost,
    LockNotAcquired,
    LockSkipped,
    ServerUnavailable,
)
from celery_dflock.client import Client, DistributedLock
from celery_dflock.config import DflockConfigError, reset_config
from celery_dflock.signals import install, lock_lost, lock_skipped
from celery_dflock.task import apply_task_locks
from dflockd_server import Config, protocol as server_protocol
from dflockd_server.cluster.shardmap import SHARD_COUNT, shard_id
from dflockd_server.testing import ServerThread
from tests.support.apps import make_app
from tests.support.ports import free_port


@pytest.fixture
def server() -> Iterator[ServerThread]:
    with ServerThread(Config(host="127.0.0.1", port=0, default_lease_ttl_s=30)) as s:
        yield s


def inproc_app(server: ServerThread, **conf: Any) -> Celery:
    return make_app("inproc", eager=True, servers=server, task_store_eager_result=True, **conf)


def holder(server: ServerThread, key: str) -> DistributedLock:
    """A lock on ``key`` taken by 'another worker' (this test)."""
    lock = DistributedLock(key, acquire_timeout_s=2, servers=[server.address])
    assert lock.acquire()
    return lock


def free_now(server: ServerThread, key: str) -> bool:
    lock = DistributedLock(key, acquire_timeout_s=0, servers=[server.address])
    got = lock.acquire()
    lock.release()
    return got


def test_direct_call_takes_and_releases_the_lock(server: ServerThread) -> None:
    app = inproc_app(server)
    seen: dict[str, Any] = {}

    @app.task(shared=False, bind=True, base=LockedTask, lock_key="direct:{n}")
    def job(self: LockedTask, n: int) -> int:
        lock = self.lock
        assert lock is not None
        seen["fence"] = lock.fence
        seen["request_fence"] = self.request.dflock_fence
        seen["free_inside"] = free_now(server, "direct:1")
        return n * 2

    assert job(1) == 2
    assert seen["fence"] is not None
    assert seen["fence"] == seen["request_fence"]
    assert seen["free_inside"] is False
    assert free_now(server, "direct:1")
    assert job.lock is None  # nothing held outside a run


def test_a_task_id_that_is_no_str_is_the_holders_note_as_text(server: ServerThread) -> None:
    """Celery takes any id (``apply_async(task_id=123)``, a row's id); the run failed with a
    raw ``TypeError`` where it wrote the holder's note. (Celery's result backends refuse such
    ids: none is stored here.)"""
    app = make_app("inproc", eager=True, servers=server)
    owners: list[str] = []

    @app.task(shared=False, base=LockedTask, lock_key="int-id")
    def job() -> int:
        owners.extend(e["owner"] for e in server.stats()["locks"] if e["key"] == "int-id")
        return 1

    assert job.apply(task_id=123).get() == 1
    (owner,) = owners
    assert owner.split("/")[0] == "123"


def test_a_send_whose_task_id_is_no_str_holds_its_key(server: ServerThread) -> None:
    """The same at publish (``lock_from="publish"``): taking the hold failed with a raw
    ``TypeError``, and nothing was sent. (An app without a result backend: Celery's refuse.)"""
    app = make_app("publish-int-id", servers=server, broker_url="memory://")

    @app.task(shared=False, base=LockedTask, lock_key="int-id-sent", lock_from="publish")
    def job() -> int:
        return 1

    # kombu's memory:// broker is one per process: a queue of its own, emptied after, so that
    # another test's worker (tests/celery/test_pytest_plugin.py) never gets this message
    queue = f"int-id-{uuid.uuid4().hex}"
    try:
        sent = job.apply_async(task_id=987654321, queue=queue)
        assert sent.id == 987654321
        (owner,) = (e["owner"] for e in server.stats()["locks"] if e["key"] == "int-id-sent")
        assert owner.split("/")[0] == "987654321"
        duplicate = job.apply_async(queue=queue)
        assert duplicate.id == "987654321"  # the holder, as its note says
    finally:
        with app.connection_for_write() as connection:
            assert connection.default_channel.queue_purge(queue) == 1  # one message was sent


def test_eager_call_releases_after_an_exception(server: ServerThread) -> None:
    app = inproc_app(server)

    @app.task(shared=False, base=LockedTask, lock_key="boom")
    def boom() -> None:
        raise ValueError("boom")

    result = boom.apply()
    assert result.state == "FAILURE"
    assert isinstance(result.result, ValueError)
    assert free_now(server, "boom")


def test_busy_lock_with_raise_policy_fails_with_lock_not_acquired(server: ServerThread) -> None:
    app = inproc_app(server)

    @app.task(shared=False, base=LockedTask, lock_key="busy", on_locked="raise")
    def job() -> str:
        return "ran"

    other = holder(server, "busy")
    try:
        with pytest.raises(LockNotAcquired, match="'busy' is held by another run"):
            job()
        result = job.apply()
        assert result.state == "FAILURE"
        assert isinstance(result.result, LockNotAcquired)
    finally:
        other.release()
    assert job() == "ran"


def test_a_direct_call_on_a_busy_key_says_how_long_it_really_waited(server: ServerThread) -> None:
    """A direct call does not wait in the key's queue (it has no message to send again): its
    error said "(waited 30s; on_locked='retry')", the queue wait its messages get, after
    0.00 s. It says what it measured: one refused acquire, a round trip (0.1 s on a saturated
    CI machine), nowhere near the queue wait."""
    app = inproc_app(server)

    @app.task(shared=False, base=LockedTask, lock_key="busy-direct")
    def job() -> str:
        return "ran"

    other = holder(server, "busy-direct")
    try:
        with pytest.raises(LockNotAcquired) as caught:
            job()
        said = re.search(r"\(waited (\d+\.\d)s; on_locked='retry'\)", str(caught.value))
        assert said is not None, caught.value
        assert float(said.group(1)) < 5.0, caught.value
    finally:
        other.release()


class HandingOver:
    """A one-member cluster's ownership (test stand-in for the cluster node) whose shard of
    ``key`` is changing hands: ``error_unavailable`` for it, every other key served."""

    def __init__(self, me: str, key: str) -> None:
        self.me = me
        self.shard = shard_id(key)

    def check(self, key: str) -> bytes | None:
        return server_protocol.REPLY_ERROR_UNAVAILABLE if shard_id(key) == self.shard else None

    def check_asked(self, key: str) -> bytes | None:
        return self.check(key)

    def admit_ask(self, key: str, ticket: str) -> bytes | None:
        return None

    def may_hold(self, key: str) -> bool:
        return True

    def describe(self) -> dict[str, object]:
        return {
            "mode": "cluster",
            "self": self.me,
            "leader": self.me,
            "members": [self.me],
            "shard_count": SHARD_COUNT,
            "hash": "fnv1a32",
            "nodes": [self.me],
            "current": [0] * SHARD_COUNT,
            "target": [0] * SHARD_COUNT,
            "pinned": [],
            "moving": [],
        }


def test_a_hand_over_that_outlasts_lock_timeout_says_so_not_that_the_key_is_held(
    server: ServerThread,
) -> None:
    """In cluster mode, a run whose key's shard is changing hands until its lock_timeout
    (0, try once: the client still follows the hand-over for a short bounded time) ends as a
    busy key does (on_locked), with a message that says a hand-over was under way, naming the
    key and the member, not that another run holds it."""
    me = f"{server.host}:{server.port}"
    server.server.set_ownership(HandingOver(me, "moving"))
    app = inproc_app(server, dflock_sharding_strategy="cluster")

    @app.task(shared=False, base=LockedTask, lock_key="moving", on_locked="raise")
    def job() -> str:
        return "ran"

    with pytest.raises(LockNotAcquired) as caught:
        job()
    message = str(caught.value)
    assert "hand-over of its shard" in message
    assert "'moving'" in message
    assert f"{me} answered error_unavailable" in message
    assert "held by" not in message


def test_skip_policy_fails_with_lock_skipped_sends_a_signal_and_never_runs(
    server: ServerThread,
) -> None:
    """Eager and direct calls end as a worker run does: LockSkipped, never Celery's Ignore."""
    app = inproc_app(server)
    ran: list[int] = []
    skipped: list[dict[str, Any]] = []

    @app.task(shared=False, base=LockedTask, lock_key="skip:{n}", on_locked="skip")
    def job(n: int) -> int:
        ran.append(n)
        return n

    def on_skipped(sender: Any = None, **kwargs: Any) -> None:
        skipped.append({"sender": sender, **kwargs})

    lock_skipped.connect(on_skipped)
    other = holder(server, "skip:1")
    try:
        result = job.apply((1,))
        assert result.state == "FAILURE"
        assert isinstance(result.result, LockSkipped)
        assert f"[{result.id}]" in str(result.result)
        stored = app.AsyncResult(result.id)
        assert stored.state == "FAILURE"
        assert isinstance(stored.result, LockSkipped)
        with pytest.raises(LockSkipped, match=r"called directly\) was skipped: lock 'skip:1'") as e:
            job(1)
        assert "[None]" not in str(e.value)
    finally:
        other.release()
        lock_skipped.disconnect(on_skipped)
    assert ran == []
    assert [s["key"] for s in skipped] == ["skip:1", "skip:1"]
    assert skipped[0]["sender"].name == job.name
    assert skipped[0]["args"] == (1,)
    assert job.apply((1,)).get() == 1


def test_fifo_wait_then_policy(server: ServerThread) -> None:
    app = inproc_app(server)

    @app.task(shared=False, base=LockedTask, lock_key="fifo", lock_timeout=5, on_locked="raise")
    def job() -> str:
        return "ran"

    other = holder(server, "fifo")
    releaser = threading.Timer(0.3, other.release)
    releaser.start()
    try:
        assert job() == "ran"  # waited in the queue until the holder let go
    finally:
        releaser.cancel()
        other.release()


def test_eager_retry_waits_for_the_lock_and_honours_lock_max_retries(
    server: ServerThread,
) -> None:
    app = inproc_app(server)
    runs: list[int] = []

    @app.task(
        shared=False,
        bind=True,
        base=LockedTask,
        lock_key="eager-retry",
        on_locked="retry",
        lock_timeout=0,  # retry at once: the retries are tested here, not the wait before them
        max_retries=0,  # Celery's own budget: lock retries do not use it
        lock_max_retries=1,
        lock_retry_countdown=0.5,
        lock_retry_jitter=False,
    )
    def job(self: LockedTask) -> int:
        runs.append(self.request.retries)
        return self.request.retries

    other = holder(server, "eager-retry")
    try:
        result = job.apply()
        assert result.state == "FAILURE"
        assert isinstance(result.result, LockNotAcquired)
        assert "after 1 lock retries (lock_max_retries=1)" in str(result.result)
    finally:
        other.release()
    assert runs == []
    assert job.apply().get() == 0


@pytest.mark.parametrize("how", ["delay", "apply"])
def test_an_eager_run_inside_the_run_holding_its_key_fails_at_once(
    server: ServerThread, how: str
) -> None:
    """A locked body that sends a task of its own key (``task_always_eager``, or ``apply()``)
    runs it here, inside the run holding the key: under ``on_locked="retry"`` it waited
    ``lock_timeout`` for itself, then retried eagerly without end (``lock_max_retries=None``),
    and the caller hung for good. It now fails at once with `LockNotAcquired`, saying why."""
    app = inproc_app(server)
    ran: list[str] = []

    @app.task(shared=False, base=LockedTask, lock_key="report:{cid}")
    def send_report(cid: int) -> None:
        ran.append("send")

    @app.task(shared=False, base=LockedTask, lock_key="report:{cid}")
    def build_report(cid: int) -> str:
        nested = send_report.delay(cid) if how == "delay" else send_report.apply((cid,))
        assert nested.state == "FAILURE"
        return str(nested.result)

    outcome: list[str] = []
    caller = threading.Thread(target=lambda: outcome.append(build_report.delay(7).get()))
    caller.start()
    caller.join(20)
    assert not caller.is_alive(), "the nested run waited for its own caller's key"
    (said,) = outcome
    assert "lock 'report:7' is held by the run that called it" in said, said
    assert ran == []
    assert free_now(server, "report:7")


def test_an_eager_run_inside_the_run_holding_the_one_slot_of_its_key_fails_at_once(
    server: ServerThread,
) -> None:
    """As a lock's: a semaphore of one slot (``lock_limit=1``) held by the run that sends a
    task of its key eagerly left the nested run waiting for its own caller, then retrying
    without end."""
    app = inproc_app(server)

    @app.task(shared=False, base=LockedTask, lock_key="slot:{cid}", lock_limit=1)
    def send_report(cid: int) -> None:
        raise AssertionError("runs inside the holder of its one slot")

    @app.task(shared=False, base=LockedTask, lock_key="slot:{cid}", lock_limit=1)
    def build_report(cid: int) -> str:
        nested = send_report.apply((cid,))
        assert nested.state == "FAILURE"
        return str(nested.result)

    outcome: list[str] = []
    caller = threading.Thread(target=lambda: outcome.append(build_report.delay(7).get()))
    caller.start()
    caller.join(20)
    assert not caller.is_alive(), "the nested run waited for its own caller's slot"
    (said,) = outcome
    assert "'slot:7' is held by the run that called it" in said, said


def test_an_eager_retry_under_on_locked_retry_runs_again(server: ServerThread) -> None:
    """Celery runs an eager ``self.retry`` after the run that asked for it, not inside it: the
    retried run is no run inside the holder of its key (the check above leaves it alone)."""
    app = inproc_app(server)

    @app.task(shared=False, bind=True, base=LockedTask, lock_key="eager-self-retry")
    def job(self: LockedTask) -> int:
        if self.request.retries == 0:
            raise self.retry(countdown=0, max_retries=2)
        return self.request.retries

    assert job.apply().get() == 1
    assert free_now(server, "eager-self-retry")


def test_body_retry_releases_before_the_retry_runs(server: ServerThread) -> None:
    app = inproc_app(server)
    fences: list[int | None] = []

    @app.task(shared=False, bind=True, base=LockedTask, lock_key="body-retry", on_locked="raise")
    def job(self: LockedTask) -> int:
        lock = self.lock
        assert lock is not None
        fences.append(lock.fence)
        if self.request.retries == 0:
            # Eager retries run inside this call: the lock must already be free.
            raise self.retry(countdown=0, max_retries=2)
        return self.request.retries

    assert job.apply().get() == 1
    assert len(fences) == 2
    assert fences[0] is not None and fences[1] is not None
    assert fences[1] > fences[0]
    assert free_now(server, "body-retry")


def test_per_call_options_override_the_task_attribute(server: ServerThread) -> None:
    app = inproc_app(server)
    keys: list[str] = []

    @app.task(shared=False, bind=True, base=LockedTask, lock_key="attr:{n}", on_locked="raise")
    def job(self: LockedTask, n: int) -> str:
        keys.append(self.request.dflock_key)
        return "ran"

    assert job.apply_async((1,), lock_key="call:{n}").get() == "ran"
    assert job.apply_async((1,)).get() == "ran"
    assert keys == ["call:1", "attr:1"]
    other = holder(server, "call:2")
    try:
        result = job.apply_async((2,), lock_key="call:{n}", on_locked="skip")
        assert isinstance(result.result, LockSkipped)
    finally:
        other.release()
    with pytest.raises(DflockConfigError, match=r"call option|apply_async options"):
        job.apply_async((1,), on_locked="sometimes")


def test_task_cls_locks_only_tasks_with_lock_options(server: ServerThread) -> None:
    app = make_app(
        "inproc-cls",
        celery_kwargs={"task_cls": LockedTask},
        task_always_eager=True,
        servers=server,
    )
    fences: dict[str, int | None] = {}

    @app.task(shared=False, bind=True)
    def plain(self: LockedTask) -> None:
        fences["plain"] = self.request.dflock_fence if self.lock else None

    @app.task(shared=False, bind=True, lock_key="cls-locked")
    def locked(self: LockedTask) -> None:
        fences["locked"] = self.lock.fence if self.lock else None

    plain()
    locked()
    assert fences["plain"] is None
    assert fences["locked"] is not None


def test_config_only_locking_of_a_plain_task(server: ServerThread) -> None:
    app = inproc_app(
        server, dflock_task_locks={"inproc.third_party": {"lock_key": "tp", "on_locked": "raise"}}
    )
    seen: list[int | None] = []

    @app.task(shared=False, name="inproc.third_party")
    def third_party() -> str:
        from celery import current_task

        seen.append(current_task.request.dflock_fence)
        return "ran"

    install(app)
    app.finalize()
    apply_task_locks(app)
    other = holder(server, "tp")
    try:
        with pytest.raises(LockNotAcquired):
            third_party()
    finally:
        other.release()
    assert third_party.apply().get() == "ran"
    assert seen and seen[0] is not None


def test_config_only_locking_keeps_a_tasks_own_worker_request(server: ServerThread) -> None:
    """A task locked by ``dflock_task_locks`` alone keeps the worker request class it names
    (Celery's ``Task.Request``, whose hooks the worker calls); `LockedTask`'s took its place,
    so the task's own ``on_failure`` or ``on_timeout`` hooks were no longer called."""
    from celery.worker.request import Request

    class Audited(Request):
        pass

    class AuditedTask(Task):
        Request = Audited

    app = inproc_app(server, dflock_task_locks={"inproc.audited": {"lock_key": "au"}})

    @app.task(shared=False, name="inproc.audited", base=AuditedTask)
    def audited() -> None:
        pass

    @app.task(shared=False, name="inproc.plain")
    def plain() -> None:
        pass

    install(app)
    app.finalize()
    apply_task_locks(app)
    assert isinstance(audited, LockedTask) and audited.Request is Audited
    assert isinstance(plain, Task) and plain.Request == Task.Request


def test_config_only_locking_keeps_a_tasks_own_call(server: ServerThread) -> None:
    """A task locked by ``dflock_task_locks`` alone runs its own class's ``__call__`` (Flask's
    ``FlaskTask``, which runs the body in the app context, as the app's ``task_cls``) under
    the lock; `LockedTask`'s ``__call__`` took its place, so the body ran without it."""
    context: contextvars.ContextVar[str | None] = contextvars.ContextVar("app", default=None)

    class ContextTask(Task):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            token = context.set("app context")
            try:
                return self.run(*args, **kwargs)
            finally:
                context.reset(token)

    app = inproc_app(server, dflock_task_locks={"inproc.in_context": {"lock_key": "ctx"}})

    @app.task(shared=False, name="inproc.in_context", base=ContextTask)
    def in_context() -> tuple[str | None, bool]:
        return context.get(), free_now(server, "ctx")

    install(app)
    app.finalize()
    assert isinstance(in_context, LockedTask)
    assert in_context.apply().get() == ("app context", False)
    assert in_context() == ("app context", False)


def test_a_locked_task_class_whose_call_runs_the_body_itself_runs_it_locked(
    server: ServerThread,
) -> None:
    """A subclass of `LockedTask` with a ``__call__`` that runs ``self.run`` (as Celery's docs
    write a task class's ``__call__``): it took `LockedTask`'s place, so every run went
    unlocked. A subclass of that class, and one whose ``__call__`` calls ``super()``'s, too."""
    context: contextvars.ContextVar[str | None] = contextvars.ContextVar("ctx", default=None)

    class ContextTask(LockedTask):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            token = context.set("in context")
            try:
                return self.run(*args, **kwargs)
            finally:
                context.reset(token)

    class Derived(ContextTask):
        pass

    class Chained(ContextTask):
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            return super().__call__(*args, **kwargs)

    app = inproc_app(server)
    for base in (ContextTask, Derived, Chained):
        key = f"own-call-{base.__name__}"

        @app.task(shared=False, name=f"inproc.{key}", base=base, lock_key=key)
        def run(key: str = key) -> tuple[str | None, bool]:
            return context.get(), free_now(server, key)

        assert run.apply().get() == ("in context", False), base
        assert run() == ("in context", False), base
        assert free_now(server, key)


def test_config_only_locking_keeps_a_tasks_own_apply_async(server: ServerThread) -> None:
    """A task locked by ``dflock_task_locks`` alone keeps its class's own ``apply_async`` (a
    multi-tenant app's ``task_cls`` adds the tenant's header there); `LockedTask`'s called
    Celery's instead, so the task was sent without it and ran for no tenant."""

    class TenantTask(Task):
        def apply_async(self, *args: Any, **options: Any) -> Any:
            options["headers"] = {**(options.get("headers") or {}), "tenant": "t1"}
            return super().apply_async(*args, **options)

    app = inproc_app(server, dflock_task_locks={"inproc.tenant": {"lock_key": "tenant"}})

    @app.task(shared=False, bind=True, name="inproc.tenant", base=TenantTask)
    def tenant(self: Task) -> object:
        assert self.request.dflock_fence is not None  # under its lock
        return (self.request.headers or {}).get("tenant")

    install(app)
    app.finalize()
    assert isinstance(tenant, LockedTask)
    assert tenant.delay().get() == "t1"


def test_lost_lock_interrupts_the_body_and_sends_lock_lost(server: ServerThread) -> None:
    app = inproc_app(server)
    started = threading.Event()
    signals_seen: list[dict[str, Any]] = []

    @app.task(
        shared=False,
        bind=True,
        base=LockedTask,
        lock_key="lose",
        lock_ttl=2,
        on_lock_lost="interrupt",
    )
    def job(self: LockedTask) -> str:
        started.set()
        lock = self.lock
        assert lock is not None
        for _ in range(600):  # up to 30 s
            lock.lost_event.wait(0.05)
        return "not interrupted"

    def on_lost(sender: Any = None, **kwargs: Any) -> None:
        signals_seen.append(kwargs)

    lock_lost.connect(on_lost)
    outcome: list[BaseException | str] = []

    def run() -> None:
        try:
            outcome.append(job())
        except LockLost as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert started.wait(10)
        server.stop()
        thread.join(10)
        # The watcher marks the lock lost, then sends lock_lost: the run may end in between,
        # so the listener stays connected until the signal came (or 5 s passed).
        deadline = time.monotonic() + 5
        while not signals_seen and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        lock_lost.disconnect(on_lost)
    assert not thread.is_alive()
    assert len(outcome) == 1
    assert isinstance(outcome[0], LockLost)
    # Interrupted in the body, or (the body saw lost_event first and returned) failed after it.
    assert "lost its lock 'lose'" in str(outcome[0])
    assert [s["key"] for s in signals_seen] == ["lose"]
    assert signals_seen[0]["policy"] == "interrupt"


@pytest.mark.parametrize("policy", ["interrupt", "terminate", "flag"])
def test_a_loss_the_release_finds_fails_the_run_but_under_flag(
    server: ServerThread, policy: str
) -> None:
    """The key is freed under the run (an operator's force release) and its body returns
    before a renewal could tell it: the release finds the loss. The run whose lock was lost
    is no success, but under ``on_lock_lost="flag"`` (it ended as a success before)."""
    app = inproc_app(server)
    signals_seen: list[dict[str, Any]] = []

    @app.task(shared=False, bind=True, base=LockedTask, lock_key="freed", on_lock_lost=policy)
    def job(self: LockedTask) -> str:
        client = Client(servers=[server.address])
        try:
            assert client.force_release("freed", note="test") == 1
        finally:
            client.close()
        return "done"

    def on_lost(sender: Any = None, **kwargs: Any) -> None:
        signals_seen.append(kwargs)

    lock_lost.connect(on_lost)
    try:
        if policy == "flag":
            assert job() == "done"
        else:
            with pytest.raises(LockLost, match="lost its lock 'freed'"):
                job()
    finally:
        lock_lost.disconnect(on_lost)
    assert [s["key"] for s in signals_seen] == ["freed"]


def test_bad_task_attribute_is_a_clear_error(server: ServerThread) -> None:
    app = inproc_app(server)

    @app.task(shared=False, base=LockedTask, lock_ttl=-5)
    def job() -> None: ...

    with pytest.raises(DflockConfigError, match="attribute lock_ttl of task"):
        job()


def test_bad_template_is_reported_when_the_task_is_bound(server: ServerThread) -> None:
    app = inproc_app(server)
    from celery_dflock.keys import KeyDerivationError

    with pytest.raises(KeyDerivationError, match="customer"):

        @app.task(shared=False, base=LockedTask, lock_key="r:{customer}")
        def job(customer_id: int) -> None: ...

        app.finalize()
        _ = app.tasks[job.name]


def test_config_change_after_reset(server: ServerThread) -> None:
    app = inproc_app(server, dflock_on_locked="raise")

    @app.task(shared=False, base=LockedTask, lock_key="reconf")
    def job() -> str:
        return "ran"

    other = holder(server, "reconf")
    try:
        with pytest.raises(LockNotAcquired):
            job()
        app.conf.dflock_on_locked = "skip"
        reset_config(app)
        with pytest.raises(LockSkipped):
            job()
    finally:
        other.release()


def test_unreachable_server_fails_the_run_with_a_clear_error() -> None:
    port = free_port()
    app = make_app("unreachable", task_always_eager=True, servers=f"127.0.0.1:{port}")
    ran: list[int] = []

    @app.task(shared=False, base=LockedTask, lock_key="nowhere")
    def job() -> None:
        ran.append(1)

    with pytest.raises(ServerUnavailable, match=f"cannot reach .*127.0.0.1:{port}"):
        job()
    assert ran == []  # never runs unlocked


def test_autoretry_for_covers_an_outage_of_the_lock_server() -> None:
    """autoretry_for=(ServerUnavailable,) retries a run whose lock server is down (Celery's
    own autoretry wraps only the body, which runs after the lock is taken); the run goes
    ahead, locked, once the server is back."""
    port = free_port()
    app = make_app("outage", task_always_eager=True, servers=f"127.0.0.1:{port}")
    attempts: list[int] = []
    fences: list[int | None] = []
    started: list[ServerThread] = []

    @app.task(
        shared=False,
        bind=True,
        base=LockedTask,
        lock_key="outage",
        autoretry_for=(ServerUnavailable,),  # as in docs/locked-tasks.md, "Lock server down"
        retry_backoff=True,
        max_retries=10,
    )
    def job(self: LockedTask) -> str:
        assert self.lock is not None
        fences.append(self.lock.fence)
        return "ran"

    def count_attempt(**_: Any) -> None:
        attempts.append(1)
        if len(attempts) == 2:  # the server comes back before the first retry
            started.append(ServerThread(Config(host="127.0.0.1", port=port)).start())

    from celery.signals import task_prerun

    task_prerun.connect(count_attempt, weak=False)
    try:
        assert job.apply().get() == "ran"
    finally:
        task_prerun.disconnect(count_attempt)
        for server in started:
            server.stop()
    assert len(attempts) == 2
    assert len(fences) == 1 and fences[0] is not None  # ran once, under a lock


def test_without_autoretry_for_an_outage_fails_an_eager_run_after_its_wait() -> None:
    """An eager run has no message to send again: it waits for the server within its
    lock_timeout (reconnecting), then fails saying so and what to do (issue 49)."""
    port = free_port()
    app = make_app("outage2", task_always_eager=True, servers=f"127.0.0.1:{port}")

    @app.task(
        shared=False, base=LockedTask, lock_key="outage", autoretry_for=(KeyError,), lock_timeout=1
    )
    def job() -> None:
        raise AssertionError("never runs unlocked")

    result = job.apply()
    assert result.state == "FAILURE"
    assert isinstance(result.result, ServerUnavailable)
    message = str(result.result)
    assert f"the lock server at 127.0.0.1:{port}" in message
    assert "no message to send again" in message
    assert "Start the lock server" in message


def test_an_eager_run_replaced_by_a_run_of_its_key_runs_the_replacement(
    server: ServerThread,
) -> None:
    """Celery runs an eager run's replacement (``self.replace``) inside it: the replacement
    met the key its predecessor still held and failed with `LockNotAcquired`."""
    app = inproc_app(server)

    @app.task(shared=False, bind=True, base=LockedTask, lock_key="page:{cid}")
    def fetch(self: LockedTask, cid: int, page: int = 0) -> int:
        if page == 0:
            return self.replace(fetch.si(cid, 1))
        return page

    assert fetch.apply((7,)).get() == 1
    assert free_now(server, "page:7")


def test_autoretry_for_lock_lost_retries_a_run_whose_loss_the_release_finds(
    server: ServerThread,
) -> None:
    """A task naming `LockLost` in ``autoretry_for`` is retried when the loss interrupts its
    body (Celery's wrapper of the body catches it); a loss found only by the release, after
    the body returned, failed the run without the retry."""
    app = inproc_app(server)

    @app.task(shared=False, bind=True, base=LockedTask, lock_key="freed", autoretry_for=(LockLost,))
    def job(self: LockedTask) -> int:
        if self.request.retries == 0:
            client = Client(servers=[server.address])
            try:
                assert client.force_release("freed", note="test") == 1
            finally:
                client.close()
        return self.request.retries

    assert job.apply().get() == 1
    assert free_now(server, "freed")


def test_an_eager_lock_retry_leaves_celerys_retries_alone(server: ServerThread) -> None:
    """As in a worker, a lock retry is no retry of Celery's: Celery re-applied an eager lock
    retry with its ``retries`` + 1, so the body saw ``request.retries == 1`` and a task with
    ``max_retries=1`` could not ``self.retry()`` once."""
    app = inproc_app(server)

    @app.task(
        shared=False,
        bind=True,
        base=LockedTask,
        lock_key="eager-lock-retry",
        lock_timeout=0,  # eagerly, each run waits its retry's countdown in the key's queue
        lock_retry_countdown=1,
        lock_retry_jitter=False,
    )
    def job(self: LockedTask) -> int:
        return self.request.retries

    other = holder(server, "eager-lock-retry")
    threading.Timer(1.5, other.release).start()  # within the second run's wait (2 s)
    assert job.apply().get() == 0


def test_a_body_retry_starts_the_lock_retry_budget_afresh(server: ServerThread) -> None:
    """A run that took its lock after lock retries, then retried by its body (``self.retry``,
    ``autoretry_for``), sent its lock retries' count on to the retry: the retry met its key
    busy with ``lock_max_retries`` spent and failed at once with `LockNotAcquired`."""
    app = inproc_app(server)
    in_body = threading.Event()
    taken = threading.Event()

    @app.task(
        shared=False,
        bind=True,
        base=LockedTask,
        lock_key="afresh",
        lock_timeout=0,  # eagerly, each run waits its retry's countdown in the key's queue
        lock_max_retries=1,
        lock_retry_countdown=1,
        lock_retry_jitter=False,
        max_retries=1,
    )
    def job(self: LockedTask) -> int:
        if self.request.retries == 0:
            in_body.set()
            time.sleep(0.5)  # the other holder joins the key's queue
            raise self.retry(countdown=0)
        return self.request.retries

    def other_holder() -> None:
        in_body.wait(10)
        lock = holder(server, "afresh")
        taken.set()
        time.sleep(2.5)  # past the retry's first wait in the key's queue
        lock.release()

    first = holder(server, "afresh")
    threading.Timer(1.5, first.release).start()  # within the first lock retry's wait (2 s)
    other = threading.Thread(target=other_holder)
    other.start()
    try:
        assert job.apply().get() == 1
    finally:
        other.join(10)
    assert taken.is_set()
