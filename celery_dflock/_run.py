# pyright: reportMissingTypeStubs=false
"""The machinery of one locked run, beside `LockedTask` as Celery's ``app/trace.py`` is beside
its ``Task``: the run's plan (locked or not, its options), its key, the acquire, the
``on_locked`` policy when the key is busy, the guard that applies ``on_lock_lost`` to the body,
the held-lock record, and the release.

The task keeps its options and Celery's hooks; a task's plan and key builder are kept per
process in the app's `Runtime` (`TaskRuns`), never on the task object.
"""

from __future__ import annotations

import math
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from types import MethodType
from typing import Any, Final, cast

from celery_dflock import signals
from celery_dflock._celery import (
    Reject,
    Retry,
    backoff_interval,
    get_logger,
    get_task_logger,
)
from celery_dflock._holds import (
    FOLLOW_HEADER,
    HOLD_HEADER,
    NOTE_MAX_BYTES,
    Follow,
    HoldRef,
    decode_note,
    encode_note,
    follow_of,
    hold_of,
)
from celery_dflock._interrupt import BodyTarget, current_body
from celery_dflock._runtime import AnyLock, HeldRecord, Runtime, get_runtime
from celery_dflock.client import DistributedLock
from celery_dflock.clients import Hold
from celery_dflock.config import (
    LOCK_OPTIONS,
    DflockConfig,
    LockOptions,
    OnLockLost,
    check_call_options,
    get_config,
    resolve_options,
)
from celery_dflock.errors import (
    AlreadyQueued,
    DflockError,
    InvalidValueError,
    KeyHeld,
    LimitMismatchError,
    LockLost,
    LockNotAcquired,
    LockSkipped,
    ProtocolError,
    ServerUnavailable,
)
from celery_dflock.keys import KeyBuilder

__all__ = [
    "LOCK_OPTIONS_HEADER",
    "LOCK_RETRIES_HEADER",
    "PUBLISH_LEASE_S",
    "REQUEST_LOCK",
    "Duplicate",
    "PublishHold",
    "TaskRuns",
    "call_options",
    "locked_run",
    "publish_hold",
    "release_current",
    "release_hold",
    "retry_hand_off",
]

logger: Any = get_task_logger("celery_dflock.task")
"""For messages logged while the task runs (Celery prefixes them with ``name[id]``)."""
worker_logger: Any = get_logger("celery_dflock.worker")
"""For messages from the renewal thread, where Celery's task prefix would read ``???[???]``
(the message names the run itself)."""

LOCK_OPTIONS_HEADER: Final = "dflock_options"
"""Message header carrying per-call lock options (``apply_async(..., lock_ttl=60)``)."""
LOCK_RETRIES_HEADER: Final = "dflock_lock_retries"
"""Message header counting the retries ``on_locked="retry"`` made (Celery's ``retries`` is
left to the task's own retries)."""

REQUEST_LOCK: Final = "dflock_lock"
"""The request attribute holding the current run's lock (``LockedTask.lock``)."""
_REQUEST_KEY: Final = "dflock_key"
_REQUEST_FENCE: Final = "dflock_fence"
_REQUEST_TOKEN: Final = "dflock_token"
_REQUEST_OPTIONS: Final = "dflock_run_options"
"""The request attribute holding the current run's resolved `LockOptions`."""
_MAX_BACKOFF_EXPONENT: Final = 32
_FOLLOW_GONE_HEADER: Final = "dflock_follow_gone"
"""Set on a follower resent after it found its holder gone without a result (once more, then
it fails)."""
_FOLLOW_PAUSE_S: Final = 0.25
_FOLLOW_MAX_S: Final = 5.0
_ADOPT_PAUSE_S: Final = 0.01
_ADOPT_PAUSE_MAX_S: Final = 0.5


def _same(a: object, b: object) -> bool:
    """The same object; or the same bound method (a function-valued class attribute, such as
    a ``lock_key`` callable, is a new bound method object on every attribute access)."""
    return a is b or (type(a) is MethodType and a == b)


@dataclass(frozen=True, slots=True)
class _Plan:
    """Whether runs of a task without call options are locked, and their options, as worked
    out from these inputs; reused while the config and every lock attribute are the same
    objects (a changed attribute or a reset config is noticed on the next run)."""

    config: DflockConfig
    attributes: tuple[object, ...]
    locked: bool
    options: LockOptions | None

    def fits(self, config: DflockConfig, attributes: tuple[object, ...]) -> bool:
        return self.config is config and all(
            _same(a, b) for a, b in zip(self.attributes, attributes, strict=True)
        )


@dataclass(frozen=True, slots=True)
class _Keys:
    """A task's `KeyBuilder` and what it was built for."""

    builder: KeyBuilder
    run: object  # the run function (a bound method's __func__)
    owner: object  # a bound method's __self__, else None

    def fits(self, source: object, run: object, owner: object, prefix: str) -> bool:
        builder = self.builder
        return (
            _same(builder.source, source)
            and self.run is run
            and self.owner is owner
            and builder.prefix == prefix
        )


