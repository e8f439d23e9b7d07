# pyright: reportMissingTypeStubs=false
"""``LockedTask``: a distributed lock around every run of a Celery task.

The lock is taken in the worker when the task *executes* (in ``__call__``, where a refusal
can still stop the run), renewed by a thread while the body runs, and released on every way
the run ends (the run: `celery_dflock._run`). The options and examples: [Locked
tasks](../locked-tasks.md) and the [settings reference](../reference/settings.md).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Mapping, Sequence
from types import FunctionType
from typing import Any, ClassVar, Final, cast

from celery import Task
from celery.utils import uuid
from celery.worker.request import Request as CeleryRequest
from kombu import serialization

from celery_dflock import _worker_hooks
from celery_dflock._celery import BaseTask, Reject, task_stack
from celery_dflock._queue_once import publish_hold, retry_hand_off
from celery_dflock._request import (
    BEAT_ENTRY_HEADER,
    FOLLOW_HEADER,
    HOLD_HEADER,
    LOCK_OPTIONS_HEADER,
    LOCK_RETRIES_HEADER,
    OUTAGE_HEADER,
    Call,
    Follow,
    header,
    held_lock,
    mapping_of,
    read_message_options,
)
from celery_dflock._run import locked_run
from celery_dflock._runtime import AnyLock, app_client, check_attributes
from celery_dflock._settings import (
    LOCK_OPTIONS,
    GivenOptions,
    check_option_names,
    read_call_options,
)
from celery_dflock.client.errors import DflockError
from celery_dflock.keys import check_template

__all__ = ["LOCK_OPTIONS_HEADER", "LOCK_RETRIES_HEADER", "LockedTask", "apply_task_locks"]


class LockedRequest(CeleryRequest):
    """The worker's request for a `LockedTask` run: a pool child lost while it ran has its
    locks released also when Celery requeues its message (`_worker_hooks.request_failed`)."""

    def on_failure(self, exc_info: Any, *args: Any, **kwargs: Any) -> Any:
        request: Any = self
        _worker_hooks.request_failed(request.task, request.id, exc_info.exception)
        return cast("Any", CeleryRequest).on_failure(self, exc_info, *args, **kwargs)


_OWN_CALL: Final = "_dflock_own_call"  # where __init_subclass__ keeps a class's own __call__


class LockedTask(Task):
    """A task whose runs hold a distributed lock (or semaphore slot) on a key.

    Use as ``@app.task(base=LockedTask, lock_key="report:{customer_id}")`` (always locked),
    or as the app's ``task_cls`` (then only tasks with a lock option, or listed in
    ``dflock_task_locks``, are locked). Every lock option is a class attribute, also given
    per call (``apply_async(..., lock_timeout=5)``) or app-wide (``app.conf.dflock_*``).
    """

    # The lock options (None: not set here), a row each of `_settings.LOCK_OPTION_SPECS`.
    lock_key: ClassVar[str | Callable[..., str] | None] = None
    lock_timeout: ClassVar[float | None] = None
    lock_ttl: ClassVar[int | None] = None
    on_locked: ClassVar[str | None] = None
    lock_limit: ClassVar[int | None] = None
    on_lock_lost: ClassVar[str | None] = None
    lock_retry_countdown: ClassVar[float | None] = None
    lock_retry_backoff_max: ClassVar[float | None] = None
    lock_max_retries: ClassVar[int | None] = None
    lock_retry_jitter: ClassVar[bool | None] = None
    lock_from: ClassVar[str | None] = None
    on_duplicate: ClassVar[str | None] = None
    lock_pending_ttl: ClassVar[int | None] = None
    Request = LockedRequest

    @classmethod
    def on_bound(cls, app: Any) -> None:
        """Install the worker hooks and check a template key as soon as the task is bound."""
        BaseTask.on_bound.__func__(cls, app)
        _worker_hooks.install_hooks(app, LockedTask)
        owner = next(k for k in cls.__mro__ if "lock_key" in vars(k))
        key: object = vars(owner)["lock_key"]
        if isinstance(key, FunctionType) and key.__qualname__ != f"{owner.__qualname__}.lock_key":
            # A function set as a class attribute, here or inherited (Celery puts the options of
            # ``@app.task(lock_key=f)`` in the task's class), takes the task's arguments, not the
            # task: no method. A ``def lock_key(self, ...)`` written in the class stays one.
            cls.lock_key = cast("Any", staticmethod(key))
        cls.throws = _worker_hooks.with_skip(getattr(cls, "throws", ()))
        run: Any = cls.__dict__.get("run")
        name: Any = cls.__dict__.get("name")
        inherited = {attr for base in cls.__mro__[1:] for attr in vars(base)}
        check_option_names(
            (attr for attr in vars(cls) if not attr.startswith("_") and attr not in inherited),
            f"task {name or cls.__qualname__!r}",
        )
        # A bad value fails when the class is made, not at the first run in the worker.
        check_attributes(cls, name or cls.__qualname__)
        if isinstance(cls.lock_key, str) and callable(run) and isinstance(name, str):
            check_template(cls.lock_key, cast("Callable[..., Any]", run), task_name=name)

    @property
    def lock(self) -> AnyLock | None:
        """The lock held by the current run (``.fence``, ``.lost``, ``.lost_event``), or None."""
        return held_lock(self._celery.request)

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
        """As `celery.Task.apply_async`; lock options given here apply to this call.

        With ``lock_from="publish"`` the key is taken first: while another task holds it,
        nothing is sent and ``on_duplicate`` says what the caller gets."""
        what = f"apply_async options of {self._name!r}"
        check_option_names(options, what)
        headers, per_call, beat = self._call_options(options, options.pop("headers", None), what)
        if headers:
            options["headers"] = headers

        def send() -> Any:
            return self._base.apply_async(
                args, kwargs, task_id, producer, link, link_error, shadow, **options
            )

        if HOLD_HEADER in headers or self._celery._get_app().conf.task_always_eager:
            # Sent again (a retry, with the hold handed on or None), or run here: no hold.
            return send()
        in_canvas = options.get("chain") is not None or bool(  # a chain's last: ``chain=[]``
            link or link_error or options.get("chord") or options.get("group_id")
        )
        task_id = task_id or uuid()
        if per_call is None and (sent_options := headers.get(LOCK_OPTIONS_HEADER)):
            what = f"lock options of a message of {self._name!r}"
            per_call, beat = read_message_options(sent_options, what)
        taken = publish_hold(
            self,
            self._as_sent(args, kwargs, options),
            per_call,
            str(task_id),  # Celery takes any id (an int too): the note holds it as text
            countdown=options.get("countdown"),
            eta=options.get("eta"),
            expires=options.get("expires", getattr(self, "expires", None)),  # as Celery reads it
            in_canvas=in_canvas,
            beat=beat,
        )
        if taken is None:
            return send()
        options["headers"] = headers
        if isinstance(taken, Follow):
            if not in_canvas and taken.task_id is not None:
                return self._celery.AsyncResult(taken.task_id)
            # A canvas member's id is already in its canvas's result: send a follower.
            headers.update({FOLLOW_HEADER: taken.header(), HOLD_HEADER: None})
            return send()
        headers[HOLD_HEADER] = taken.header
        try:
            sent = send()
        except BaseException:
            # Nothing was sent: the key must not wait for it (else it frees with its connection).
            with contextlib.suppress(DflockError):
                app_client(self._celery._get_app()).release(taken.hold.key, taken.hold.token)
            raise
        taken.confirm(self, task_id)
        return sent

    def delay_on_commit(self, *args: Any, **kwargs: Any) -> None:
        """``delay`` once Django's transaction under way commits (nothing on a rollback), as a
        Django project's other tasks (Celery's ``DjangoTask``) have it."""
        self.apply_async_on_commit(args, kwargs)

    def apply_async_on_commit(self, *args: Any, **kwargs: Any) -> None:
        """``apply_async`` once Django's transaction under way commits, as ``delay_on_commit``."""
        from django.db import transaction

        transaction.on_commit(functools.partial(self.apply_async, *args, **kwargs))  # pyright: ignore[reportUnknownMemberType]

    def apply(  # noqa: PLR0917 (Celery's signature)
        self,
        args: Any = None,
        kwargs: Any = None,
        link: Any = None,
        link_error: Any = None,
        task_id: str | None = None,
        retries: int | None = None,
        throw: bool | None = None,
        logfile: Any = None,
        loglevel: Any = None,
        headers: Any = None,
        **options: Any,
    ) -> Any:
        """As `celery.Task.apply`; lock options given here apply to this run (a bad one
        is refused, naming it). With ``lock_from="publish"`` and the key held, the eager run
        fails at once with `AlreadyQueued`."""
        if options:
            what = f"apply options of {self._name!r}"
            check_option_names(options, what)
            if any(name in options for name in LOCK_OPTIONS):
                headers, _, _ = self._call_options(options, headers, what)
        return self._base.apply(
            args,
            kwargs,
            link,
            link_error,
            task_id,
            retries,
            throw,
            logfile,
            loglevel,
            headers,
            **options,
        )

    def retry(  # noqa: PLR0917 (Celery's signature)
        self,
        args: Sequence[Any] | None = None,
        kwargs: Mapping[str, Any] | None = None,
        exc: BaseException | None = None,
        throw: bool = True,
        eta: Any = None,
        countdown: float | None = None,
        max_retries: int | None = None,
        **options: Any,
    ) -> Any:
        """As `celery.Task.retry`, but the lock is released before the retry is sent;
        a run holding its key from publish (``lock_from="publish"``) hands the hold on to the
        retry instead, so no duplicate can be queued during the countdown. With
        ``throw=False`` the body goes on: it keeps its lock, and the retry waits for it."""
        request = self._celery.request
        took_key = held_lock(request) is not None
        kept = None  # throw=False: the body goes on after the send, holding its lock to its end
        if throw or not took_key:
            kept = retry_hand_off(
                self, request, countdown=countdown, eta=eta, max_retries=max_retries
            )
        given = header(request, LOCK_OPTIONS_HEADER)  # checked when the run read it
        given_headers = cast("Mapping[str, Any]", options.pop("headers", None) or {})
        headers = {**(mapping_of(getattr(request, "headers", None)) or {}), **given_headers}
        if took_key:  # its key was busy, or its server away, no more: the retry starts afresh
            headers[LOCK_RETRIES_HEADER] = headers[OUTAGE_HEADER] = None
        if given:
            headers[LOCK_OPTIONS_HEADER] = given
        # A retry is no new publish: it takes no hold of its own.
        headers[HOLD_HEADER] = None if kept is None else kept.header()
        options["headers"] = headers
        try:
            return self._base.retry(
                args, kwargs, exc, throw, eta, countdown, max_retries, **options
            )
        except Reject:
            if kept is not None:  # the retry could not be sent: free the key it kept
                with contextlib.suppress(DflockError):  # else its lease frees it
                    app_client(self._celery._get_app()).release(kept.key, kept.token)
            raise

    def on_replace(self, sig: Any) -> Any:
        """As `celery.Task.on_replace`, but the lock is released before the replacement
        is sent (or run, eagerly), as `retry` does: a replacement of the same key is no
        duplicate of this run, nor waits for it."""
        if (lock := held_lock(self._celery.request)) is not None:
            lock.release()
        return self._base.on_replace(sig)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        task = self._celery
        stack = task.request_stack
        request = stack.top
        call: Callable[..., Any] | None = getattr(type(self), _OWN_CALL, None)
        body = None if call is None else functools.partial(call, self)
        if (
            request is not None
            and not request._protected
            and len(stack) == 1
            and not request.called_directly
        ):
            # Called by the worker's (or apply()'s) tracer, which pushed the request. (A
            # class's own __call__ may call Celery's, which protects it then.)
            if body is None:
                request._protected = 1
            return locked_run(self, request, args, kwargs, body)
        # A direct call, task(...): push a request the way Task.__call__ does.
        task_stack.push(self)
        task.push_request(args=args, kwargs=kwargs)
        try:
            return locked_run(self, task.request, args, kwargs, body)
        finally:
            task.pop_request()
            task_stack.pop()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Find, once per class, the ``__call__`` that runs the body, under the lock: this
        class's own when it runs the body itself (``return self.run(...)``, as Celery's docs
        write one; it would take `LockedTask`'s place and run unlocked), else that of a task
        class after `LockedTask` in this one's (the app's ``task_cls``; the task's own class,
        which ``dflock_task_locks`` puts after it). None: Celery's, which runs ``run``."""
        super().__init_subclass__(**kwargs)
        mine = vars(cls).get("__call__")
        code = getattr(mine, "__code__", None)
        if code is not None and "__call__" not in code.co_names:  # no super().__call__()
            setattr(cls, _OWN_CALL, mine)
            cls.__call__ = LockedTask.__call__  # pyright: ignore[reportAttributeAccessIssue]
            return
        mro, at = cls.__mro__, cls.__mro__.index(LockedTask)
        if any(vars(k).get("__call__") is LockedTask.__call__ for k in mro[1:at]):
            return  # a class between this one and LockedTask runs the body by its own: kept
        klass = next(k for k in mro[at + 1 :] if vars(k).get("__call__") is not None)
        # (no annotation: LockedTask's own are its options)
        setattr(cls, _OWN_CALL, None if klass is BaseTask else vars(klass)["__call__"])

    @property
    def _celery(self) -> Any:
        """This task as Celery's untyped object."""
        return self

    @property
    def _base(self) -> Any:
        """The methods after `LockedTask`'s in the MRO: a project's task class's, or Celery's."""
        return super()

    @property
    def _name(self) -> str:
        return str(self._celery.name)

    def _call_options(
        self, options: dict[str, Any], headers: object, what: str
    ) -> tuple[dict[str, Any], GivenOptions | None, GivenOptions | None]:
        """The message's headers, with the lock options popped from ``options`` merged over
        those of its `LOCK_OPTIONS_HEADER`, checked; the merged options and those of beat's
        non-overlap the header names (None, None: none popped, the header not read). A
        ``lock_key`` template naming a field the task does not take is refused (as the task's
        own is when it is bound), before anything is sent or run."""
        merged = dict(cast("Mapping[str, Any]", headers or {}))
        lock_options = {name: options.pop(name) for name in LOCK_OPTIONS if name in options}
        if not lock_options:
            return merged, None, None
        raw: object = merged.get(LOCK_OPTIONS_HEADER) or {}
        sent, beat = read_message_options(raw, f"the {LOCK_OPTIONS_HEADER!r} header of {what}")
        given = {name: value for name, value in lock_options.items() if value is not None}
        checked = read_call_options({**sent.by_name(), **given}, what)
        if isinstance(checked.key, str):
            check_template(checked.key, self._celery.run, task_name=self._name)
        header_options = merged[LOCK_OPTIONS_HEADER] = checked.by_name()
        if beat is not None:  # sent by beat for an entry: it stays named
            header_options[BEAT_ENTRY_HEADER] = cast("Mapping[str, Any]", raw)[BEAT_ENTRY_HEADER]
        return merged, checked, beat

    def _as_sent(self, args: Any, kwargs: Any, options: Mapping[str, Any]) -> Call:
        """(args, kwargs) as the run will get them, through the message's serializer."""
        serializer = options.get("serializer") or self._celery.serializer
        data = (list(args or ()), dict(kwargs or {}))
        codec: Any = serialization  # kombu's serializers, untyped
        content_type, encoding, body = codec.dumps(data, serializer)
        sent_args, sent_kwargs = codec.loads(body, content_type, encoding, accept=[content_type])
        return tuple(sent_args), dict(sent_kwargs)


def apply_task_locks(app: Any) -> list[str]:
    """Make the tasks named in ``dflock_task_locks`` locked tasks, without editing them (each
    gets its class swapped for a subclass with ``LockedTask`` first); the names changed."""
    return _worker_hooks.apply_task_locks(app, LockedTask)
