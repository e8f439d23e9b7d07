# pyright: reportAttributeAccessIssue=false, reportCallIssue=false, reportFunctionMemberAccess=false
# (Celery's @app.task is untyped: pyright takes a task for the plain function it decorates.)
"""The main test app: locked tasks that log what they did (``apps.common.record``)."""

from __future__ import annotations

import contextvars
import os
import signal
import time
from typing import Any

from celery import Task, current_task
from celery.exceptions import Ignore, Reject, SoftTimeLimitExceeded

from celery_dflock import LockedTask, LockLost
from celery_dflock.signals import lock_lost, lock_skipped

from .common import record, record_lock_lost, record_skipped, worker_app

app = worker_app("apps.tasks")
lock_skipped.connect(record_skipped)
lock_lost.connect(record_lock_lost)

TICK_S = 0.05
BLOCK_LIMIT_S = 60.0
"""Upper bound of any blocking body (a test that forgets to end it still finishes)."""


def _fence(task: Task) -> int | None:
    return task.request.dflock_fence


def _block(task: LockedTask, name: str, seconds: float = BLOCK_LIMIT_S) -> None:
    """Tick until ``seconds`` pass, recording a tick every ~0.25 s."""
    start = time.monotonic()
    next_tick = start
    while (elapsed := time.monotonic() - start) < seconds:
        if time.monotonic() >= next_tick:
            lock = task.lock
            record("tick", name=name, elapsed=elapsed, lost=bool(lock and lock.lost))
            next_tick += 0.25
        time.sleep(TICK_S)


# ----------------------------------------------------------------------- mutual exclusion


def _record_run(task: LockedTask, n: int, start: float) -> int:
    """Log one run (key, fence, start and end, Celery's and the lock's retries); returns n."""
    record(
        "run",
        n=n,
        key=task.request.dflock_key,
        fence=_fence(task),
        start=start,
        end=time.time(),
        task_id=task.request.id,
        retries=task.request.retries,
        lock_retries=getattr(task.request, "dflock_lock_retries", None) or 0,
    )
    return n


def _exclusive_body(task: LockedTask, n: int, group: int, hold: float) -> int:
    start = time.time()
    time.sleep(hold)
    return _record_run(task, n, start)


@app.task(
    bind=True,
    base=LockedTask,
    lock_key="mx:{group}",
    on_locked="retry",
    lock_timeout=0,  # retry at once (the default waits 30 s in the key's queue first)
    max_retries=None,
    lock_retry_countdown=0.05,
    lock_retry_backoff_max=0.4,
)
def exclusive_retry(self: LockedTask, n: int, group: int, hold: float = 0.01) -> int:
    return _exclusive_body(self, n, group, hold)


@app.task(bind=True, base=LockedTask, lock_key="mx:{group}", on_locked="skip")
def exclusive_skip(self: LockedTask, n: int, group: int, hold: float = 0.01) -> int:
    return _exclusive_body(self, n, group, hold)


@app.task(bind=True, base=LockedTask, lock_key="sem:{group}", lock_limit=2, on_locked="skip")
def limited(self: LockedTask, n: int, group: int, hold: float = 0.3) -> int:
    return _exclusive_body(self, n, group, hold)


def _shared_key_body(task: LockedTask, n: int, release_file: str | None) -> int:
    """Run until ``release_file`` exists (at once without one), then log the run."""
    start = time.time()
    record("started", n=n, task_id=task.request.id, key=task.request.dflock_key)
    while release_file is not None and not os.path.exists(release_file):
        if time.time() - start > BLOCK_LIMIT_S:
            break
        time.sleep(TICK_S)
    return _record_run(task, n, start)


@app.task(
    bind=True,
    base=LockedTask,
    lock_key="shared:{group}",
    on_locked="retry",
    max_retries=None,
    lock_retry_countdown=0.1,
    lock_retry_backoff_max=0.4,
)
def shared_key_retry(self: LockedTask, n: int, group: str, release_file: str | None) -> int:
    """A lock, or a semaphore with a per-call ``lock_limit``, on one key (issue 13, point 7)."""
    return _shared_key_body(self, n, release_file)