class TaskRuns:
    """What the runs of one task reuse in one process: its plan and its key builder (kept by
    the app's `Runtime`, so a pool child works its own out, and the task stays stateless)."""

    __slots__ = ("keys", "plan")

    def __init__(self) -> None:
        self.plan: _Plan | None = None
        self.keys: _Keys | None = None

    def plan_for(self, task: Any, config: DflockConfig, attributes: tuple[object, ...]) -> _Plan:
        """Locked or not, and the options, for a run without call options."""
        plan = self.plan
        if plan is not None and plan.fits(config, attributes):
            return plan
        options = None
        if _is_locked(task, config, attributes):
            given = dict(zip(LOCK_OPTIONS, attributes, strict=True))
            options = resolve_options(config, str(task.name), given, None)
        plan = self.plan = _Plan(config, attributes, options is not None, options)
        return plan

    def key_builder(
        self, task: Any, source: object, run: Callable[..., Any], prefix: str
    ) -> KeyBuilder:
        """The `KeyBuilder` for the task's runs (its signature is inspected once)."""
        func: object = getattr(run, "__func__", run)
        owner: object = getattr(run, "__self__", None)
        keys = self.keys
        if keys is not None and keys.fits(source, func, owner, prefix):
            return keys.builder
        builder = KeyBuilder(cast("Any", source), task_name=str(task.name), run=run, prefix=prefix)
        self.keys = _Keys(builder, func, owner)
        return builder


def _is_locked(task: Any, config: DflockConfig, attributes: tuple[object, ...]) -> bool:
    """Whether runs without call options are locked (with call options they always are)."""
    if str(task.name) in config.task_locks:
        return True
    if any(value is not None for value in attributes):
        return True
    # base=LockedTask named explicitly: always locked. Inherited only through the
    # app's task_cls: locked only with a lock option (checked above).
    app_task_cls: Any = task._get_app().Task
    return not isinstance(task, app_task_cls)


def _options_for(
    task: Any, config: DflockConfig, runtime: Runtime, per_call: Mapping[str, object]
) -> LockOptions | None:
    """The lock options of a run (or a publish) of ``task``; None when it is not locked."""
    name = str(task.name)
    attributes = tuple(getattr(task, option, None) for option in LOCK_OPTIONS)
    if per_call:  # per call: resolved every time (they must win)
        given = dict(zip(LOCK_OPTIONS, attributes, strict=True))
        return resolve_options(config, name, given, per_call)
    return runtime.task_runs(name).plan_for(task, config, attributes).options


def _run_note(task_id: str | None, request: Any) -> str | None:
    """The owner note of a running task: its id and the worker's name (or this host's)."""
    host = getattr(request, "hostname", None)
    return encode_note(task_id, host if isinstance(host, str) and host else socket.gethostname())


# ------------------------------------------------------------------------------ one run


