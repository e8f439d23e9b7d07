# pyright: reportMissingTypeStubs=false
"""One locked run, beside `LockedTask` as Celery's ``app/trace.py`` is beside its ``Task``.

`locked_run` is the whole path of a run: the message read (`Message`), the task's plan and
key, the acquire (or the take-over of its publish-time hold), the body under the lost-lock
guard, and the release. Its policies (what each option does: [Locked tasks](../locked-tasks.md)):

* busy key (`contended`, `retry_countdown`): ``on_locked`` once the ``lock_timeout`` wait is
  over, lock retries counted apart from Celery's; a key in use with another ``lock_limit`` is busy;
* lost lock (`RunGuard`): ``on_lock_lost``, the ``lock_lost`` signal and the log line;
* the interrupt (`current_body`): `LockLost` raised in the running body from another thread
  or greenlet, on each pool.

Its other parts: `celery_dflock._runtime` (the task's plan, the process's client),
`celery_dflock._queue_once` (the publish-time hold), `celery_dflock._outage` (an unreachable
lock server) and `celery_dflock._request` (Celery's request and message).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any, Final, cast

from celery_dflock._celery import (
    Reject,
    Signal,
    backoff_interval,
    task_logger as logger,
    task_stack,
    worker_logger,
)
from celery_dflock._outage import OutageWait, outage_of, retry_outage
from celery_dflock._queue_once import eager_duplicate, hand_off_hold, run_follower, take_over
from celery_dflock._request import (
    FOLLOW_HEADER,
    HOLD_HEADER,
    OUTAGE_HEADER,
    Call,
    Message,
    backoff,
    decode_note,
    encode_note,
    follow_of,
    header,
    held_lock,
    hold_of,
    mark_held,
    resend,
)
from celery_dflock._runtime import AnyLock, Runtime, get_runtime, options_for
from celery_dflock._settings import OnLockLost
from celery_dflock.client import Client, DistributedLock, errors
from celery_dflock.config import LockOptions, get_config

lock_lost: Final[Any] = Signal(name="lock_lost")
"""A running task's lock was lost (renewal refused, or its server unreachable)."""
lock_skipped: Final[Any] = Signal(name="lock_skipped")
"""A task run was skipped because its lock was busy (``on_locked="skip"``)."""


