# pyright: reportMissingTypeStubs=false
"""Queue-once (``lock_from="publish"``): the publish-time hold and its hand-offs (its life:
[Queue once](../queue-once.md#the-life-of-a-hold)).

`publish_hold` takes the hold before the message is published, bound to the publisher's
connection until the broker took the message (`PublishHold.confirm` detaches it with its
pending lease); a duplicate publish gets a `Follow` of the holder instead. The run adopts the
hold (`take_over`); a retry (`retry_hand_off`) or a ``Reject(requeue=True)`` (`hand_off_hold`)
hands it on to its next message; a revoke releases it (`celery_dflock.signals`), and
``lock_pending_ttl`` frees it when no worker ever takes the message.

A follower (`run_follower`): a canvas member sent in a duplicate's place
(`celery_dflock._request.FOLLOW_HEADER`). It gives the holder's result once ready, polling by
resending its own message, or fails at once with the error its publish would have raised.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import Any, Final, TypeVar, cast

from celery_dflock._celery import task_logger as logger, worker_logger
from celery_dflock._outage import server_state
from celery_dflock._request import (
    HOLD_HEADER,
    NOTE_MAX_BYTES,
    Call,
    Follow,
    HoldRef,
    Message,
    backoff,
    decode_note,
    encode_note,
    header,
    held_lock,
    held_options,
    hold_of,
    note_parts,
    resend,
)
from celery_dflock._runtime import AnyLock, app_client, get_runtime, options_for
from celery_dflock._settings import GivenOptions
from celery_dflock.client import DistributedLock, errors
from celery_dflock.client.clients import Client, Hold, Lease
from celery_dflock.config import LockOptions, get_config


def eager_duplicate(label: str, key: str, lock: AnyLock) -> errors.AlreadyQueued:
    """An eager run of a ``lock_from="publish"`` task found its key held: it does not run."""
    holder = decode_note(lock.holder)[0] if isinstance(lock, DistributedLock) else None
    by = f"task {holder}" if holder else "a holder that left no task id"
    follows = f"; AsyncResult({holder!r}) follows it" if holder else ""
    return errors.AlreadyQueued(
        f"{label} (an eager run) did not run: key {key!r} is held by {by} "
        f"(lock_from='publish': one run per key){follows}",
        task_id=holder,
        key=key,
    )


def take_over(
    client: Client,
    lock: AnyLock,
    held: HoldRef | None,
    *,
    note: str | None,
    label: str,
    on_close_lease: int | None,
    task_id: str | None,
) -> bool:
    """Adopt the publish-time hold ``held`` into ``lock``, bound to this run's connection;
    False when there is none to adopt (the caller acquires). ``on_close_lease``: for an
    acks_late task, the hold outlives the run's connection by that many seconds, for the
    redelivery to take over.

    The adopt is retried while the hold is bound to a connection about to let it go: this
    message's publisher (this task's id, no host), up to `PUBLISH_LEASE_S`, or an earlier
    delivery (this task's id with a worker), up to `REDELIVERED_WAIT_S`."""
    if held is None or not isinstance(lock, DistributedLock):
        return False
    if held.key != lock.key:
        # A retry whose arguments give another key.
        logger.info(
            "dflock: %s was sent holding %r, but its arguments give key %r now; "
            "releasing the old hold",
            label,
            held.key,
            lock.key,
        )
        client.release(held.key, held.token)
        return False
    started, pause_s = time.monotonic(), 0.01
    while not lock.adopt(held.token, note=note or "_", on_close_lease=on_close_lease):
        holder = note_parts(lock.holder)  # an older publisher's note: the task id alone
        if task_id is None or holder.task_id != task_id:
            break
        wait_s = PUBLISH_LEASE_S if holder.host is None else REDELIVERED_WAIT_S
        if time.monotonic() + pause_s > started + wait_s:
            break
        time.sleep(pause_s)
        pause_s = min(pause_s * 2, 0.5)
    else:  # adopted
        return True
    why = (
        f"its hold on {lock.key!r} is held by a run of another delivery ({lock.holder})"
        if lock.holder is not None
        else "the hold taken when it was sent is gone (lock_pending_ttl ran out, or it was "
        "released)"
    )
    logger.info("dflock: %s: %s; taking key %r as a run-time lock", label, why, lock.key)
    return False


PUBLISH_LEASE_S: Final = 15  # a run's wait for its own message's publisher to detach the hold
REDELIVERED_WAIT_S: Final = 5
"""Seconds a run waits for an earlier delivery of its message to let the hold go (`take_over`):
a broker may redeliver before the lock server sees the dead run's connection close."""


@dataclass(frozen=True, slots=True)
class PublishHold:
    """A publish-time hold for a message about to be sent (on the publisher's connection
    until `confirm`)."""

    hold: Hold
    header: dict[str, str]
    lease: int  # the hold's once its message is sent (lock_pending_ttl, or the delay)

    def confirm(self, task: Any, task_id: str) -> None:
        """The message was sent: detach the hold with its pending lease (or log why not)."""
        key = self.hold.key
        try:
            if app_client(task._get_app()).detach(key, self.hold.token, lease_ttl=self.lease):
                return
            why = (
                "it was gone (its connection to the lock server closed before the message was sent)"
            )
        except errors.DflockError as exc:
            why = f"the lock server did not confirm it ({exc})"
        worker_logger.warning(
            "dflock: task %s[%s] was sent, but its hold of %r could not be kept: %s; its "
            "run takes the key when it starts, and a duplicate may be sent meanwhile",
            task.name,
            task_id,
            key,
            why,
        )


def publish_hold(
    task: Any,
    call: Call,
    per_call: GivenOptions | None,
    task_id: str,
    *,
    countdown: float | None = None,
    eta: Any = None,
    expires: Any = None,
    in_canvas: bool = False,
    beat: GivenOptions | None = None,
) -> PublishHold | Follow | None:
    """Take the publish-time hold of a message of ``task`` (``call``: (args, kwargs) as the run
    will see them); None: it is not sent under one. The key held: a `Follow` of the holder (send
    nothing, return its result: ``on_duplicate="return"``), `AlreadyQueued` raised
    (``"raise"``), or, for a canvas member (``in_canvas``), whatever the policy, a `Follow` whose
    follower is sent in its place (and fails at once where the publish would raise). ``beat``:
    the options beat's non-overlap gives the message (`read_message_options`)."""
    app: Any = task._get_app()
    config, runtime, name = get_config(app), get_runtime(app), str(task.name)
    runs = runtime.task_runs(name)
    options = options_for(task, config, runs, per_call, beat)
    if options is None or options.lock_from != "publish":
        return None
    key = runs.key_builder(task, options.key, task.run, config.key_prefix).key(*call)
    if (note := encode_note(task_id, name=name)) is None:
        raise errors.InvalidValueError(
            f"task {name}: task_id {task_id!r} is too long for lock_from='publish', whose "
            f"hold of key {key!r} names it in its owner note: at most {NOTE_MAX_BYTES - 1} "
            f"characters once percent-encoded; send the task with a shorter task_id"
        )
    leases = _pending_leases(options, countdown, eta, expires)
    lease = leases[-1]  # the shortest, named when even that is refused
    take = partial(runtime.client(config).hold, key, note=note, detached=False)
    try:
        hold, lease = _longest_granted(leases, take)
    except errors.ServerUnavailable as exc:  # down, restarting, draining: no hold can be taken now
        what = (
            f"task {name}: the lock server {server_state(exc)} ({exc}), so key {key!r} "
            f"cannot be held from publish"
        )
        return _no_hold(task_id, key, options, what, in_canvas=in_canvas)
    except errors.ProtocolError as exc:
        raise errors.ProtocolError(
            f"task {name} was not sent: the lock server refused its hold of {key!r} for "
            f"{lease} s (lock_pending_ttl={options.pending_ttl}, or the message's countdown/"
            f"eta when longer); a lease above the server's --max-lease-ttl "
            f"(DFLOCKD_MAX_LEASE_TTL_S, default 300 s) is refused: lower lock_pending_ttl "
            f"(dflock_lock_pending_ttl) or raise the server's limit. The server said: {exc}"
        ) from exc
    except errors.InvalidValueError as exc:  # the lease is above the limit the server's hello told
        raise errors.InvalidValueError(
            f"task {name} was not sent: its hold of {key!r} would last {lease} s "
            f"(lock_pending_ttl={options.pending_ttl}, or the message's countdown/eta when "
            f"longer): {exc}"
        ) from exc
    except errors.KeyHeld as busy:
        holder, host = decode_note(busy.holder)
        where = f" (running on {host})" if host else " (queued)"
        grace = _grace(runtime.client(config)) if holder is None else None
        if grace is not None:
            what = (
                f"task {name}: the lock server is in its restart grace ({grace}): it grants no "
                f"key until the leases its previous run may have granted have ended, so key "
                f"{key!r} cannot be held from publish"
            )
            return _no_hold(task_id, key, options, what, in_canvas=in_canvas)
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
            return Follow(key, holder, None)
        if holder is None:
            error = (
                f"task {name} was not sent: key {key!r} is held by a holder that names no "
                f"Celery task (its note: {busy.holder or '_'!r}; a lock taken outside Celery, "
                f"or a message sent by an older celery-dflock), so there is no result to "
                f"return; the key frees when that holder releases it"
            )
        else:
            error = (
                f"task {name} was not sent: key {key!r} is held by task {holder}{where} "
                f"(lock_from='publish', on_duplicate='raise'); AsyncResult({holder!r}) "
                f"follows it"
            )
        if in_canvas:
            return Follow(key, holder, error)
        raise errors.AlreadyQueued(error, task_id=holder, key=key) from busy
    return PublishHold(hold, HoldRef(hold.key, hold.token).header(), lease)


def _grace(client: Client) -> str | None:
    """Each server in its restart grace (``"127.0.0.1:6388: 212 s left (reason)"``), or None."""
    found: list[str] = []
    for status in client.stats():
        stats = status.stats or {}
        if isinstance(left := stats.get("grace_remaining_s"), int | float) and left > 0:
            reason = stats.get("grace_reason")
            why = f" ({reason})" if isinstance(reason, str) and reason else ""
            found.append(f"{status.address}: {left:.0f} s left{why}")
    return "; ".join(found) or None


def _no_hold(
    task_id: str, key: str, options: LockOptions, what: str, *, in_canvas: bool
) -> Follow | None:
    """No hold can be taken and no holder refused it. ``on_duplicate="return"``: sent
    without a hold (None); ``"raise"``: nothing is sent (`ServerUnavailable`, or a failing
    follower for a canvas member)."""
    if options.on_duplicate == "return":
        logger.warning(
            "dflock: %s; task %s sent without a hold (its run still takes the key; a "
            "duplicate may be sent meanwhile). A lease journal (--state-dir) keeps holds "
            "across restarts",
            what,
            task_id,
        )
        return None
    error = (
        f"{what}; nothing was sent (on_duplicate='raise'): send it again once the server "
        f"grants keys (`celery dflock status`)"
    )
    if in_canvas:
        return Follow(key, None, error)
    raise errors.ServerUnavailable(error)


def retry_hand_off(
    task: Any, request: Any, *, countdown: float | None, eta: Any, max_retries: int | None
) -> HoldRef | None:
    """Before ``task.retry``: hand a publish-time hold on to the retry message and return it
    for its header; any other run's lock is released (None). A run that took no lock (an
    error taking it, retried by ``autoretry_for``) passes its message's hold on untouched."""
    lock = held_lock(request)
    options = held_options(request)
    held = hold_of(header(request, HOLD_HEADER))
    sent = not (request.is_eager or request.called_directly)
    limit = task.max_retries if max_retries is None else max_retries
    last = limit is not None and int(request.retries or 0) + 1 > limit  # Celery will not send
    if lock is None:
        return held if sent and not last else None
    if (
        options is None
        or held is None
        or not sent
        or last
        or not isinstance(lock, DistributedLock)
        or lock.token != held.token
    ):
        lock.release()
        return None
    if eta is None and countdown is None:  # as Task.retry works it out
        countdown = cast("float | None", getattr(task, "default_retry_delay", None))
    return hand_off_hold(task, request, lock, held, options, countdown=countdown, eta=eta)


def hand_off_hold(
    task: Any,
    request: Any,
    lock: DistributedLock,
    held: HoldRef,
    options: LockOptions,
    *,
    countdown: float | None = None,
    eta: Any = None,
) -> HoldRef | None:
    """Detach the hold ``lock`` took over (``held``) with the longest pending lease the server
    grants, for the run of the next message to take over: a retry's (due after ``countdown`` or
    at ``eta``), or this one requeued by ``Reject(requeue=True)`` (acks_late; its `HOLD_HEADER`
    unchanged). ``held``, or None when it cannot be kept: released (or, the server unreachable,
    left to its lease), with a warning."""
    leases = _pending_leases(options, countdown, eta, getattr(request, "expires", None))
    lease = leases[-1]
    try:
        handed, lease = _longest_granted(leases, lock.hand_off)
        if handed:
            return held
    except errors.InvalidValueError:  # above the server's longest lease: refused before it let go
        lock.release()
    else:  # lost meanwhile, or refused by the server (the grant stays bound): let it go
        with suppress(errors.DflockError):  # unreachable: it ends with its lease
            app_client(task._get_app()).release(held.key, held.token)
    logger.warning(
        "dflock: %s[%s] goes on in its next message (a retry's, or itself requeued by a Reject) "
        "without its hold of %r: the lock server refused to keep it %s s (lock_pending_ttl, or "
        "the retry's countdown/eta when longer), or it was lost; that run takes the key when it "
        "runs, and a duplicate may be sent meanwhile. A lease above the server's --max-lease-ttl "
        "(DFLOCKD_MAX_LEASE_TTL_S) is refused: raise it",
        task.name,
        request.id,
        held.key,
        lease,
    )
    return None


_Asked = TypeVar("_Asked")
_FAR_OFF_S: Final = 1e15  # a delay past any lease a server grants (its lease is refused)


def _pending_leases(
    options: LockOptions, countdown: object, eta: object, expires: object = None
) -> tuple[int, ...]:
    """The leases to ask for the hold of a message sent with ``countdown`` or ``eta``, longest
    first: ``lock_pending_ttl`` from when it is due (a due message may wait in the queue as
    any other), then, for a server whose ``--max-lease-ttl`` is shorter, until it is due or
    ``lock_pending_ttl``, whichever is later. Celery sends it due at its countdown when both
    are given. None outlives the message's ``expires``: no run can start after it, and a
    broker that drops an expired message itself (RabbitMQ) leaves no worker to free it."""
    if isinstance(countdown, int | float) and not isinstance(countdown, bool) and countdown:
        delay_s = max(0.0, float(countdown))  # (a NaN: 0)
    else:
        delay_s = _seconds_until(eta) or 0.0
    delay = max(0, math.ceil(min(delay_s, _FAR_OFF_S)))  # (inf: refused by its lease, by name)
    pending = options.pending_ttl  # a Lease naming where it was set (or its default)
    if not delay:
        leases: tuple[int, ...] = (pending,)
    else:
        due = "the message's countdown/eta"  # named by a refusal, as a setting is
        leases = (
            Lease(delay + pending, f"{due} plus lock_pending_ttl"),
            pending if pending >= delay else Lease(delay, due),
        )
    if isinstance(expires, int | float) and not isinstance(expires, bool):
        expires_s: float | None = float(expires)  # seconds from now, as Celery reads it
    else:
        expires_s = _seconds_until(expires)
    if expires_s is None or not math.isfinite(expires_s):
        return leases
    until = Lease(max(1, math.ceil(expires_s)), "the message's expires")
    return tuple(until if until < lease else lease for lease in leases)


def _seconds_until(when: object) -> float | None:
    """Seconds from now to ``when`` (a datetime or its ISO text; a naive one is UTC, as Celery
    reads an eta), or None for anything else."""
    if isinstance(when, str):
        try:
            when = datetime.fromisoformat(when)
        except ValueError:
            return None
    if not isinstance(when, datetime):
        return None
    tz = when.tzinfo or UTC
    return (when.replace(tzinfo=tz) - datetime.now(tz)).total_seconds()


def _longest_granted(leases: tuple[int, ...], ask: Callable[..., _Asked]) -> tuple[_Asked, int]:
    """``ask(lease_ttl=lease)`` with the first of ``leases`` the server's ``--max-lease-ttl``
    allows (a longer one is refused before anything is sent), and that lease; the last one's
    refusal is raised."""
    *longer, last = leases
    for lease in longer:
        with suppress(errors.InvalidValueError):
            return ask(lease_ttl=lease), lease
    return ask(lease_ttl=last), last


_FOLLOW_GONE_HEADER: Final = "dflock_follow_gone"  # set on a follower resent, its holder gone


def run_follower(message: Message, follow: Follow) -> Any:
    """The holder's value, or its error raised; fails when the holder let the key go with no
    result twice in a row."""
    run, request = message.label, message.request
    if follow.error is not None or follow.task_id is None:
        raise errors.AlreadyQueued(
            f"{run} was sent in place of a duplicate: {follow.error}",
            task_id=follow.task_id,
            key=follow.key,
        )
    app: Any = message.task._get_app()
    holder: Any = app.AsyncResult(follow.task_id)
    try:
        ready = bool(holder.ready())
    except NotImplementedError:
        raise errors.DflockError(
            f"{run} stands in for task {follow.task_id}, which holds key {follow.key!r}, but "
            f"this app has no result backend to read its result from: configure "
            f"result_backend, or send canvas members of a lock_from='publish' task with "
            f"on_duplicate='raise'"
        ) from None
    if ready:  # the holder's result as this run's: its value, or its error raised
        if holder.successful():
            return holder.result
        error: object = holder.result
        if isinstance(error, BaseException):
            raise error
        raise errors.DflockError(
            f"{run} stands in for task {follow.task_id} (key {follow.key!r}), which ended in "
            f"state {holder.state}: {error!r}"
        )
    polls = message.retries
    gone = _key_left(app, follow, encode_note(message.task_id, name=str(message.task.name)))
    if gone and header(request, _FOLLOW_GONE_HEADER):
        raise errors.DflockError(
            f"{run} stands in for task {follow.task_id}, which no longer holds key "
            f"{follow.key!r} and left no result (revoked, lost, its hold ran out before "
            f"it ran, or it keeps none: ignore_result)"
        )
    extra = {_FOLLOW_GONE_HEADER: True} if gone else {}
    countdown = backoff(0.25, polls, 5.0)
    logger.info(
        "dflock: %s stands in for task %s (key %r), not done yet; looking again in %.2fs",
        run,
        follow.task_id,
        follow.key,
        countdown,
    )
    busy = errors.LockNotAcquired(f"{run}: task {follow.task_id} holding key {follow.key!r} runs")
    raise resend(message, countdown=countdown, retries=polls + 1, busy=busy, extra=extra)


def _key_left(app: Any, follow: Follow, note: str | None) -> bool:
    """Whether the holder no longer holds ``follow.key`` (taken and let go at once here)."""
    lock = app_client(app).lock(follow.key, acquire_timeout_s=0, note=note)
    try:
        if lock.acquire():
            lock.release()
            return True
    except errors.DflockError:
        return False  # unknown: look again later
    return note_parts(lock.holder).task_id != follow.task_id  # an older publisher's too