def locked_run(task: Any, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``task``'s body for ``request`` under its lock (or straight, when not locked).

    A request sent under a publish-time hold (`HOLD_HEADER`) takes the hold over: the run
    holds the very grant the publish took (renewed, guarded and released as any run's lock).
    When the hold is gone (its ``lock_pending_ttl`` ran out), the run takes the key as a
    run-time lock and ``on_locked`` applies."""
    app: Any = task._get_app()
    follow = follow_of(_header(request, FOLLOW_HEADER))
    if follow is not None:
        return _follow(task, request, follow, (args, kwargs))
    config = get_config(app)
    runtime = get_runtime(app)
    run: Callable[..., Any] = task.run
    options = _options_for(task, config, runtime, call_options(request))
    if options is None:
        return run(*args, **kwargs)
    runs = runtime.task_runs(str(task.name))
    key = runs.key_builder(task, options.key, run, config.key_prefix).key(args, kwargs)
    task_id = cast("str | None", request.id)
    guard = _RunGuard(task, task_id, key, options.on_lock_lost, runtime)
    wait_s = options.timeout
    eager_once = bool(request.is_eager) and options.lock_from == "publish"
    if (request.called_directly or eager_once) and not options.timeout_given:
        # The default wait of "retry" stands in for a retry's countdown in a worker; a direct
        # call (a web request, a script) has no message to retry, and an eager queue-once run
        # of a key a queued message holds fails at once (AlreadyQueued): both give up at once.
        wait_s = 0.0
    if options.on_locked == "retry" and request.is_eager and not eager_once:
        # Eager retries run at once; wait out the countdown in the queue instead.
        wait_s = max(wait_s, retry_countdown(_lock_retries(request), options))
    note = _run_note(task_id, request)
    lock = runtime.new_lock(
        config, key, options, acquire_timeout_s=wait_s, on_lost=guard.on_lost, note=note
    )
    held = hold_of(_header(request, HOLD_HEADER))
    try:
        acquired = _take_over(
            runtime,
            config,
            lock,
            held,
            note=note,
            label=guard.label,
            on_close_lease=options.pending_ttl if _acks_late(task, request) else None,
            task_id=task_id,
        )
        if not acquired:
            acquired = lock.acquire()
    except LimitMismatchError as exc:  # the key is busy with another lock_limit
        return _contended(task, request, key, options, (args, kwargs), mismatch=exc)
    except DflockError as exc:  # the server unreachable, refusing, draining, ...
        _autoretry(task, request, exc)
        raise
    if not acquired:
        if eager_once:
            raise _eager_duplicate(guard.label, key, lock)
        return _contended(task, request, key, options, (args, kwargs), lock=lock)
    return _run_held(guard, lock, request, options=options, run=run, call=(args, kwargs))


def _eager_duplicate(label: str, key: str, lock: AnyLock) -> AlreadyQueued:
    """An eager run of a ``lock_from="publish"`` task found its key held (a queued or running
    message): it does not run, and does not wait for the holder."""
    holder = decode_note(lock.holder)[0] if isinstance(lock, DistributedLock) else None
    by = f"task {holder}" if holder else "a holder that left no task id"
    follows = f"; AsyncResult({holder!r}) follows it" if holder else ""
    return AlreadyQueued(
        f"{label} (an eager run) did not run: key {key!r} is held by {by} "
        f"(lock_from='publish': one run per key){follows}",
        task_id=holder,
        key=key,
    )


def _take_over(
    runtime: Runtime,
    config: DflockConfig,
    lock: AnyLock,
    held: HoldRef | None,
    *,
    note: str | None,
    label: str,
    on_close_lease: int | None,
    task_id: str | None,
) -> bool:
    """Adopt the publish-time hold ``held`` into ``lock``; False when there is none to adopt
    (no hold, it is gone, or another delivery of the same message runs under it: the caller
    then acquires, and ``on_locked`` applies).

    The adoption is exclusive (the server binds the hold to this run's connection): a message
    delivered again while its first run lasts (Redis's visibility timeout) cannot run beside
    it. ``on_close_lease``: for an acks_late task, whose message comes back to the queue when
    its worker dies, the hold outlives the run's connection by that many seconds (detached
    again, for the redelivery to take over); otherwise the hold is released with the
    connection."""
    if held is None or not isinstance(lock, DistributedLock):
        return False
    if held.key != lock.key:
        # Sent again (a retry) with arguments that give another key: the old key's hold is
        # of no use to this run.
        logger.info(
            "dflock: %s was sent holding %r, but its arguments give key %r now; "
            "releasing the old hold",
            label,
            held.key,
            lock.key,
        )
        release_hold(runtime, config, held)
        return False
    if _adopt(lock, held, note=note, on_close_lease=on_close_lease, task_id=task_id):
        return True
    if lock.holder is not None:
        logger.info(
            "dflock: %s: its hold on %r is held by a run of another delivery (%s); taking "
            "the key as a run-time lock",
            label,
            lock.key,
            lock.holder,
        )
        return False
    logger.info(
        "dflock: %s: the hold taken when it was sent is gone (lock_pending_ttl ran out, or "
        "it was released); taking key %r now",
        label,
        lock.key,
    )
    return False


def _adopt(
    lock: DistributedLock,
    held: HoldRef,
    *,
    note: str | None,
    on_close_lease: int | None,
    task_id: str | None,
) -> bool:
    """`DistributedLock.adopt`; while the hold is still bound to the publisher that sent this
    very message (its note is this task's id, without a host: the publisher has not yet
    detached it, `PublishHold.confirm`), try again shortly, for at most `PUBLISH_LEASE_S`."""
    deadline = time.monotonic() + PUBLISH_LEASE_S
    pause_s = _ADOPT_PAUSE_S
    while True:
        if lock.adopt(held.token, note=note or "_", on_close_lease=on_close_lease):
            return True
        pending = task_id is not None and decode_note(lock.holder) == (task_id, None)
        if not pending or time.monotonic() + pause_s > deadline:
            return False
        time.sleep(pause_s)
        pause_s = min(pause_s * 2, _ADOPT_PAUSE_MAX_S)


def _acks_late(task: Any, request: Any) -> bool:
    """Whether this run's message is acknowledged after the run (per call, or the task's)."""
    per_message = getattr(request, "acks_late", None)
    return bool(per_message if per_message is not None else getattr(task, "acks_late", False))


def release_hold(runtime: Runtime, config: DflockConfig, held: HoldRef) -> bool:
    """Release a publish-time hold by its token (idempotent): True if the server freed it."""
    return runtime.client(config).release(held.key, held.token)


# ------------------------------------------------------------------------------ publish


PUBLISH_LEASE_S: Final = 15
"""How long a run waits for the publisher of its own message to detach the hold (`_adopt`):
a publish-time hold is taken bound to the publisher's connection (``hl ... c``, with its
pending lease, so a lease above the server's ``--max-lease-ttl`` is refused before anything
is sent) and detached (``hd``) only once the broker took the message. A send that gave up
(the lock server did not answer, the broker refused, an exception) leaves no hold behind: it
is freed when that connection closes (a connection whose request went unanswered is closed)."""


@dataclass(frozen=True, slots=True)
class PublishHold:
    """A publish-time hold taken for a message about to be sent (bound to the publisher's
    connection until `confirm`)."""

    hold: Hold
    header: dict[str, str]
    lease: int
    """The lease the hold gets once its message is sent (``lock_pending_ttl``, or the delay)."""

    def confirm(self, task: Any, task_id: str) -> None:
        """The message was sent: detach the hold with its pending lease. A hold that cannot
        be confirmed (gone, or the server unreachable) is logged: the message is sent, and
        its run takes the key at run time."""
        app: Any = task._get_app()
        key = self.hold.key
        try:
            done = (
                get_runtime(app)
                .client(get_config(app))
                .detach(key, self.hold.token, lease_ttl=self.lease)
            )
        except DflockError as exc:
            done, why = False, f"the lock server did not confirm it ({exc})"
        else:
            why = (
                "it was gone (its connection to the lock server closed before the message was sent)"
            )
        if not done:
            worker_logger.warning(
                "dflock: task %s[%s] was sent, but its hold of %r could not be kept: %s; its "
                "run takes the key when it starts, and a duplicate may be sent meanwhile",
                task.name,
                task_id,
                key,
                why,
            )

    def release(self, task: Any) -> None:
        """Free the hold (the message could not be sent)."""
        app: Any = task._get_app()
        config = get_config(app)
        get_runtime(app).client(config).release(self.hold.key, self.hold.token)


@dataclass(frozen=True, slots=True)
class Duplicate:
    """The key is held: send nothing, return the holder's result (``on_duplicate="return"``);
    for a canvas member, send a follower in its place (`Follow`: the holder's result, or
    ``error`` at once)."""

    task_id: str | None
    key: str = ""
    error: str | None = None

    def follow(self) -> Follow:
        """The follower's header for a canvas member sent in this duplicate's place."""
        return Follow(self.key, self.task_id, self.error)


def publish_hold(
    task: Any,
    call: tuple[tuple[Any, ...], dict[str, Any]],
    per_call: Mapping[str, object],
    task_id: str,
    *,
    countdown: float | None = None,
    eta: Any = None,
    in_canvas: bool = False,
) -> PublishHold | Duplicate | None:
    """Take the publish-time hold of a message of ``task`` (``lock_from="publish"``).

    ``call`` is (args, kwargs) as the run will see them (after the serializer's round trip),
    ``task_id`` the id the message is sent with. The hold lasts ``lock_pending_ttl`` after
    the message is due (its ``countdown`` or ``eta``). None: the task is not sent under a
    hold. Raises `AlreadyQueued` for a duplicate under ``on_duplicate="raise"``; a canvas
    member (``in_canvas``: its id is already in a result its caller holds) gets a `Duplicate`
    whatever the policy, whose follower fails at once when it would raise."""
    app: Any = task._get_app()
    config = get_config(app)
    runtime = get_runtime(app)
    options = _options_for(task, config, runtime, per_call)
    if options is None or options.lock_from != "publish":
        return None
    name = str(task.name)
    run: Callable[..., Any] = task.run
    key = runtime.task_runs(name).key_builder(task, options.key, run, config.key_prefix).key(*call)
    note = encode_note(task_id)
    if note is None:
        raise InvalidValueError(
            f"task {name}: task_id {task_id!r} is too long for lock_from='publish', which "
            f"stores it with key {key!r} (at most {NOTE_MAX_BYTES} bytes once "
            f"percent-encoded); send the task with a shorter task_id"
        )
    lease = _pending_lease(options, _delay_s(countdown, eta))
    try:
        hold = runtime.client(config).hold(key, note=note, lease_ttl=lease, detached=False)
    except ProtocolError as exc:
        raise ProtocolError(
            f"task {name} was not sent: the lock server refused its hold of {key!r} for "
            f"{lease} s (lock_pending_ttl={options.pending_ttl}, or the message's countdown/"
            f"eta when longer); a lease above the server's --max-lease-ttl "
            f"(DFLOCKD_MAX_LEASE_TTL_S, default 300 s) is refused: lower lock_pending_ttl "
            f"(dflock_lock_pending_ttl) or raise the server's limit. The server said: {exc}"
        ) from exc
    except InvalidValueError as exc:  # the lease is above the limit the server's hello told
        raise InvalidValueError(
            f"task {name} was not sent: its hold of {key!r} would last {lease} s "
            f"(lock_pending_ttl={options.pending_ttl}, or the message's countdown/eta when "
            f"longer): {exc}"
        ) from exc
    except KeyHeld as busy:
        holder, host = decode_note(busy.holder)
        where = f" (running on {host})" if host else " (queued)"
        grace = _grace(runtime, config) if holder is None else None
        if grace is not None:
            return _in_grace(name, task_id, key, options, grace, in_canvas=in_canvas)
        if holder is not None and options.on_duplicate == "return":
            logger.info(
                "dflock: task %s[%s] not sent: key %r is held by task %s%s; "
                "returning its result (on_duplicate='return')",
                name,
                task_id,
                key,
                holder,
                where,
            )
            return Duplicate(holder, key)
        if holder is None:
            error = (
                f"task {name} was not sent: key {key!r} is held, by a holder that left no task "
                f"id (a lock taken outside Celery, or by an older worker), so there is no "
                f"result to return; the key frees when that holder releases it"
            )
        else:
            error = (
                f"task {name} was not sent: key {key!r} is held by task {holder}{where} "
                f"(lock_from='publish', on_duplicate='raise'); AsyncResult({holder!r}) "
                f"follows it"
            )
        if in_canvas:
            return Duplicate(holder, key, error)
        raise AlreadyQueued(error, task_id=holder, key=key) from busy
    return PublishHold(hold, HoldRef(hold.key, hold.token).header(), lease)


def _grace(runtime: Runtime, config: DflockConfig) -> str | None:
    """What a server in its restart grace says of it (``"127.0.0.1:6388: 212 s left
    (reason)"``), or None when no server is in one. Asked only when a hold was refused by a
    holder that left no note: a grace refuses every key so."""
    found: list[str] = []
    for status in runtime.client(config).stats():
        stats = status.stats or {}
        left = stats.get("grace_remaining_s")
        if isinstance(left, int | float) and left > 0:
            reason = stats.get("grace_reason")
            why = f" ({reason})" if isinstance(reason, str) and reason else ""
            found.append(f"{status.address}: {left:.0f} s left{why}")
    return "; ".join(found) or None


def _in_grace(
    name: str,
    task_id: str,
    key: str,
    options: LockOptions,
    grace: str,
    *,
    in_canvas: bool,
) -> Duplicate | None:
    """A hold refused because the lock server runs its restart grace (it grants no key until
    the leases of its previous run have ended): no holder, so no duplicate. With
    ``on_duplicate="return"`` the task is sent without a hold (None; its run still locks the
    key); with ``"raise"`` nothing is sent (`ServerUnavailable`, or a failing follower for a
    canvas member)."""
    what = (
        f"task {name}: the lock server is in its restart grace ({grace}): it grants no key "
        f"until the leases its previous run may have granted have ended, so key {key!r} "
        f"cannot be held from publish"
    )
    if options.on_duplicate == "return":
        logger.warning(
            "dflock: %s; task %s sent without a hold (its run still takes the key; a duplicate "
            "may be sent meanwhile). A lease journal (--state-dir) keeps holds across restarts",
            what,
            task_id,
        )
        return None
    error = f"{what}; nothing was sent (on_duplicate='raise'): send it again after the grace"
    if in_canvas:
        return Duplicate(None, key, error)
    raise ServerUnavailable(error)


# ------------------------------------------------------------------------------ a follower


def _follow(
    task: Any, request: Any, follow: Follow, call: tuple[tuple[Any, ...], dict[str, Any]]
) -> Any:
    """The run of a canvas member sent in a duplicate's place: the holder's result once it
    is ready (its value, or its error raised), polled by resending this message with a
    countdown (no worker slot is kept while the holder runs); ``follow.error``: fail at once.

    When the holder no longer holds the key and still has no result twice in a row (it was
    revoked or lost, or keeps no result: ``ignore_result``), the run fails, saying so."""
    run = _run_name(str(task.name), request.id)
    if follow.error is not None or follow.task_id is None:
        raise AlreadyQueued(
            f"{run} was sent in place of a duplicate: {follow.error}",
            task_id=follow.task_id,
            key=follow.key,
        )
    app: Any = task._get_app()
    holder: Any = app.AsyncResult(follow.task_id)
    try:
        ready = bool(holder.ready())
    except NotImplementedError:
        raise DflockError(
            f"{run} stands in for task {follow.task_id}, which holds key {follow.key!r}, but "
            f"this app has no result backend to read its result from: configure "
            f"result_backend, or send canvas members of a lock_from='publish' task with "
            f"on_duplicate='raise'"
        ) from None
    if ready:
        return _holder_outcome(run, follow, holder)
    polls = _lock_retries(request)
    if _key_left(app, follow, request.id):
        if _header(request, _FOLLOW_GONE_HEADER):
            raise DflockError(
                f"{run} stands in for task {follow.task_id}, which no longer holds key "
                f"{follow.key!r} and left no result (revoked, lost, its hold ran out before "
                f"it ran, or it keeps none: ignore_result)"
            )
        extra: dict[str, object] = {_FOLLOW_GONE_HEADER: True}
    else:
        extra = {}
    countdown = min(_FOLLOW_PAUSE_S * (2 ** min(polls, _MAX_BACKOFF_EXPONENT)), _FOLLOW_MAX_S)
    logger.info(
        "dflock: %s stands in for task %s (key %r), not done yet; looking again in %.2fs",
        run,
        follow.task_id,
        follow.key,
        countdown,
    )
    busy = LockNotAcquired(f"{run}: task {follow.task_id} holding key {follow.key!r} runs")
    raise _resend(
        task, request, call, countdown=countdown, retries=polls + 1, busy=busy, extra=extra
    )


def _holder_outcome(run: str, follow: Follow, holder: Any) -> Any:
    """The holder's result as this run's: its value, or its error raised."""
    if holder.successful():
        return holder.result
    error: object = holder.result
    if isinstance(error, BaseException):
        raise error
    raise DflockError(
        f"{run} stands in for task {follow.task_id} (key {follow.key!r}), which ended in "
        f"state {holder.state}: {error!r}"
    )


def _key_left(app: Any, follow: Follow, task_id: str | None) -> bool:
    """Whether the holder no longer holds ``follow.key`` (taken and let go at once here)."""
    lock = (
        get_runtime(app)
        .client(get_config(app))
        .lock(follow.key, acquire_timeout_s=0, note=encode_note(task_id))
    )
    try:
        if lock.acquire():
            lock.release()
            return True
    except DflockError:
        return False  # unknown: look again later
    return decode_note(lock.holder)[0] != follow.task_id


# ------------------------------------------------------------------------------ retry


def retry_hand_off(
    task: Any,
    request: Any,
    *,
    countdown: float | None,
    eta: Any,
    max_retries: int | None,
) -> HoldRef | None:
    """Before ``task.retry``: a run holding its publish-time hold hands it on to the retry
    message (renewed for the countdown plus ``lock_pending_ttl``, not released); returns the
    hold for the retry's header. Any other run's lock is released (None)."""
    lock = cast("AnyLock | None", getattr(request, REQUEST_LOCK, None))
    options = cast("LockOptions | None", getattr(request, _REQUEST_OPTIONS, None))
    held = hold_of(_header(request, HOLD_HEADER))
    sent = not (request.is_eager or request.called_directly)
    limit = task.max_retries if max_retries is None else max_retries
    last = limit is not None and int(request.retries or 0) + 1 > limit  # Celery will not send
    if (
        lock is None
        or options is None
        or held is None
        or not sent
        or last
        or not isinstance(lock, DistributedLock)
        or lock.token != held.token
    ):
        if lock is not None:
            lock.release()
        return None
    lease = _pending_lease(options, _retry_delay(task, countdown, eta))
    if lock.hand_off(lease):
        return held
    return None  # lost meanwhile: nothing to hand on


def _pending_lease(options: LockOptions, delay_s: float) -> int:
    """The lease of a hold whose message is due in ``delay_s`` s: ``lock_pending_ttl``, or
    the delay when that is longer (a message due later keeps its key until it is due)."""
    return max(options.pending_ttl, math.ceil(delay_s))


def _retry_delay(task: Any, countdown: float | None, eta: Any) -> float:
    """Seconds until a retry is due, as ``Task.retry`` works it out."""
    if eta is None and countdown is None:
        countdown = cast("float | None", getattr(task, "default_retry_delay", None))
    return _delay_s(countdown, eta)


def _delay_s(countdown: object, eta: object) -> float:
    """Seconds until a message sent with ``countdown`` or ``eta`` is due (0: at once)."""
    if isinstance(eta, str):
        try:
            eta = datetime.fromisoformat(eta)
        except ValueError:
            eta = None
    if isinstance(eta, datetime):
        now = datetime.now(eta.tzinfo)
        return max(0.0, (eta - now).total_seconds())
    if isinstance(countdown, int | float) and not isinstance(countdown, bool):
        return max(0.0, float(countdown))
    return 0.0


def _run_held(
    guard: _RunGuard,
    lock: AnyLock,
    request: Any,
    *,
    options: LockOptions,
    run: Callable[..., Any],
    call: tuple[tuple[Any, ...], dict[str, Any]],
) -> Any:
    """The body, with ``lock`` held: recorded on the request (and in the held-lock records in
    a pool child), guarded against a loss, and released however the body ends."""
    key, task_id, runtime = guard.key, guard.task_id, guard.runtime
    guard.lock = lock
    setattr(request, REQUEST_LOCK, lock)
    request.dflock_key = key
    request.dflock_fence = lock.fence
    request.dflock_token = lock.token
    setattr(request, _REQUEST_OPTIONS, options)
    if runtime.in_pool_child and task_id:
        writer = runtime.held_writer()
        if writer is not None:
            guard.record = writer.add(task_id, lock, options.limit)
    try:
        try:
            with guard.body():
                result = run(*call[0], **call[1])
        except _Interrupted:
            raise LockLost(
                f"{guard.label} lost its lock {key!r} (fence {lock.fence}) "
                f"while it ran, and was interrupted (on_lock_lost='interrupt')"
            ) from None
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
            for attr in (
                REQUEST_LOCK,
                _REQUEST_KEY,
                _REQUEST_FENCE,
                _REQUEST_TOKEN,
                _REQUEST_OPTIONS,
            ):
                setattr(request, attr, None)


def release_current(request: Any) -> None:
    """Release the lock of the run ``request`` is for, if it holds one (before a retry)."""
    lock = cast("AnyLock | None", getattr(request, REQUEST_LOCK, None))
    if lock is not None:
        lock.release()


def retry_countdown(retries: int, options: LockOptions) -> float:
    """The countdown of lock retry number ``retries + 1`` (backoff, cap, jitter)."""
    countdown = min(
        options.retry_countdown * (2 ** min(retries, _MAX_BACKOFF_EXPONENT)),
        options.retry_backoff_max,
    )
    if options.retry_jitter:
        countdown = countdown / 2 + random.uniform(0, countdown / 2)
    return countdown


class _Interrupted(LockLost):
    """Raised asynchronously in the body's thread by ``on_lock_lost="interrupt"``."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(args or ("the task's lock was lost while it ran",)))


class _RunGuard:
    """One locked run: its lock, the body's thread, and the ``on_lock_lost`` policy."""

    def __init__(
        self,
        task: object,
        task_id: str | None,
        key: str,
        policy: OnLockLost,
        runtime: Runtime,
    ) -> None:
        self.task = task
        self.label = _run_name(str(cast("Any", task).name), task_id)
        self.task_id = task_id
        self.key = key
        self.policy: OnLockLost = policy
        self.runtime = runtime
        self.lock: AnyLock | None = None
        self.record: HeldRecord | None = None
        self._state = threading.Lock()
        self._body: BodyTarget | None = None
        self._interrupt_sent = False
        self._interrupt_missed = False
        self._body_ended = False

    def on_lost(self, lock: Any) -> None:
        """Called once when the lock is lost: from the renewal thread, or from the release
        after the body if only the server's refusal to release shows it.

        An interrupt goes out first, before the log line and the signal (a body that polls
        ``lock.lost`` is stopped before it can act on it); a termination comes last, after
        them (it ends the process)."""
        policy = self.policy
        if policy == "terminate" and not self.runtime.in_pool_child:
            policy = "interrupt"  # only a prefork child can be replaced
        with self._state:
            ended = self._body_ended
        if policy == "interrupt" and not ended:
            self._interrupt()
        worker_logger.error(
            "dflock: %s lost its lock %r (fence %s)%s; on_lock_lost=%r",
            self.label,
            self.key,
            getattr(lock, "fence", None),
            " (noticed after its body ended)" if ended else "",
            policy,
        )
        signals.lock_lost.send(
            sender=self.task, task_id=self.task_id, key=self.key, lock=lock, policy=policy
        )
        if self._interrupt_missed:
            worker_logger.error(
                "dflock: %s: the body could not be interrupted where it runs; "
                "it fails with LockLost when it returns",
                self.label,
            )
        if policy == "terminate" and not ended:
            if self.record is not None:
                self.record.remove()
            os.kill(os.getpid(), signal.SIGKILL)

    def _interrupt(self) -> None:
        with self._state:
            body = self._body
            if body is None or self._interrupt_sent:
                return
            self._interrupt_sent = True
            if not body.interrupt(_Interrupted):
                self._interrupt_missed = True

    @property
    def interrupt_due(self) -> bool:
        """An interrupt was sent (or could not be) while the body ran: a body that returned
        all the same must not count as a success."""
        return self._interrupt_sent

    def body(self) -> _RunGuard:
        """``with guard.body():`` marks the body as running in this thread (the target of an
        interrupt) until the block ends."""
        return self

    def __enter__(self) -> None:
        body = current_body()
        with self._state:
            self._body = body

    def __exit__(self, *exc_info: object) -> None:
        with self._state:
            body, self._body = self._body, None
            self._body_ended = True
            if self._interrupt_sent and body is not None:
                body.cancel()  # not delivered yet: drop it


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


def _contended(
    task: Any,
    request: Any,
    key: str,
    options: LockOptions,
    call: tuple[tuple[Any, ...], dict[str, Any]],
    *,
    mismatch: LimitMismatchError | None = None,
    lock: AnyLock | None = None,
) -> Any:
    """The key is busy: held by other runs, or (``mismatch``) in use with another limit.

    A key is one resource on the server (a lock is a semaphore of limit 1), so runs with
    another ``lock_limit`` on the key keep it busy like any holder; the server refuses at
    once instead of queueing, and ``on_locked`` applies as for a busy key."""
    run = _run_name(str(task.name), request.id)
    task_id = cast("str | None", request.id)
    args, kwargs = call
    holder = decode_note(lock.holder)[0] if isinstance(lock, DistributedLock) else None
    handover = None if lock is None else lock.handover
    if mismatch is None and handover is not None:
        why = handover  # a cluster hand-over outlasted lock_timeout: the key may well be free
    elif mismatch is None:
        by = f"task {holder}" if holder else "another run"
        why = f"lock {key!r} is held by {by}"
    else:
        mine = "a lock" if options.limit is None else f"a semaphore of limit {options.limit}"
        why = (
            f"key {key!r} is in use by runs with another lock_limit (this run asked for "
            f"{mine}); a lock and a semaphore on one key exclude each other: give every use "
            f"of the key the same lock_limit, or give the lock another lock_key"
        )
        logger.warning("dflock: %s: %s", run, why)
    if options.on_locked == "skip":
        logger.info("dflock: skipping %s: %s", run, why)
        signals.lock_skipped.send(
            sender=task, task_id=task_id, key=key, args=args, kwargs=kwargs, holder=holder
        )
        raise LockSkipped(
            f"{run} was skipped: {why} (waited {options.timeout:g}s; on_locked='skip')"
        ) from mismatch
    busy = LockNotAcquired(
        f"{run}: {why} (waited {options.timeout:g}s; on_locked={options.on_locked!r})"
    )
    busy.__cause__ = mismatch
    if options.on_locked != "retry" or request.called_directly:
        raise busy
    done = _lock_retries(request)
    limit = options.max_retries
    if limit is not None and done >= limit:
        raise LockNotAcquired(
            f"{run}: key {key!r} was still busy after {done} lock "
            f"retries (lock_max_retries={limit}), so the run is dropped; raise "
            f"lock_max_retries (None: retry as long as the key is busy) or lock_timeout "
            f"(wait in the key's queue)"
        )
    countdown = retry_countdown(done, options)
    logger.info(
        "dflock: %s retries in %.2fs: lock %r is busy (lock retry %d of %s)",
        run,
        countdown,
        key,
        done + 1,
        "no limit" if limit is None else limit,
    )
    raise _lock_retry(task, request, call, countdown=countdown, retries=done + 1, busy=busy)


def _lock_retry(
    task: Any,
    request: Any,
    call: tuple[tuple[Any, ...], dict[str, Any]],
    *,
    countdown: float,
    retries: int,
    busy: LockNotAcquired,
) -> BaseException:
    """Send the run again in ``countdown`` s, as ``Task.retry`` does, but count it in
    `LOCK_RETRIES_HEADER` instead of Celery's ``retries``: a busy key never uses up the
    task's ``max_retries``, which are left to its own retries."""
    return _resend(task, request, call, countdown=countdown, retries=retries, busy=busy)


def _resend(
    task: Any,
    request: Any,
    call: tuple[tuple[Any, ...], dict[str, Any]],
    *,
    countdown: float,
    retries: int,
    busy: LockNotAcquired,
    extra: Mapping[str, object] | None = None,
) -> BaseException:
    """`_lock_retry`, with ``extra`` headers."""
    headers = _request_headers(request)
    for name in (FOLLOW_HEADER, HOLD_HEADER):  # a worker's request keeps them as attributes
        value = _header(request, name)
        if value is not None:
            headers[name] = value
    headers.update(extra or {})
    headers[LOCK_RETRIES_HEADER] = retries
    headers.setdefault(HOLD_HEADER, None)  # sent again, not a new publish: no hold taken
    given = call_options(request)
    if given:
        headers[LOCK_OPTIONS_HEADER] = given
    signature: Any = task.signature_from_request(
        request, *call, countdown=countdown, headers=headers
    )
    if request.is_eager:
        return Retry(exc=busy, when=countdown, is_eager=True, sig=signature)
    try:
        signature.apply_async()
    except Exception as exc:
        return Reject(exc, requeue=False)
    return Retry(exc=busy, when=countdown, sig=signature)


def _run_name(name: str, task_id: object) -> str:
    """``task NAME[ID]``, or ``task NAME (called directly)`` for a run without an id."""
    return f"task {name}[{task_id}]" if task_id else f"task {name} (called directly)"


def _request_headers(request: Any) -> dict[str, Any]:
    headers = getattr(request, "headers", None)
    if isinstance(headers, Mapping):
        return dict(cast("Mapping[str, Any]", headers))
    return {}


def _header(request: Any, name: str) -> object:
    """A message header of the current request (a request attribute on a worker, an entry of
    ``request.headers`` in eager runs)."""
    value = getattr(request, name, None)
    if value is None:
        value = _request_headers(request).get(name)
    return cast("object", value)


def _lock_retries(request: Any) -> int:
    value = _header(request, LOCK_RETRIES_HEADER)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def call_options(request: Any) -> dict[str, object]:
    """Per-call lock options of the current request (message header or eager headers)."""
    raw = _header(request, LOCK_OPTIONS_HEADER)
    if not raw:
        return {}
    return check_call_options(
        cast("Mapping[str, object]", raw), f"call options of task {getattr(request, 'task', '?')!r}"
    )
