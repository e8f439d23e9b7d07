# pyright: reportMissingTypeStubs=false
"""The busy-key policy: what a run does when its key is held by other runs, or in use with
another ``lock_limit``, once its ``lock_timeout`` wait in the key's queue is over
(``on_locked``: ``"retry"`` with backoff and jitter, counted apart from Celery's retries;
``"skip"``; ``"raise"``), and the resend that a lock retry (and a follower's poll) is.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any, Final, cast

from celery_dflock._celery import Reject, Retry, get_task_logger
from celery_dflock._held_records import AnyLock
from celery_dflock._holds import FOLLOW_HEADER, HOLD_HEADER, decode_note
from celery_dflock._lock_signals import lock_skipped
from celery_dflock._plan import LockOptions
from celery_dflock._request import (
    LOCK_OPTIONS_HEADER,
    LOCK_RETRIES_HEADER,
    OUTAGE_HEADER,
    call_options,
    header,
    lock_retries,
    request_headers,
    run_name,
)
from celery_dflock.client import DistributedLock
from celery_dflock.client.errors import (
    DflockError,
    LimitMismatchError,
    LockNotAcquired,
    LockSkipped,
)

__all__ = ["MAX_BACKOFF_EXPONENT", "contended", "resend", "retry_countdown"]

logger: Any = get_task_logger("celery_dflock.task")
"""For messages logged while the task runs (Celery prefixes them with ``name[id]``)."""
MAX_BACKOFF_EXPONENT: Final = 32


def retry_countdown(retries: int, options: LockOptions) -> float:
    """The countdown of lock retry number ``retries + 1`` (backoff, cap, jitter)."""
    countdown = min(
        options.retry_countdown * (2 ** min(retries, MAX_BACKOFF_EXPONENT)),
        options.retry_backoff_max,
    )
    if options.retry_jitter:
        countdown = countdown / 2 + random.uniform(0, countdown / 2)
    return countdown


def contended(
    task: Any,
    request: Any,
    key: str,
    options: LockOptions,
    call: tuple[tuple[Any, ...], dict[str, Any]],
    *,
    waited_s: float,
    mismatch: LimitMismatchError | None = None,
    lock: AnyLock | None = None,
) -> Any:
    """The key is busy: held by other runs, or (``mismatch``) in use with another limit;
    ``waited_s``: how long this run waited for it (a direct call does not wait in the queue).

    A key is one resource on the server (a lock is a semaphore of limit 1), so runs with
    another ``lock_limit`` on the key keep it busy like any holder; the server refuses at
    once instead of queueing, and ``on_locked`` applies as for a busy key."""
    run = run_name(str(task.name), request.id)
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
        lock_skipped.send(
            sender=task, task_id=task_id, key=key, args=args, kwargs=kwargs, holder=holder
        )
        raise LockSkipped(
            f"{run} was skipped: {why} (waited {waited_s:.1f}s; on_locked='skip')"
        ) from mismatch
    busy = LockNotAcquired(
        f"{run}: {why} (waited {waited_s:.1f}s; on_locked={options.on_locked!r})"
    )
    busy.__cause__ = mismatch
    if options.on_locked != "retry" or request.called_directly:
        raise busy
    done = lock_retries(request)
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
    # Busy, so reached: an outage this run met before is over (its budget starts afresh).
    extra = {OUTAGE_HEADER: None}
    raise resend(task, request, call, countdown=countdown, retries=done + 1, busy=busy, extra=extra)


def resend(
    task: Any,
    request: Any,
    call: tuple[tuple[Any, ...], dict[str, Any]],
    *,
    countdown: float,
    retries: int,
    busy: DflockError,
    extra: Mapping[str, object] | None = None,
) -> BaseException:
    """Send the run again in ``countdown`` s, as ``Task.retry`` does, but count it in
    `LOCK_RETRIES_HEADER` instead of Celery's ``retries``: a busy key never uses up the
    task's ``max_retries``, which are left to its own retries (an outage retry,
    `celery_dflock._outage`, passes the count on unchanged). ``busy``: why (the `Retry`'s
    exception). ``extra``: more headers."""
    headers = request_headers(request)
    for name in (FOLLOW_HEADER, HOLD_HEADER):  # a worker's request keeps them as attributes
        value = header(request, name)
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