@app.task(bind=True, base=LockedTask, lock_key="shared:{group}", on_locked="raise")
def shared_key_raise(self: LockedTask, n: int, group: str, release_file: str | None) -> int:
    return _shared_key_body(self, n, release_file)


@app.task(
    bind=True,
    base=LockedTask,
    on_locked="retry",
    max_retries=None,
    lock_retry_countdown=0.1,
    lock_retry_backoff_max=0.4,
)
def keyless_retry(self: LockedTask, n: int, group: str, release_file: str | None) -> int:
    """No lock_key of its own: the task name and a digest of its arguments, or beat's
    non-overlap key for the runs beat sends."""
    return _shared_key_body(self, n, release_file)


# ----------------------------------------------------------------------- renewal


@app.task(bind=True, base=LockedTask, lock_key="renew:{name}", lock_ttl=1, on_locked="raise")
def long_runner(self: LockedTask, name: str, seconds: float) -> dict[str, Any]:
    record("started", name=name, fence=_fence(self), task_id=self.request.id)
    _block(self, name, seconds)
    lock = self.lock
    assert lock is not None
    result = {"lost": lock.lost, "fence": lock.fence}
    record("finished", name=name, **result)
    return result


# -------------------------------------------------------------- a task class's own __call__


class InContext(Task):
    """A project's task class that runs the body in a context of its own (as Flask's
    ``FlaskTask`` runs it in the app context): by ``self.run``, or by Celery's ``__call__``."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        token = CONTEXT.set("app context")
        try:
            if self.name.endswith("_super"):
                return super().__call__(*args, **kwargs)
            return self.run(*args, **kwargs)
        finally:
            CONTEXT.reset(token)


CONTEXT: contextvars.ContextVar[str | None] = contextvars.ContextVar("context", default=None)


@app.task(base=InContext)
def in_context(name: str) -> str | None:
    request = current_task.request
    record("in_context", name=name, task_id=request.id, fence=request.dflock_fence)
    return CONTEXT.get()


@app.task(base=InContext)
def in_context_super(name: str) -> str | None:
    request = current_task.request
    record("in_context", name=name, task_id=request.id, fence=request.dflock_fence)
    return CONTEXT.get()


# ----------------------------------------------------------------------- endings

ENDING_TTL = 30
"""Lease of the ending tasks: far longer than the 2 s the tests give the next acquire."""

ending = app.task(bind=True, base=LockedTask, lock_key="end:{name}", lock_ttl=ENDING_TTL)


@ending
def end_success(self: LockedTask, name: str) -> str:
    record("body", name=name, fence=_fence(self))
    return name


@ending
def end_exception(self: LockedTask, name: str) -> None:
    record("body", name=name, fence=_fence(self))
    raise ValueError(f"task {name} fails on purpose")


@ending
def end_retry(self: LockedTask, name: str) -> int:
    record(
        "body",
        name=name,
        fence=_fence(self),
        retries=self.request.retries,
        key=self.request.dflock_key,
    )
    if self.request.retries == 0:
        raise self.retry(countdown=0, max_retries=3)
    return self.request.retries


@ending
def end_ignore(self: LockedTask, name: str) -> None:
    record("body", name=name, fence=_fence(self))
    raise Ignore()


@ending
def end_reject(self: LockedTask, name: str) -> None:
    record("body", name=name, fence=_fence(self))
    raise Reject("rejected on purpose", requeue=False)


@app.task(bind=True, base=LockedTask, lock_key="end:{name}", lock_ttl=ENDING_TTL, soft_time_limit=1)
def end_soft_limit(self: LockedTask, name: str) -> None:
    record("body", name=name, fence=_fence(self))
    try:
        _block(self, name)
    except SoftTimeLimitExceeded:
        record("soft_limit", name=name)
        raise


@app.task(bind=True, base=LockedTask, lock_key="end:{name}", lock_ttl=ENDING_TTL, time_limit=1)
def end_hard_limit(self: LockedTask, name: str) -> None:
    record("body", name=name, fence=_fence(self))
    _block(self, name)


@app.task(bind=True, base=LockedTask, lock_key="end:{name}", lock_ttl=ENDING_TTL, time_limit=1)
def end_hard_limit_killed(self: LockedTask, name: str) -> None:
    """Ignores SIGTERM, so that its hard time limit ends it with SIGKILL (billiard sends TERM,
    then KILL 0.1 s later), as it ends a body stuck in C code or one that traps SIGTERM."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    record("body", name=name, fence=_fence(self))
    _block(self, name)