def locked_run(
    task: Any,
    request: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    body: Callable[..., Any] | None = None,
) -> Any:
    """Run ``task``'s body (``body``, or its ``run``) for ``request`` under its lock (or
    straight, when not locked). A request sent under a publish-time hold (`HOLD_HEADER`) takes
    the hold's grant over; when the hold is gone, the run takes the key as a run-time lock."""
    message = Message.read(task, request, (args, kwargs))
    if (follow := follow_of(header(request, FOLLOW_HEADER))) is not None:
        return run_follower(message, follow)
    app: Any = task._get_app()
    config, runtime = get_config(app), get_runtime(app)
    run: Callable[..., Any] = task.run
    runs = runtime.task_runs(str(task.name))
    options = options_for(task, config, runs, message.options, message.beat)
    if options is None:
        return (body or run)(*args, **kwargs)
    key = runs.key_builder(task, options.key, run, config.key_prefix).key(args, kwargs)
    # Called directly, or applied inside another run (a worker's run is neither): a Celery
    # whose apply names the root names the parent too; an older one (no root), the stack.
    nested = request.called_directly or (
        request.is_eager
        and (request.parent_id is not None or (request.root_id is None and len(task_stack) > 1))
    )
    if nested and options.on_locked == "retry" and options.limit in (None, 1) and _held_above(key):
        raise errors.LockNotAcquired(
            f"{message.label}: lock {key!r} is held by the run that called it (directly or "
            "eagerly), which waits for it: it would wait for itself; give it another lock_key"
        )
    guard = RunGuard(message, key, options.on_lock_lost, runtime)
    started = time.monotonic()
    wait_s = options.timeout
    eager_once = bool(request.is_eager) and options.lock_from == "publish"
    if (request.called_directly or eager_once) and not options.timeout_given:
        # A direct call has no message to retry, and an eager queue-once run of a held key
        # fails (AlreadyQueued): neither waits.
        wait_s = 0.0
    if options.on_locked == "retry" and request.is_eager and not eager_once:
        # Eager retries run at once; wait out the countdown in the queue instead.
        wait_s = max(wait_s, retry_countdown(message.retries, options))
    in_worker = not (request.is_eager or request.called_directly)
    if wait_s and in_worker and (limit_s := _time_limit(task, request, runtime)) is not None:
        # The wait counts against the run's time limit: it ends in time for on_locked to
        # apply, leaving the body half the limit (else a busy key fails the run).
        wait_s = min(wait_s, limit_s / 2)
    client = runtime.client(config)
    host = getattr(request, "hostname", None)  # the owner note: id, worker, pid, task name
    host = host if isinstance(host, str) and host else socket.gethostname()
    note = encode_note(message.task_id, host, pid=os.getpid(), name=str(task.name))
    held = hold_of(header(request, HOLD_HEADER))
    per_message = getattr(request, "acks_late", None)
    acks_late = per_message if per_message is not None else getattr(task, "acks_late", False)
    on_close_lease = options.pending_ttl if acks_late else None
    outage: OutageWait | None = None
    left_s = wait_s
    while True:
        lock = new_lock(client, key, options, left_s, on_lost=guard.on_lost, note=note)
        try:
            took_over = take_over(
                client,
                lock,
                held,
                note=note,
                label=guard.label,
                on_close_lease=on_close_lease,
                task_id=message.task_id,
            )
            acquired = took_over or lock.acquire()
            break
        except errors.LimitMismatchError as exc:  # the key is busy with another lock_limit
            return contended(message, key, options, time.monotonic() - started, mismatch=exc)
        except errors.ServerUnavailable as exc:  # down, restarting, draining: a busy key (_outage)
            _autoretry(message, exc)  # the task's own autoretry_for names it: Celery's
            # In a worker, a short reconnect at most: its slot goes back.
            outage = outage or OutageWait.for_run(request, started, wait_s)
            if (pause := outage.next_pause(exc, "{}:{}".format(*lock.server))) is None:
                raise retry_outage(message, key, options, outage, exc) from exc
            time.sleep(pause)  # once the server answers, the rest of its lock_timeout to wait
            left_s = max(0.0, started + wait_s - time.monotonic())
        except errors.DflockError as exc:  # the server refusing, a bad setting, ...
            _autoretry(message, exc)
            raise
    if outage is not None or outage_of(request) is not None:
        logger.info("dflock: %s: the lock server at %s:%s answers again", guard.label, *lock.server)
    if not acquired:
        if eager_once:
            raise eager_duplicate(guard.label, key, lock)
        return contended(message, key, options, time.monotonic() - started, lock=lock)
    # A hold taken over for an acks_late message is not recorded, so a dead child's clean-up
    # does not release it: the redelivered message's run takes it over again.
    record = not (took_over and on_close_lease is not None)
    mark_held(request, key, lock, options)
    if record and runtime.in_pool_child and message.task_id and (writer := runtime.held_writer()):
        guard.unrecord = writer.add(message.task_id, lock, options.limit)
    fence = lock.fence
    try:
        result = guard.run_body(body or run, message.call, lock)
    except Reject as exc:
        # acks_late, so the message is not acknowledged yet: a requeued one keeps its hold (a
        # hold taken over is a lock's), and the release below does nothing.
        if took_over and on_close_lease is not None and exc.requeue and held is not None:
            hand_off_hold(task, request, cast("DistributedLock", lock), held, options)
        raise
    finally:
        try:
            lock.release()
        finally:
            if guard.unrecord is not None:
                guard.unrecord()
            mark_held(request, None, None, None)
    # The body may return before the loss reaches it (the release may be what finds it):
    # only "flag" lets such a run succeed.
    if guard.interrupt_due or (lock.lost and options.on_lock_lost != "flag"):
        lost = errors.LockLost(
            f"{guard.label} lost its lock {key!r} (fence {fence}) while it ran; its body "
            f"returned before the loss could interrupt it, so the run fails "
            f"(on_lock_lost={options.on_lock_lost!r})"
        )
        _autoretry(message, lost)  # as an interrupt in the body is, by Celery's wrapper
        raise lost
    return result


