# pyright: reportMissingTypeStubs=false
"""``LockedTask``: a distributed lock around every run of a Celery task.

The lock is taken in the worker when the task *executes* (in ``__call__``,
where a refusal can still stop the run), renewed by a thread while the body
runs, and released on every way the run ends. The options and examples:
docs/locked-tasks.md; every option with its default: docs/reference/settings.md.
"""

from __future__ import annotations

import difflib
import os
import random
import signal
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MethodType, TracebackType
from typing import Any, ClassVar, Final, cast

from celery import Task

from celery_dflock import signals
from celery_dflock._celery import (
    BaseTask,
    Reject,
    Retry,
    backoff_interval,
    get_logger,
    get_task_logger,
    task_stack,
)
from celery_dflock._interrupt import BodyTarget, current_body
from celery_dflock._runtime import AnyLock, HeldRecord, Runtime, get_runtime
from celery_dflock.config import (
    LOCK_OPTIONS,
    DflockConfig,
    LockOptions,
    OnLockLost,
    check_call_options,
    get_config,
    resolve_options,
    validate_option,
)
from celery_dflock.errors import (
    DflockError,
    LimitMismatchError,
    LockLost,
    LockNotAcquired,
    LockSkipped,
)
from celery_dflock.keys import KeyBuilder, check_template

__all__ = ["LOCK_OPTIONS_HEADER", "LOCK_RETRIES_HEADER", "LockedTask", "apply_task_locks"]

logger: Any = get_task_logger(__name__)
"""For messages logged while the task runs (Celery prefixes them with ``name[id]``)."""
worker_logger: Any = get_logger("celery_dflock.worker")
"""For messages from the renewal thread, where Celery's task prefix would read ``???[???]``
(the message names the run itself)."""

LOCK_OPTIONS_HEADER: Final = "dflock_options"
"""Message header carrying per-call lock options (``apply_async(..., lock_ttl=60)``)."""
LOCK_RETRIES_HEADER: Final = "dflock_lock_retries"
"""Message header counting the retries ``on_locked="retry"`` made (Celery's ``retries`` is
left to the task's own retries)."""

_REQUEST_LOCK: Final = "dflock_lock"
_REQUEST_KEY: Final = "dflock_key"
_REQUEST_FENCE: Final = "dflock_fence"
_REQUEST_TOKEN: Final = "dflock_token"
_MAX_BACKOFF_EXPONENT: Final = 32
_PLAN_ATTR: Final = "_dflock_plan"
_KEYS_ATTR: Final = "_dflock_keys"


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