@ending
def end_block(self: LockedTask, name: str, seconds: float = BLOCK_LIMIT_S) -> str:
    """Blocks (revoke, SIGKILL and shutdown tests end it from outside)."""
    record("body", name=name, fence=_fence(self))
    _block(self, name, seconds)
    record("body_done", name=name)
    return name


@app.task(
    bind=True,
    base=LockedTask,
    lock_key="end:{name}",
    lock_ttl=ENDING_TTL,
    acks_late=True,
    reject_on_worker_lost=True,
)
def end_block_requeued(self: LockedTask, name: str, seconds: float) -> str:
    """`end_block` whose message Celery requeues when its pool child is lost."""
    record("body", name=name, fence=_fence(self))
    _block(self, name, seconds)
    return name


@app.task(bind=True, base=LockedTask, lock_key="slow:{name}", lock_ttl=60)
def slow_body(self: LockedTask, name: str, seconds: float) -> str:
    """A body of ``seconds`` under a 60 s lease (a release that waited for the lease would
    hold its pool slot that long)."""
    record("body", name=name, fence=_fence(self))
    time.sleep(seconds)
    record("body_done", name=name)
    return name


# ----------------------------------------------------------------------- lost locks


def _until_lost(task: LockedTask, name: str, *, looks: bool) -> dict[str, Any]:
    """Tick until the lock is lost: a body that ``looks`` at ``lock.lost`` (the "flag"
    policy's) returns when it sees it; one that does not is stopped only by its policy.

    A body under "interrupt" or "terminate" must not look: the lock is marked lost a moment
    before the policy acts, and a body that returned in that moment ends with the
    guard's LockLost instead of the interrupt (or the kill) the tests are about.
    """
    # The test stops the lock server as soon as it reads "started", so the interrupt can land
    # a moment later, before the loop: the try covers the body from its first line (the
    # interrupt is raised asynchronously, at any bytecode).
    try:
        record("started", name=name, fence=_fence(task), task_id=task.request.id)
        lock = task.lock
        assert lock is not None
        deadline = time.monotonic() + BLOCK_LIMIT_S
        while time.monotonic() < deadline and not (looks and lock.lost):
            time.sleep(TICK_S)
    except LockLost as exc:
        record("interrupted", name=name, error=type(exc).__name__, message=str(exc))
        raise
    record("flagged", name=name, lost=lock.lost, event_set=lock.lost_event.is_set())
    return {"lost": lock.lost}


lossy = {"bind": True, "base": LockedTask, "lock_key": "lost:{name}", "lock_ttl": 2}


@app.task(**lossy, on_lock_lost="interrupt")
def lost_interrupt(self: LockedTask, name: str) -> dict[str, Any]:
    return _until_lost(self, name, looks=False)


@app.task(**lossy, on_lock_lost="flag")
def lost_flag(self: LockedTask, name: str) -> dict[str, Any]:
    return _until_lost(self, name, looks=True)


@app.task(bind=True, base=LockedTask, lock_key="lost:{name}", on_lock_lost="flag")
def lost_flag_kept(self: LockedTask, name: str) -> dict[str, Any]:
    """``lost_flag`` on the server's default lease, which its session's keep-alives keep: the
    lock sends no renewal of its own."""
    return _until_lost(self, name, looks=True)


@app.task(**lossy, on_lock_lost="terminate")
def lost_terminate(self: LockedTask, name: str) -> dict[str, Any]:
    return _until_lost(self, name, looks=False)