def _time_limit(task: Any, request: Any, runtime: Runtime) -> float | None:
    """The run's shortest time limit, soft or hard, as the worker works it out (the message's,
    else the task's, else the worker's: its command line's or the app's); None: none."""
    hard, soft = getattr(request, "timelimit", None) or (None, None)
    conf: Any = task._get_app().conf
    worker_hard, worker_soft = runtime.worker_time_limits
    limits = (
        hard or task.time_limit or worker_hard or conf.task_time_limit,
        soft or task.soft_time_limit or worker_soft or conf.task_soft_time_limit,
    )
    return min((float(limit) for limit in limits if limit), default=None)


def _held_above(key: str) -> bool:
    """A run further up this thread's task stack holds ``key``."""
    return any(
        (lock := held_lock(request)) is not None and lock.key == key and lock.locked()
        for task in task_stack.stack
        for request in task.request_stack.stack
    )


def new_lock(
    client: Client,
    key: str,
    options: LockOptions,
    wait_s: float,
    *,
    on_lost: Callable[[Any], None],
    note: str | None,
) -> AnyLock:
    """An unacquired lock (or semaphore, with ``lock_limit``) on ``key``; a lock carries the
    owner ``note``. ``options.ttl`` is a `Lease`, already checked."""
    if options.limit is not None:
        return client.semaphore(
            key, options.limit, acquire_timeout_s=wait_s, lease_ttl_s=options.ttl, on_lost=on_lost
        )
    return client.lock(
        key, acquire_timeout_s=wait_s, lease_ttl_s=options.ttl, on_lost=on_lost, note=note
    )


def _autoretry(message: Message, exc: errors.DflockError) -> None:
    """Give an error taking the lock the task's ``autoretry_for`` treatment (Celery's wraps
    only the body): ``self.retry`` with Celery's ``retry_*`` options, and the ``max_retries``
    an earlier ``self.retry(max_retries=...)`` left on the task (``override_max_retries``),
    when the task names the error; returns otherwise, and the caller re-raises."""
    task = message.task
    autoretry_for = tuple(getattr(task, "autoretry_for", None) or ())
    if not autoretry_for or not isinstance(exc, autoretry_for):
        return
    dont_autoretry_for = tuple(getattr(task, "dont_autoretry_for", None) or ())
    if dont_autoretry_for and isinstance(exc, dont_autoretry_for):
        return
    retry_kwargs = dict(getattr(task, "retry_kwargs", None) or {})
    if backoff := float(getattr(task, "retry_backoff", False) or 0):
        retry_kwargs["countdown"] = backoff_interval(
            factor=int(max(1.0, backoff)),
            retries=int(message.request.retries or 0),
            maximum=int(getattr(task, "retry_backoff_max", 600)),
            full_jitter=getattr(task, "retry_jitter", True),
        )
    if hasattr(task, "override_max_retries"):  # as celery/app/autoretry.py does
        retry_kwargs["max_retries"] = task.override_max_retries
    retried = task.retry(exc=exc, **retry_kwargs)
    if hasattr(task, "override_max_retries"):  # reached only with throw=False, as Celery's
        delattr(task, "override_max_retries")
    raise retried


def retry_countdown(retries: int, options: LockOptions) -> float:
    """The countdown of lock retry number ``retries + 1`` (backoff, cap, jitter)."""
    return backoff(
        options.retry_countdown, retries, options.retry_backoff_max, jitter=options.retry_jitter
    )


