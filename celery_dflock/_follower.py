# pyright: reportMissingTypeStubs=false
"""A follower: the run of a canvas member of a ``lock_from="publish"`` task that was sent in
a duplicate's place (`celery_dflock._holds.FOLLOW_HEADER`). It gives the result of the task
holding the key once that is ready, polling by resending its own message with a countdown,
or fails at once with the error its publish would have raised.
"""

from __future__ import annotations

from typing import Any, Final

from celery_dflock._celery import get_task_logger
from celery_dflock._holds import Follow, decode_note, encode_note
from celery_dflock._on_locked import MAX_BACKOFF_EXPONENT, resend
from celery_dflock._request import header, lock_retries, run_name
from celery_dflock._runtime import get_runtime
from celery_dflock.client.errors import AlreadyQueued, DflockError, LockNotAcquired
from celery_dflock.config import get_config

__all__ = ["run_follower"]

logger: Any = get_task_logger("celery_dflock.task")
"""For messages logged while the task runs (Celery prefixes them with ``name[id]``)."""

_FOLLOW_GONE_HEADER: Final = "dflock_follow_gone"
"""Set on a follower resent after it found its holder gone without a result (once more, then
it fails)."""
_FOLLOW_PAUSE_S: Final = 0.25
_FOLLOW_MAX_S: Final = 5.0


def run_follower(
    task: Any, request: Any, follow: Follow, call: tuple[tuple[Any, ...], dict[str, Any]]
) -> Any:
    """The run of a canvas member sent in a duplicate's place: the holder's result once it
    is ready (its value, or its error raised), polled by resending this message with a
    countdown (no worker slot is kept while the holder runs); ``follow.error``: fail at once.

    When the holder no longer holds the key and still has no result twice in a row (it was
    revoked or lost, or keeps no result: ``ignore_result``), the run fails, saying so."""
    run = run_name(str(task.name), request.id)
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
    polls = lock_retries(request)
    if _key_left(app, follow, request.id):
        if header(request, _FOLLOW_GONE_HEADER):
            raise DflockError(
                f"{run} stands in for task {follow.task_id}, which no longer holds key "
                f"{follow.key!r} and left no result (revoked, lost, its hold ran out before "
                f"it ran, or it keeps none: ignore_result)"
            )
        extra: dict[str, object] = {_FOLLOW_GONE_HEADER: True}
    else:
        extra = {}
    countdown = min(_FOLLOW_PAUSE_S * (2 ** min(polls, MAX_BACKOFF_EXPONENT)), _FOLLOW_MAX_S)
    logger.info(
        "dflock: %s stands in for task %s (key %r), not done yet; looking again in %.2fs",
        run,
        follow.task_id,
        follow.key,
        countdown,
    )
    busy = LockNotAcquired(f"{run}: task {follow.task_id} holding key {follow.key!r} runs")
    raise resend(
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