def _blind(task: LockedTask, name: str) -> str:
    """Tick for 20 s without ever looking at the lock (the issue's body): only the policy can
    stop it."""
    record("started", name=name, fence=_fence(task), task_id=task.request.id)
    _block(task, name, 20.0)
    record("finished", name=name)
    return "ran to the end"


@app.task(**lossy, on_lock_lost="interrupt")
def blind_interrupt(self: LockedTask, name: str) -> str:
    return _blind(self, name)


@app.task(**lossy, on_lock_lost="terminate")
def blind_terminate(self: LockedTask, name: str) -> str:
    return _blind(self, name)


# ----------------------------------------------------------------------- busy keys


@app.task(bind=True, base=LockedTask, lock_key="busy:{group}")
def busy_default(self: LockedTask, n: int, group: int, hold: float = 0.5) -> int:
    """Every lock option left at its default."""
    return _exclusive_body(self, n, group, hold)


budget = {
    "bind": True,
    "base": LockedTask,
    "lock_key": "budget:{group}",
    "max_retries": 0,  # Celery's own budget: lock retries must not use it
    "lock_timeout": 0,  # retry at once (these test the retries, not the wait before them)
    "lock_retry_countdown": 0.1,
    "lock_retry_backoff_max": 0.2,
    "lock_retry_jitter": False,
}


@app.task(**budget, lock_max_retries=2)
def busy_budget(self: LockedTask, n: int, group: int, hold: float = 0.0) -> int:
    return _exclusive_body(self, n, group, hold)


@app.task(**budget)
def busy_patient(self: LockedTask, n: int, group: int, hold: float = 0.0) -> int:
    return _exclusive_body(self, n, group, hold)


@app.task
def collect(results: list[Any]) -> list[Any]:
    record("collected", results=results)
    return results


WAITER_SOFT_LIMIT_S = 2
"""The waiters' soft time limit: their wait may take half of it, and the rest of the run (a
lock retry's countdown, its acquire, the body) must fit the other half on a loaded machine,
which 0.5 s did not."""


@app.task(
    bind=True,
    base=LockedTask,
    lock_key="end:{name}",
    lock_ttl=ENDING_TTL,
    soft_time_limit=WAITER_SOFT_LIMIT_S,
    lock_retry_countdown=0.1,
    lock_retry_backoff_max=0.2,
)
def end_soft_limited_waiter(self: LockedTask, name: str) -> str:
    """A run with a 2 s soft time limit whose key may be busy for longer (its FIFO wait,
    30 s by default, must not use its time limit up)."""
    return _waited(self, name)


def _waited(task: LockedTask, name: str) -> str:
    """A waiter's body: records its fence and how many lock retries its run took."""
    lock_retries = getattr(task.request, "dflock_lock_retries", None) or 0
    record("body", name=name, fence=_fence(task), lock_retries=lock_retries)
    return name


@app.task(
    bind=True,
    base=LockedTask,
    lock_key="end:{name}",
    lock_ttl=ENDING_TTL,
    lock_retry_countdown=0.1,
    lock_retry_backoff_max=0.2,
)
def end_waiter(self: LockedTask, name: str) -> str:
    """``end_soft_limited_waiter`` without a time limit of its own (the worker's applies)."""
    return _waited(self, name)


@app.task(
    bind=True, base=LockedTask, lock_key="end:{name}", lock_ttl=ENDING_TTL, lock_from="publish"
)
def end_replaced(self: LockedTask, name: str, step: int = 0) -> int:
    """Replaces itself once (``Task.replace``) by a run of the same key."""
    record("body", name=name, step=step, fence=_fence(self))
    if step == 0:
        raise self.replace(end_replaced.si(name, 1))
    return step


@ending
def end_retry_goes_on(self: LockedTask, name: str) -> int:
    """Sends its retry with ``throw=False`` and goes on for 1 s (Celery's custom retry)."""
    start = time.time()
    if self.request.retries == 0:
        self.retry(countdown=0, max_retries=1, throw=False)
        time.sleep(1.0)
    record("body", name=name, start=start, end=time.time(), retries=self.request.retries)
    return self.request.retries