def contended(
    message: Message,
    key: str,
    options: LockOptions,
    waited_s: float,
    *,
    mismatch: errors.LimitMismatchError | None = None,
    lock: AnyLock | None = None,
) -> Any:
    """The key is busy: held by other runs, or (``mismatch``) in use with another limit (the
    server refuses at once: a lock is a semaphore of limit 1); ``on_locked`` applies."""
    run = message.label
    holder = decode_note(lock.holder)[0] if isinstance(lock, DistributedLock) else None
    if mismatch is None:  # not busy: a cluster hand-over outlasted lock_timeout, or a grace
        said = lock.handover or lock.grace if lock is not None else None
        why = said or f"lock {key!r} is held by {f'task {holder}' if holder else 'another run'}"
    else:
        mine = "a lock" if options.limit is None else f"a semaphore of limit {options.limit}"
        why = (
            f"key {key!r} is in use by runs with another lock_limit (this run asked for "
            f"{mine}); a lock and a semaphore on one key exclude each other: give every use "
            f"of the key the same lock_limit, or give the lock another lock_key"
        )
    level = logging.INFO if mismatch is None else logging.WARNING  # a clash is a mistake
    if options.on_locked == "skip":
        logger.log(level, "dflock: skipping %s: %s", run, why)
        lock_skipped.send(
            sender=message.task,
            task_id=message.task_id,
            key=key,
            args=message.call[0],
            kwargs=message.call[1],
            holder=holder,
        )
        raise errors.LockSkipped(
            f"{run} was skipped: {why} (waited {waited_s:.1f}s; on_locked='skip')"
        ) from mismatch
    busy = errors.LockNotAcquired(
        f"{run}: {why} (waited {waited_s:.1f}s; on_locked={options.on_locked!r})"
    )
    busy.__cause__ = mismatch
    if options.on_locked != "retry" or message.request.called_directly:
        raise busy
    done = message.retries
    limit = options.max_retries
    if limit is not None and done >= limit:
        raise errors.LockNotAcquired(
            f"{run}: {why}, still so after {done} lock "
            f"retries (lock_max_retries={limit}), so the run is dropped; raise "
            f"lock_max_retries (None: retry as long as the key is busy) or lock_timeout "
            f"(wait in the key's queue)"
        )
    countdown = retry_countdown(done, options)
    logger.log(
        level,
        "dflock: %s retries in %.2fs: %s (lock retry %d of %s)",
        run,
        countdown,
        why,
        done + 1,
        "no limit" if limit is None else limit,
    )
    # Busy, so reached: an earlier outage is over (its budget starts afresh).
    extra = {OUTAGE_HEADER: None}
    raise resend(message, countdown=countdown, retries=done + 1, busy=busy, extra=extra)


class _Interrupted(errors.LockLost):
    """Raised asynchronously in the body's thread by ``on_lock_lost="interrupt"``."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(args or ("the task's lock was lost while it ran",)))


class RunGuard:
    """One locked run: its lock, the body's thread, and the ``on_lock_lost`` policy."""

    def __init__(self, message: Message, key: str, policy: OnLockLost, runtime: Runtime) -> None:
        self.task = message.task
        self.label = message.label
        self.task_id = message.task_id
        self.key = key
        self.policy: OnLockLost = policy
        self.runtime = runtime
        self.unrecord: Callable[[], None] | None = None
        self._state = threading.Lock()
        self._body: BodyTarget | None = None
        self.interrupt_due = False
        """An interrupt was sent (or could not be, or is due before the body starts): a body
        that returned is no success."""
        self._interrupt_missed = False
        self._body_ended = False

    def on_lost(self, lock: Any) -> None:
        """Called once when the lock is lost (by the renewal thread, or the release). An
        interrupt goes out before the log line and the signal; a termination comes last."""
        policy = self.policy
        if policy == "terminate" and not self.runtime.in_pool_child:
            policy = "interrupt"  # only a prefork child can be replaced
        with self._state:
            ended, body = self._body_ended, self._body  # (no body once it ended)
            if policy == "interrupt" and not ended and not self.interrupt_due:
                self.interrupt_due = True  # before the body starts: run_body does not start it
                if body is not None:
                    self._interrupt_missed = not body.interrupt(_Interrupted)
        worker_logger.error(
            "dflock: %s lost its lock %r (fence %s)%s; on_lock_lost=%r",
            self.label,
            self.key,
            getattr(lock, "fence", None),
            " (noticed after its body ended)" if ended else "",
            policy,
        )
        lock_lost.send(
            sender=self.task, task_id=self.task_id, key=self.key, lock=lock, policy=policy
        )
        if self._interrupt_missed:
            worker_logger.error(
                "dflock: %s: the body could not be interrupted where it runs; "
                "it fails with LockLost when it returns",
                self.label,
            )
        if policy == "terminate" and not ended:
            if self.unrecord is not None:
                self.unrecord()
            os.kill(os.getpid(), signal.SIGKILL)

    def run_body(self, run: Callable[..., Any], call: Call, lock: AnyLock) -> Any:
        """``run(*args, **kwargs)`` in this thread, as the target of an interrupt."""
        body = current_body()
        with self._state:
            if self.interrupt_due:
                raise errors.LockLost(
                    f"{self.label} lost its lock {self.key!r} (fence {lock.fence}) between "
                    f"its grant and its body, so the body was not started "
                    f"(on_lock_lost={self.policy!r})"
                )
            self._body = body
        try:
            try:
                return run(*call[0], **call[1])
            finally:
                with self._state:
                    self._body, self._body_ended = None, True
                    if self.interrupt_due:
                        body.cancel()  # not delivered yet: drop it
        except _Interrupted:
            raise errors.LockLost(
                f"{self.label} lost its lock {self.key!r} (fence {lock.fence}) "
                f"while it ran, and was interrupted (on_lock_lost='interrupt')"
            ) from None


