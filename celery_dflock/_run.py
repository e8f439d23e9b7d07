# pyright: reportMissingTypeStubs=false
"""The machinery of one locked run, beside `LockedTask` as Celery's ``app/trace.py`` is beside
its ``Task``: the run's plan and key, the acquire (or the take-over of its publish-time hold),
the body under the lost-lock guard, the held-lock record, and the release.

The parts it calls, one concern each: `celery_dflock._plan` (the task's options, resolved
once per task), `celery_dflock._queue_once` (the publish-time hold and its hand-off),
`celery_dflock._on_locked` (the busy-key policy), `celery_dflock._outage` (an unreachable
lock server: a busy key, not a failure), `celery_dflock._follower` (a canvas member
sent in a duplicate's place), `celery_dflock._guard` (``on_lock_lost``) and
`celery_dflock._request` (what the run reads from and writes on Celery's request).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any, cast

from celery_dflock._celery import backoff_interval, get_task_logger
from celery_dflock._follower import run_follower
from celery_dflock._guard import RunGuard
from celery_dflock._held_records import AnyLock
from celery_dflock._holds import FOLLOW_HEADER, HOLD_HEADER, encode_note, follow_of, hold_of
from celery_dflock._on_locked import contended, retry_countdown
from celery_dflock._outage import OutageWait, outage_of, retry_outage
from celery_dflock._plan import LockOptions, options_for
from celery_dflock._queue_once import eager_duplicate, take_over
from celery_dflock._request import call_options, clear_held, header, lock_retries, mark_held
from celery_dflock._runtime import get_runtime
from celery_dflock.client.errors import (
    DflockError,
    LimitMismatchError,
    LockLost,
    ServerUnavailable,
)
from celery_dflock.config import get_config

__all__ = ["locked_run"]

logger: Any = get_task_logger("celery_dflock.task")
"""For messages logged while the task runs (Celery prefixes them with ``name[id]``)."""


def _run_note(task_id: str | None, request: Any, name: str) -> str | None:
    """The owner note of a running task: its id, the worker's name (or this host's), this
    process's pid and the task's name."""
    host = getattr(request, "hostname", None)
    return encode_note(
        task_id,
        host if isinstance(host, str) and host else socket.gethostname(),
        pid=os.getpid(),
        name=name,
    )


def locked_run(task: Any, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``task``'s body for ``request`` under its lock (or straight, when not locked).

    A request sent under a publish-time hold (`HOLD_HEADER`) takes the hold over: the run
    holds the very grant the publish took (renewed, guarded and released as any run's lock).
    When the hold is gone (its ``lock_pending_ttl`` ran out), the run takes the key as a
    run-time lock and ``on_locked`` applies."""
    app: Any = task._get_app()
    follow = follow_of(header(request, FOLLOW_HEADER))
    if follow is not None:
        return run_follower(task, request, follow, (args, kwargs))
    config = get_config(app)
    runtime = get_runtime(app)
    run: Callable[..., Any] = task.run
    runs = runtime.task_runs(str(task.name))
    options = options_for(task, config, runs, call_options(request))
    if options is None:
        return run(*args, **kwargs)
    key = runs.key_builder(task, options.key, run, config.key_prefix).key(args, kwargs)
    task_id = cast("str | None", request.id)
    guard = RunGuard(task, task_id, key, options.on_lock_lost, runtime)
    wait_started = time.monotonic()
    wait_s = options.timeout
    eager_once = bool(request.is_eager) and options.lock_from == "publish"
    if (request.called_directly or eager_once) and not options.timeout_given:
        # The default wait of "retry" stands in for a retry's countdown in a worker; a direct
        # call (a web request, a script) has no message to retry, and an eager queue-once run
        # of a key a queued message holds fails at once (AlreadyQueued): both give up at once.
        wait_s = 0.0
    if options.on_locked == "retry" and request.is_eager and not eager_once:
        # Eager retries run at once; wait out the countdown in the queue instead.
        wait_s = max(wait_s, retry_countdown(lock_retries(request), options))
    note = _run_note(task_id, request, str(task.name))
    lock = runtime.new_lock(
        config, key, options, acquire_timeout_s=wait_s, on_lost=guard.on_lost, note=note
    )
    held = hold_of(header(request, HOLD_HEADER))
    on_close_lease = options.pending_ttl if _acks_late(task, request) else None
    outage: OutageWait | None = None
    while True:
        try:
            took_over = take_over(
                runtime,
                config,
                lock,
                held,
                note=note,
                label=guard.label,
                on_close_lease=on_close_lease,
                task_id=task_id,
            )
            acquired = took_over or lock.acquire()
        except LimitMismatchError as exc:  # the key is busy with another lock_limit
            return contended(
                task,
                request,
                key,
                options,
                (args, kwargs),
                waited_s=time.monotonic() - wait_started,
                mismatch=exc,
            )
        except ServerUnavailable as exc:  # down, restarting, draining: a busy key (_outage)
            _autoretry(task, request, exc)  # the task's own autoretry_for names it: Celery's
            if outage is None:
                outage = OutageWait(deadline=wait_started + wait_s, started=wait_started)
            address = "{}:{}".format(*lock.server)
            pause = outage.next_pause(exc, address)
            if pause is None:
                raise retry_outage(
                    task, request, key, options, (args, kwargs), wait=outage, exc=exc
                ) from exc
            time.sleep(pause)
            lock = runtime.new_lock(
                config,
                key,
                options,
                acquire_timeout_s=outage.left(),
                on_lost=guard.on_lost,
                note=note,
            )
            continue
        except DflockError as exc:  # the server refusing, a bad setting, ...
            _autoretry(task, request, exc)
            raise
        break
    if outage is not None or outage_of(request) is not None:
        logger.info(
            "dflock: %s: the lock server at %s:%s answers again",
            guard.label,
            *lock.server,
        )
    if not acquired:
        if eager_once:
            raise eager_duplicate(guard.label, key, lock)
        return contended(
            task,
            request,
            key,
            options,
            (args, kwargs),
            waited_s=time.monotonic() - wait_started,
            lock=lock,
        )
    # A hold taken over for an acks_late message outlives this process on purpose: when the
    # process dies, the message comes back and its next run takes the same hold over. It is
    # not recorded, so a dead child's clean-up does not release it.
    record = not (took_over and on_close_lease is not None)
    return _run_held(
        guard, lock, request, options=options, run=run, call=(args, kwargs), record=record
    )


