"""A task's plan: whether its runs are locked, and their lock options, resolved once per task
and process.

A lock option is resolved the way Celery resolves its own task options, first match wins:
call option > ``dflock_task_locks`` entry > task attribute > ``app.conf.dflock_*`` setting >
built-in default (`resolve_options`; the table of options: `celery_dflock._specs`). A run
without call options reuses its task's `TaskRuns` (kept by the app's
`celery_dflock._runtime.Runtime`, so a pool child works its own out and the task object stays
stateless): the plan, and the task's `KeyBuilder`, while the config and every lock attribute
are the same objects.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from operator import is_
from types import MethodType
from typing import Any, Final, cast

from celery_dflock._specs import (
    DEFAULT_PENDING_TTL_S,
    LOCK_OPTIONS,
    check_combination,
    validate_option,
)
from celery_dflock._values import LockFrom, OnDuplicate, OnLocked, OnLockLost
from celery_dflock.config import DflockConfig
from celery_dflock.keys import KeyBuilder

__all__ = ["RETRY_WAIT_S", "LockOptions", "TaskRuns", "options_for", "resolve_options"]

RETRY_WAIT_S: Final = 30.0
"""The default ``lock_timeout`` of ``on_locked="retry"``: a run waits this long in its key's
FIFO queue (taking the key the moment the holder lets go) before it is sent again with a
countdown."""


def default_timeout(on_locked: str) -> float:
    """``lock_timeout`` when none is set: `RETRY_WAIT_S` for ``"retry"``, else 0 (``"skip"``
    and ``"raise"`` give up at once)."""
    return RETRY_WAIT_S if on_locked == "retry" else 0.0


@dataclass(frozen=True, slots=True)
class LockOptions:
    """The lock options of one task run, every layer resolved."""

    key: str | Callable[..., str] | None
    timeout: float
    ttl: int | None
    on_locked: OnLocked
    limit: int | None
    on_lock_lost: OnLockLost
    retry_countdown: float
    retry_backoff_max: float
    retry_jitter: bool
    max_retries: int | None = None
    lock_from: LockFrom = "run"
    on_duplicate: OnDuplicate = "return"
    pending_ttl: int = DEFAULT_PENDING_TTL_S
    timeout_given: bool = True
    """Whether ``lock_timeout`` was set (False: ``timeout`` is `default_timeout`'s)."""


def resolve_options(
    config: DflockConfig,
    task_name: str,
    attributes: Mapping[str, object],
    call: Mapping[str, object] | None = None,
) -> LockOptions:
    """Resolve every lock option: call > dflock_task_locks > attribute > app.conf > default.

    ``attributes`` are the task's lock attributes (None means unset). Values
    from ``config`` were validated when it was read; attributes and call
    options are validated here.
    """
    entry = config.task_locks.get(task_name, {})
    resolved: dict[str, object] = {}
    for name in LOCK_OPTIONS:
        if call and call.get(name) is not None:
            value = validate_option(name, call[name], f"call option {name} of {task_name!r}")
        elif entry.get(name) is not None:
            value = entry[name]
        elif attributes.get(name) is not None:
            value = validate_option(
                name, attributes[name], f"attribute {name} of task {task_name!r}"
            )
        else:
            value = config.defaults[name]
        resolved[name] = value
    check_combination(resolved, f"lock options of task {task_name!r}")
    return LockOptions(
        key=cast("str | Callable[..., str] | None", resolved["lock_key"]),
        timeout=(
            default_timeout(str(resolved["on_locked"]))
            if resolved["lock_timeout"] is None
            else float(cast("float", resolved["lock_timeout"]))
        ),
        ttl=cast("int | None", resolved["lock_ttl"]),
        on_locked=cast("OnLocked", resolved["on_locked"]),
        limit=cast("int | None", resolved["lock_limit"]),
        on_lock_lost=cast("OnLockLost", resolved["on_lock_lost"]),
        retry_countdown=cast("float", resolved["lock_retry_countdown"]),
        retry_backoff_max=cast("float", resolved["lock_retry_backoff_max"]),
        retry_jitter=cast("bool", resolved["lock_retry_jitter"]),
        max_retries=cast("int | None", resolved["lock_max_retries"]),
        lock_from=cast("LockFrom", resolved["lock_from"]),
        on_duplicate=cast("OnDuplicate", resolved["on_duplicate"]),
        pending_ttl=cast("int", resolved["lock_pending_ttl"]),
        timeout_given=resolved["lock_timeout"] is not None,
    )


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
        if self.config is not config:
            return False
        # Every attribute the very object it was (the usual case), compared in C; else each
        # by `_same` (a function-valued attribute is a new bound method at every access).
        return all(map(is_, self.attributes, attributes)) or all(
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


def options_for(
    task: Any, config: DflockConfig, runs: TaskRuns, per_call: Mapping[str, object]
) -> LockOptions | None:
    """The lock options of a run (or a publish) of ``task``; None when it is not locked
    (``runs``: what the runs of ``task`` reuse in this process, `Runtime.task_runs`)."""
    name = str(task.name)
    attributes = tuple([getattr(task, option, None) for option in LOCK_OPTIONS])
    if per_call:  # per call: resolved every time (they must win)
        given = dict(zip(LOCK_OPTIONS, attributes, strict=True))
        return resolve_options(config, name, given, per_call)
    return runs.plan_for(task, config, attributes).options