def _set_async_exc(thread_id: int, exc: type[BaseException] | None) -> int:
    """Schedule ``exc`` in thread ``thread_id`` (None clears one); the threads changed."""
    set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
    set_async_exc.argtypes = (ctypes.c_ulong, ctypes.py_object)
    set_async_exc.restype = ctypes.c_int
    return cast("int", set_async_exc(thread_id, ctypes.py_object() if exc is None else exc))


class _ThreadBody:
    """A body running in an OS thread (prefork, threads, solo). ``interrupt`` schedules an
    exception in it (False: it cannot be delivered); ``cancel``, as the body ends, drops one not
    delivered yet (the caller raises `LockLost` then)."""

    def __init__(self, thread_id: int) -> None:
        self._thread_id = thread_id
        self._sent = False

    def interrupt(self, exc: type[BaseException]) -> bool:
        self._sent = _set_async_exc(self._thread_id, exc) == 1
        return self._sent

    def cancel(self) -> None:
        if self._sent:
            _set_async_exc(self._thread_id, None)


class _GreenBody:
    """A body running in a greenlet of gevent's or eventlet's hub (in this OS thread; a thread
    id is a greenlet's there): the exception is thrown into it from the hub, and raised where
    the body yields."""

    def __init__(self, greenlet: Any, schedule: Callable[[Callable[[], None]], object]) -> None:
        self._greenlet = greenlet
        self._schedule = schedule
        self._running = True
        self._exc: type[BaseException] | None = None

    def interrupt(self, exc: type[BaseException]) -> bool:
        self._exc = exc
        self._schedule(self._deliver)
        return True

    def _deliver(self) -> None:
        # Runs in the hub, so the body is switched out: it is running or it ended, no between.
        if (exc := self._exc) is not None and self._running and not self._greenlet.dead:
            self._greenlet.throw(exc)

    def cancel(self) -> None:
        self._running = False


BodyTarget = _ThreadBody | _GreenBody  # where a running body can be interrupted


def current_body() -> BodyTarget:
    """The thread or greenlet the caller runs in, as an interrupt target."""
    monkey: Any = sys.modules.get("gevent.monkey")
    if monkey is not None and monkey.is_module_patched("threading"):
        gevent: Any = sys.modules["gevent"]
        loop: Any = gevent.get_hub().loop
        return _GreenBody(gevent.getcurrent(), loop.run_callback_threadsafe)
    patcher: Any = sys.modules.get("eventlet.patcher")
    if patcher is not None and patcher.is_monkey_patched("thread"):
        greenthread: Any = sys.modules["eventlet.greenthread"]
        hub: Any = sys.modules["eventlet.hubs"].get_hub()
        return _GreenBody(greenthread.getcurrent(), partial(hub.schedule_call_global, 0))
    return _ThreadBody(threading.get_ident())
