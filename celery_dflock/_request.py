"""What a locked run reads from and writes on Celery's request: the message headers of the
lock (per-call options, lock retries; queue-once's hold and follow headers are in
`celery_dflock._holds`), and the request attributes of the lock the run holds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final, cast

from celery_dflock._held_records import AnyLock
from celery_dflock._plan import LockOptions
from celery_dflock._specs import check_call_options

__all__ = [
    "LOCK_OPTIONS_HEADER",
    "LOCK_RETRIES_HEADER",
    "OUTAGE_HEADER",
    "REQUEST_LOCK",
    "call_options",
    "clear_held",
    "header",
    "held_lock",
    "held_options",
    "lock_retries",
    "mark_held",
    "release_current",
    "request_headers",
    "run_name",
]

LOCK_OPTIONS_HEADER: Final = "dflock_options"
"""Message header carrying per-call lock options (``apply_async(..., lock_ttl=60)``)."""
LOCK_RETRIES_HEADER: Final = "dflock_lock_retries"
"""Message header counting the retries ``on_locked="retry"`` made (Celery's ``retries`` is
left to the task's own retries)."""
OUTAGE_HEADER: Final = "dflock_outage"
"""Message header of a run sent again because its lock server was unreachable
(`celery_dflock._outage`): ``{"since": <epoch seconds the outage was first met>,
"retries": <outage retries so far>}``."""

REQUEST_LOCK: Final = "dflock_lock"
"""The request attribute holding the current run's lock (``LockedTask.lock``)."""
_REQUEST_KEY: Final = "dflock_key"
_REQUEST_FENCE: Final = "dflock_fence"
_REQUEST_TOKEN: Final = "dflock_token"
REQUEST_OPTIONS: Final = "dflock_run_options"
"""The request attribute holding the current run's resolved `LockOptions`."""
_REQUEST_ATTRS: Final = (
    REQUEST_LOCK,
    _REQUEST_KEY,
    _REQUEST_FENCE,
    _REQUEST_TOKEN,
    REQUEST_OPTIONS,
)


def run_name(name: str, task_id: object) -> str:
    """``task NAME[ID]``, or ``task NAME (called directly)`` for a run without an id."""
    return f"task {name}[{task_id}]" if task_id else f"task {name} (called directly)"


def _headers(request: Any) -> Mapping[str, Any] | None:
    """``request.headers`` when it is a mapping (not copied), else None."""
    headers = getattr(request, "headers", None)
    return cast("Mapping[str, Any]", headers) if isinstance(headers, Mapping) else None


def request_headers(request: Any) -> dict[str, Any]:
    headers = _headers(request)
    return {} if headers is None else dict(headers)


def header(request: Any, name: str) -> object:
    """A message header of the current request (a request attribute on a worker, an entry of
    ``request.headers`` in eager runs)."""
    value = getattr(request, name, None)
    if value is None and (headers := _headers(request)) is not None:
        value = headers.get(name)
    return cast("object", value)


def lock_retries(request: Any) -> int:
    value = header(request, LOCK_RETRIES_HEADER)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def call_options(request: Any) -> dict[str, object]:
    """Per-call lock options of the current request (message header or eager headers)."""
    raw = header(request, LOCK_OPTIONS_HEADER)
    if not raw:
        return {}
    return check_call_options(
        cast("Mapping[str, object]", raw), f"call options of task {getattr(request, 'task', '?')!r}"
    )


def mark_held(request: Any, key: str, lock: AnyLock, options: LockOptions) -> None:
    """Record the run's lock on its request (``LockedTask.lock``, ``request.dflock_fence``, ...)."""
    setattr(request, REQUEST_LOCK, lock)
    setattr(request, _REQUEST_KEY, key)
    setattr(request, _REQUEST_FENCE, lock.fence)
    setattr(request, _REQUEST_TOKEN, lock.token)
    setattr(request, REQUEST_OPTIONS, options)


def clear_held(request: Any) -> None:
    """The run's lock is released: take it off the request."""
    for attr in _REQUEST_ATTRS:
        setattr(request, attr, None)


def held_lock(request: Any) -> AnyLock | None:
    """The lock the run of ``request`` holds (None: none)."""
    return cast("AnyLock | None", getattr(request, REQUEST_LOCK, None))


def held_options(request: Any) -> LockOptions | None:
    """The resolved lock options of the run of ``request``, while it holds its lock."""
    return cast("LockOptions | None", getattr(request, REQUEST_OPTIONS, None))


def release_current(request: Any) -> None:
    """Release the lock of the run ``request`` is for, if it holds one (before a retry)."""
    lock = held_lock(request)
    if lock is not None:
        lock.release()