class _Interrupted(LockLost):
    """Raised asynchronously in the body's thread by ``on_lock_lost="interrupt"``."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(args or ("the task's lock was lost while it ran",)))


class _RunGuard:
    """One locked run: its lock, the body's thread, and the ``on_lock_lost`` policy."""

    def __init__(
        self,
        task: LockedTask,
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
        after the body if only the server's refusal to release shows it."""
        policy = self.policy
        if policy == "terminate" and not self.runtime.in_pool_child:
            policy = "interrupt"  # only a prefork child can be replaced
        with self._state:
            ended = self._body_ended
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
        if ended:
            return  # the body is over: nothing left to interrupt or terminate
        if policy == "terminate":
            if self.record is not None:
                self.record.remove()
            os.kill(os.getpid(), signal.SIGKILL)
        elif policy == "interrupt":
            with self._state:
                body = self._body
                if body is None or self._interrupt_sent:
                    return
                self._interrupt_sent = True
                if not body.interrupt(_Interrupted):
                    self._interrupt_missed = True
            if self._interrupt_missed:
                worker_logger.error(
                    "dflock: %s: the body could not be interrupted where it runs; "
                    "it fails with LockLost when it returns",
                    self.label,
                )

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

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        with self._state:
            body, self._body = self._body, None
            self._body_ended = True
            if self._interrupt_sent and body is not None:
                body.cancel()  # not delivered yet: drop it


class LockedTask(Task):
    """A task whose runs hold a distributed lock (or semaphore slot) on a key.

    Use as ``@app.task(base=LockedTask, lock_key="report:{customer_id}")`` (always
    locked), or as the app's ``task_cls`` (then only tasks with a lock option,
    or listed in ``dflock_task_locks``, are locked). Every option below may be
    given per task, per call (``apply_async(..., lock_ttl=60)``) or app-wide
    (``app.conf.dflock_*``); None means "not set here".
    """

    #: Lock key: a format template over the task's arguments (``"report:{customer_id}"``,
    #: defaults applied), a callable taking the task's arguments, or None for
    #: ``<task name>:<digest of all arguments>``.
    lock_key: ClassVar[str | Callable[..., str] | None] = None
    #: Seconds to wait in the key's FIFO queue before ``on_locked`` applies (default 0).
    lock_timeout: ClassVar[float | None] = None
    #: Lease in seconds, renewed while the body runs (default: the server's, 33 s).
    lock_ttl: ClassVar[int | None] = None
    #: When the lock is busy: ``"retry"`` (default), ``"skip"`` or ``"raise"``.
    on_locked: ClassVar[str | None] = None
    #: Let up to this many runs per key proceed at once (a semaphore); None: a lock.
    lock_limit: ClassVar[int | None] = None
    #: When the lock is lost mid-run: ``"interrupt"`` (default), ``"flag"`` or ``"terminate"``.
    on_lock_lost: ClassVar[str | None] = None
    #: First retry countdown of ``on_locked="retry"``, doubled per retry (default 1 s).
    lock_retry_countdown: ClassVar[float | None] = None
    #: Longest retry countdown (default 60 s).
    lock_retry_backoff_max: ClassVar[float | None] = None
    #: Randomise each countdown between half and all of it (default True).
    lock_retry_jitter: ClassVar[bool | None] = None

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Install the worker hooks and check a template key as soon as the task is bound."""
        BaseTask.on_bound.__func__(cls, app)
        signals.install(app)
        cls.throws = _with_skip(getattr(cls, "throws", ()))
        template = cls.lock_key
        run: Any = cls.__dict__.get("run")
        name: Any = cls.__dict__.get("name")
        for option in LOCK_OPTIONS:  # a bad value fails here, not at every run in the worker
            value = getattr(cls, option, None)
            if value is not None:
                validate_option(option, value, f"attribute {option} of task {name or cls!r}")
        if isinstance(template, str) and callable(run) and isinstance(name, str):
            check_template(template, cast("Callable[..., Any]", run), task_name=name)

    # ------------------------------------------------------------------ public surface

    @property
    def lock(self) -> AnyLock | None:
        """The lock held by the current run (``.fence``, ``.lost``, ``.lost_event``), or None."""
        return cast("AnyLock | None", getattr(self._celery.request, _REQUEST_LOCK, None))

    def apply_async(  # noqa: PLR0917 (Celery's signature)
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: str | None = None,
        **options: Any,
    ) -> Any:
        """As :meth:`celery.Task.apply_async`; lock options given here apply to this call."""
        lock_options = {name: options.pop(name) for name in LOCK_OPTIONS if name in options}
        if lock_options:
            checked = check_call_options(lock_options, f"apply_async options of {self._name!r}")
            headers = dict(cast("Mapping[str, Any]", options.pop("headers", None) or {}))
            headers[LOCK_OPTIONS_HEADER] = checked
            options["headers"] = headers
        return BaseTask.apply_async(
            self, args, kwargs, task_id, producer, link, link_error, shadow, **options
        )

    def retry(  # noqa: PLR0917 (Celery's signature)
        self,
        args: Any = None,
        kwargs: Any = None,
        exc: BaseException | None = None,
        throw: bool = True,
        eta: Any = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Any:
        """As :meth:`celery.Task.retry`, but the lock is released before the retry is sent."""
        self._release_current()
        request = self._celery.request
        call_options = _call_options(request)
        if call_options:
            headers = dict(cast("Mapping[str, Any]", options.pop("headers", None) or {}))
            request_headers: Any = request.headers
            if isinstance(request_headers, Mapping):
                headers = {**cast("Mapping[str, Any]", request_headers), **headers}
            headers[LOCK_OPTIONS_HEADER] = call_options
            options["headers"] = headers
        return BaseTask.retry(
            self, args, kwargs, exc, throw, eta, countdown, max_retries, **options
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        task = self._celery
        stack = task.request_stack
        request = stack.top
        if (
            request is not None
            and not request._protected
            and len(stack) == 1
            and not request.called_directly
        ):
            # Called by the worker's (or apply()'s) tracer, which pushed the request.
            request._protected = 1
            return self._locked_run(request, args, kwargs)
        # A direct call, task(...): push a request the way Task.__call__ does.
        task_stack.push(self)
        task.push_request(args=args, kwargs=kwargs)
        try:
            return self._locked_run(task.request, args, kwargs)
        finally:
            task.pop_request()
            task_stack.pop()

    # ------------------------------------------------------------------ internals

    @property
    def _celery(self) -> Any:
        """This task as Celery's untyped object."""
        return self

    @property
    def _name(self) -> str:
        return str(self._celery.name)

    def _lock_attributes(self) -> dict[str, object]:
        return {name: getattr(self, name, None) for name in LOCK_OPTIONS}

    def _is_locked(self, config: DflockConfig, call_options: Mapping[str, object]) -> bool:
        if call_options or self._name in config.task_locks:
            return True
        if any(value is not None for value in self._lock_attributes().values()):
            return True
        # base=LockedTask named explicitly: always locked. Inherited only through the
        # app's task_cls: locked only with a lock option (checked above).
        app_task_cls: Any = self._celery._get_app().Task
        return not isinstance(self, app_task_cls)

    def _plan(self, config: DflockConfig) -> _Plan:
        """Locked or not, and the options, for a run without call options (cached)."""
        attributes = tuple(getattr(self, name, None) for name in LOCK_OPTIONS)
        plan = cast("_Plan | None", self.__dict__.get(_PLAN_ATTR))
        if plan is not None and plan.fits(config, attributes):
            return plan
        locked = self._is_locked(config, {})
        options = None
        if locked:
            given = dict(zip(LOCK_OPTIONS, attributes, strict=True))
            options = resolve_options(config, self._name, given, None)
        plan = _Plan(config, attributes, locked, options)
        self.__dict__[_PLAN_ATTR] = plan
        return plan

    def _key_builder(self, source: object, run: Callable[..., Any], prefix: str) -> KeyBuilder:
        """The `KeyBuilder` for this task's runs (its signature is inspected once)."""
        func: object = getattr(run, "__func__", run)
        owner: object = getattr(run, "__self__", None)
        keys = cast("_Keys | None", self.__dict__.get(_KEYS_ATTR))
        if keys is not None and keys.fits(source, func, owner, prefix):
            return keys.builder
        builder = KeyBuilder(cast("Any", source), task_name=self._name, run=run, prefix=prefix)
        self.__dict__[_KEYS_ATTR] = _Keys(builder, func, owner)
        return builder

    def _locked_run(self, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        task = self._celery
        app: Any = task._get_app()
        config = get_config(app)
        call_options = _call_options(request)
        run: Callable[..., Any] = task.run
        name = self._name
        if call_options:  # per call: resolved every time (they must win)
            options = resolve_options(config, name, self._lock_attributes(), call_options)
        else:
            plan = self._plan(config)
            if plan.options is None:
                return run(*args, **kwargs)
            options = plan.options
        key = self._key_builder(options.key, run, config.key_prefix).key(args, kwargs)
        runtime = get_runtime(app)
        task_id = cast("str | None", request.id)
        guard = _RunGuard(self, task_id, key, options.on_lock_lost, runtime)
        wait_s = options.timeout
        if options.on_locked == "retry" and request.is_eager:
            # Eager retries run at once; wait out the countdown in the queue instead.
            wait_s = max(wait_s, self._retry_countdown(_lock_retries(request), options))
        lock = runtime.new_lock(
            config, key, options, acquire_timeout_s=wait_s, on_lost=guard.on_lost
        )
        try:
            acquired = lock.acquire()
        except LimitMismatchError as exc:  # the key is busy with another lock_limit
            return self._contended(request, key, options, args, kwargs, mismatch=exc)
        except DflockError as exc:  # the server unreachable, refusing, draining, ...
            self._autoretry(request, exc)
            raise
        if not acquired:
            return self._contended(request, key, options, args, kwargs)
        guard.lock = lock
        request.dflock_lock = lock
        request.dflock_key = key
        request.dflock_fence = lock.fence
        request.dflock_token = lock.token
        if runtime.in_pool_child and task_id:
            writer = runtime.held_writer()
            if writer is not None:
                guard.record = writer.add(task_id, lock, options.limit)
        try:
            try:
                with guard.body():
                    result = run(*args, **kwargs)
            except _Interrupted:
                raise LockLost(
                    f"{_run_name(name, task_id)} lost its lock {key!r} (fence {lock.fence}) "
                    f"while it ran, and was interrupted (on_lock_lost='interrupt')"
                ) from None
            # The lock may be marked lost a moment before on_lost runs: the body can see it and
            # return first. Only "flag" lets a body that saw its lock lost end normally.
            if guard.interrupt_due or (lock.lost and options.on_lock_lost != "flag"):
                raise LockLost(
                    f"{_run_name(name, task_id)} lost its lock {key!r} (fence {lock.fence}) "
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
                for attr in (_REQUEST_LOCK, _REQUEST_KEY, _REQUEST_FENCE, _REQUEST_TOKEN):
                    setattr(request, attr, None)

    def _release_current(self) -> None:
        lock = self.lock
        if lock is not None:
            lock.release()

    def _retry_countdown(self, retries: int, options: LockOptions) -> float:
        countdown = min(
            options.retry_countdown * (2 ** min(retries, _MAX_BACKOFF_EXPONENT)),
            options.retry_backoff_max,
        )
        if options.retry_jitter:
            countdown = countdown / 2 + random.uniform(0, countdown / 2)
        return countdown

    def _autoretry(self, request: Any, exc: DflockError) -> None:
        """Give an error taking the lock the task's ``autoretry_for`` treatment.

        Celery's ``autoretry_for`` wraps the task body only, and the lock is taken before the
        body: without this, ``autoretry_for=(ServerUnavailable,)`` would not cover an outage
        of the lock server. Retries (``self.retry``, so ``retry_kwargs``, ``retry_backoff``,
        ``retry_backoff_max``, ``retry_jitter`` and ``max_retries`` apply as Celery applies
        them) when the task names the error; returns otherwise, and the caller re-raises.
        """
        task = self._celery
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
        self,
        request: Any,
        key: str,
        options: LockOptions,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        mismatch: LimitMismatchError | None = None,
    ) -> Any:
        """The key is busy: held by other runs, or (``mismatch``) in use with another limit.

        A key is one resource on the server (a lock is a semaphore of limit 1), so runs with
        another ``lock_limit`` on the key keep it busy like any holder; the server refuses at
        once instead of queueing, and ``on_locked`` applies as for a busy key."""
        run = _run_name(self._name, request.id)
        task_id = cast("str | None", request.id)
        if mismatch is None:
            why = f"lock {key!r} is held by another run"
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
                sender=self, task_id=task_id, key=key, args=args, kwargs=kwargs
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
        countdown = self._retry_countdown(done, options)
        logger.info(
            "dflock: %s retries in %.2fs: lock %r is busy (lock retry %d of %s)",
            run,
            countdown,
            key,
            done + 1,
            "no limit" if limit is None else limit,
        )
        raise self._lock_retry(request, (args, kwargs), countdown, done + 1, busy)

    def _lock_retry(
        self,
        request: Any,
        call: tuple[tuple[Any, ...], dict[str, Any]],
        countdown: float,
        retries: int,
        busy: LockNotAcquired,
    ) -> BaseException:
        """Send the run again in ``countdown`` s, as ``Task.retry`` does, but count it in
        `LOCK_RETRIES_HEADER` instead of Celery's ``retries``: a busy key never uses up the
        task's ``max_retries``, which are left to its own retries."""
        task = self._celery
        headers = _request_headers(request)
        headers[LOCK_RETRIES_HEADER] = retries
        call_options = _call_options(request)
        if call_options:
            headers[LOCK_OPTIONS_HEADER] = call_options
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


def _with_skip(throws: object) -> tuple[type[BaseException], ...]:
    """A task's ``throws`` with `LockSkipped` in it (an expected error: INFO, no traceback)."""
    given = tuple(cast("tuple[type[BaseException], ...]", throws or ()))
    return given if LockSkipped in given else (*given, LockSkipped)


def _call_options(request: Any) -> dict[str, object]:
    """Per-call lock options of the current request (message header or eager headers)."""
    raw = _header(request, LOCK_OPTIONS_HEADER)
    if not raw:
        return {}
    return check_call_options(
        cast("Mapping[str, object]", raw), f"call options of task {getattr(request, 'task', '?')!r}"
    )


def apply_task_locks(app: Any) -> list[str]:
    """Make the tasks named in ``dflock_task_locks`` locked tasks, without editing them.

    Each such task that is not a :class:`LockedTask` gets its class swapped for
    a subclass that puts ``LockedTask`` first in its bases. Returns the names of
    the tasks changed. Runs from the worker hooks (see :mod:`celery_dflock.signals`), which
    also warn about names no task has (`unknown_task_locks`).
    """
    config = get_config(app)
    changed: list[str] = []
    tasks: Mapping[str, Any] = app.tasks
    for name in config.task_locks:
        task = tasks.get(name)
        if task is None:
            continue
        if isinstance(task, LockedTask):
            continue
        original: Any = task.__class__
        locked_cls = type(
            original.__name__,
            (LockedTask, original),
            {
                "__module__": original.__module__,
                "__qualname__": original.__qualname__,
                "throws": _with_skip(getattr(original, "throws", ())),
            },
        )
        task.__class__ = locked_cls
        changed.append(name)
    return changed


def unknown_task_locks(app: Any) -> list[str]:
    """A warning for each ``dflock_task_locks`` entry that names no task of ``app`` (a typo
    there would leave the task unlocked without a word), with the close matches."""
    tasks = [str(name) for name in app.tasks]
    warnings: list[str] = []
    for name in get_config(app).task_locks:
        if name in tasks:
            continue
        close = difflib.get_close_matches(name, tasks, n=3, cutoff=0.5)
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        warnings.append(
            f"dflock_task_locks names {name!r}, which no task of this app has, so it is not "
            f"locked{hint}"
        )
    return warnings