def _acks_late(task: Any, request: Any) -> bool:
    """Whether this run's message is acknowledged after the run (per call, or the task's)."""
    per_message = getattr(request, "acks_late", None)
    return bool(per_message if per_message is not None else getattr(task, "acks_late", False))


def _run_held(
    guard: RunGuard,
    lock: AnyLock,
    request: Any,
    *,
    options: LockOptions,
    run: Callable[..., Any],
    call: tuple[tuple[Any, ...], dict[str, Any]],
    record: bool = True,
) -> Any:
    """The body, with ``lock`` held: recorded on the request (and, when ``record``, in the
    held-lock records of a pool child), guarded against a loss, and released however the body
    ends."""
    key, task_id, runtime = guard.key, guard.task_id, guard.runtime
    guard.lock = lock
    mark_held(request, key, lock, options)
    if record and runtime.in_pool_child and task_id:
        writer = runtime.held_writer()
        if writer is not None:
            guard.record = writer.add(task_id, lock, options.limit)
    try:
        result = guard.run_body(run, call, lock)
        # The lock may be marked lost a moment before on_lost runs: the body can see it and
        # return first. Only "flag" lets a body that saw its lock lost end normally.
        if guard.interrupt_due or (lock.lost and options.on_lock_lost != "flag"):
            raise LockLost(
                f"{guard.label} lost its lock {key!r} (fence {lock.fence}) "
                f"while it ran; its body returned before the interrupt reached it, so the "
                f"run fails (on_lock_lost={options.on_lock_lost!r})"
            )
        return result
    finally:
        try:
            lock.release()
        finally:
            if guard.record is not None:
                guard.record.remove()
            clear_held(request)


def _autoretry(task: Any, request: Any, exc: DflockError) -> None:
    """Give an error taking the lock the task's ``autoretry_for`` treatment.

    Celery's ``autoretry_for`` wraps the task body only, and the lock is taken before the
    body: without this, ``autoretry_for=(ServerUnavailable,)`` would not cover an outage
    of the lock server. Retries (``self.retry``, so ``retry_kwargs``, ``retry_backoff``,
    ``retry_backoff_max``, ``retry_jitter`` and ``max_retries`` apply as Celery applies
    them) when the task names the error; returns otherwise, and the caller re-raises.
    """
    autoretry_for = tuple(getattr(task, "autoretry_for", None) or ())
    if not autoretry_for or not isinstance(exc, autoretry_for):
        return
    dont_autoretry_for = tuple(getattr(task, "dont_autoretry_for", None) or ())
    if dont_autoretry_for and isinstance(exc, dont_autoretry_for):
        return
    retry_kwargs = dict(getattr(task, "retry_kwargs", None) or {})
    backoff = float(getattr(task, "retry_backoff", False) or 0)
    if backoff:
        retry_kwargs["countdown"] = backoff_interval(
            factor=int(max(1.0, backoff)),
            retries=int(request.retries or 0),
            maximum=int(getattr(task, "retry_backoff_max", 600)),
            full_jitter=getattr(task, "retry_jitter", True),
        )
    raise task.retry(exc=exc, **retry_kwargs)
