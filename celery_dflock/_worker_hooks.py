"""The worker hooks that keep locks honest (the list: `celery_dflock.signals`), connected once
per app by `install_hooks`, and the checks they make of the app's tasks (`apply_task_locks`,
`unknown_task_locks`, `leases_above`, `countdowns_past_visibility`).
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Final, cast

from celery_dflock._celery import (
    BaseTask,
    TimeLimitExceeded,
    WorkerLostError,
    get_logger,
    inspect_command,
    signals as celery_signals,
)
from celery_dflock._outage import OUTAGE_MAX_COUNTDOWN_S, OutageCounter, parse_outage
from celery_dflock._request import HOLD_HEADER, OUTAGE_HEADER, header, hold_of
from celery_dflock._runtime import (
    CHILD_EXIT_WAIT_S,
    HeldRecords,
    app_client,
    get_runtime,
    options_for,
    pid_gone,
    reset_runtime_after_fork,
)
from celery_dflock._settings import DflockConfigError, close_matches
from celery_dflock.client.clients import leave_signals_to_the_main_thread
from celery_dflock.client.errors import DflockError, LockSkipped
from celery_dflock.config import LockOptions, get_config
from celery_dflock.keys import KeyDerivationError, check_template

logger: Any = get_logger("celery_dflock.signals")

_HOOKS_ATTR: Final = "_dflock_hooks"

OUTAGES_COMMAND: Final = "dflock_outages"  # an inspect command: `celery dflock status --workers`
WATCH_FIRST_PAUSE_S: Final = 1.0
WATCH_MAX_PAUSE_S: Final = 15.0


def _in_a_thread(target: Callable[..., object], name: str, *args: object) -> bool:
    """Run ``target(*args)`` in a daemon thread; False, logged, when none can be started."""

    def run() -> None:
        leave_signals_to_the_main_thread()
        target(*args)

    try:
        threading.Thread(target=run, name=name, daemon=True).start()
    except RuntimeError as exc:
        logger.warning("dflock: no thread for %s (%s)", name, exc)
        return False
    return True


class _Hooks:
    """The receivers for one app (kept on the app, so they live exactly as long)."""

    def __init__(self, app: Any, locked_task: type[Any]) -> None:
        self.app = app
        self.locked_task = locked_task
        self.main_pid: int | None = None
        self.outages = OutageCounter()
        self._watch_guard = threading.Lock()
        self.unreachable: dict[str, float] = {}  # address -> epoch seconds first found so
        self._watching = False

    def connect(self) -> None:
        celery_signals.worker_init.connect(self.on_worker_init, weak=True)
        celery_signals.worker_ready.connect(self.on_worker_ready, weak=True)
        celery_signals.worker_process_init.connect(self.on_worker_process_init, weak=True)
        celery_signals.worker_process_shutdown.connect(self.on_worker_process_shutdown, weak=True)
        celery_signals.worker_shutdown.connect(self.on_worker_shutdown, weak=True)
        celery_signals.task_failure.connect(self.on_task_failure, weak=True)
        celery_signals.task_revoked.connect(self.on_task_revoked, weak=True)
        celery_signals.task_received.connect(self.on_task_received, weak=True)
        if getattr(self.app, "finalized", False):
            apply_task_locks(self.app, self.locked_task)
        else:
            self.app.on_after_finalize.connect(self.on_after_finalize, weak=True)

    def _ours(self, sender: Any) -> bool:
        """Whether ``sender`` (a worker, consumer or task) is of this app, or has none."""
        app = getattr(sender, "app", None) or getattr(sender, "_app", None)
        return app is None or app is self.app

    def on_after_finalize(self, sender: Any = None, **_: Any) -> None:
        if sender is self.app:
            apply_task_locks(self.app, self.locked_task)

    def on_worker_init(self, sender: Any = None, **_: Any) -> None:
        if not self._ours(sender):
            return
        try:
            apply_task_locks(self.app, self.locked_task)
            check_task_options(self.app, self.locked_task)
        except DflockConfigError as exc:  # Celery logs a handler's error and goes on: stop
            raise SystemExit(f"Error: {exc}") from exc
        self.main_pid = os.getpid()
        inspect_command(name=OUTAGES_COMMAND)(_dflock_outages)
        runtime = get_runtime(self.app)
        runtime.records = HeldRecords.for_main_process(self.main_pid, self._servers())
        limits = (getattr(sender, "time_limit", None), getattr(sender, "soft_time_limit", None))
        runtime.worker_time_limits = limits

    def on_worker_ready(self, sender: Any = None, **_: Any) -> None:
        """Config warnings and the clean-up after dead workers, once the worker logs (it does
        not yet at ``worker_init``)."""
        if not self._ours(sender):
            return
        _in_a_thread(self._clean_up_after_dead_workers, "dflock-leftovers", self.main_pid)
        if get_runtime(self.app).records is None:
            logger.warning(
                "dflock: no private directory for held-lock records in %s; locks of killed "
                "pool children are freed by the server (auto-release) or their lease only",
                tempfile.gettempdir(),
            )
        for warning in [
            *unknown_task_locks(self.app),
            *countdowns_past_visibility(self.app, self.locked_task),
        ]:
            logger.warning("dflock: %s", warning)
        # In a thread: an unreachable server costs a connect timeout.
        _in_a_thread(self._report_servers, "dflock-servers-check")

    def _report_servers(self) -> None:
        """Log the lock servers this worker reaches; warn about each it cannot."""
        try:
            with get_config(self.app).new_client() as client:
                answers = client.ping()
        except (DflockError, OSError) as exc:
            logger.warning("dflock: cannot ask the lock servers (dflock_servers): %s", exc)
            return
        reached = [(a.address, a.server) for a in answers if a.server is not None]
        missed = [a for a in answers if not a.reachable]
        if reached:
            logger.info(
                "dflock: lock servers reached: %s",
                ", ".join(f"{address} ({server.describe()})" for address, server in reached),
            )
        for answer in missed:
            logger.warning(
                "dflock: cannot reach lock server %s (dflock_servers): %s",
                answer.address,
                answer.error or "no answer",
            )
        if known := [s.max_lease_ttl_s for _, s in reached if s.max_lease_ttl_s is not None]:
            for warning in leases_above(self.app, self.locked_task, min(known)):
                logger.warning("dflock: %s", warning)
        if not reached:
            logger.warning(
                "dflock: this worker reaches none of its lock servers (dflock_servers = %s): "
                "no locked task can take its lock until one answers; its runs wait and are "
                "sent again meanwhile (up to 10 minutes each). Start the lock server "
                "(`dflockd`) or set dflock_servers to where it runs",
                ",".join(a.address for a in answers) or "(none)",
            )
        if missed:
            self._watch(dict.fromkeys((answer.address for answer in missed), time.time()))

    def on_task_received(self, sender: Any = None, request: Any = None, **_: Any) -> None:
        """Count a message sent again for an outage (`OUTAGE_HEADER`, in the worker request's
        ``request_dict``); watch the servers."""
        found = getattr(request, "request_dict", None)
        if not isinstance(found, Mapping) or not self._ours(sender):
            return
        state = parse_outage(cast("Mapping[str, object]", found).get(OUTAGE_HEADER))
        if state is not None:
            self.outages.count(state)
            self._watch({})

    def _watch(self, unreachable: Mapping[str, float]) -> None:
        """Ping the lock servers from one thread until all answer, logging each that answers
        again (``unreachable``: address -> since when)."""
        with self._watch_guard:
            for address, since in unreachable.items():
                self.unreachable.setdefault(address, since)
            if self._watching:
                return
            self._watching = True
        if not _in_a_thread(self._watch_servers, "dflock-servers-watch"):
            with self._watch_guard:
                self._watching = False

    def _watch_servers(self) -> None:
        with self._watch_guard:
            down = ", ".join(sorted(self.unreachable)) or "(a run met one unreachable)"
        logger.info("dflock: watching for lock servers to answer again: %s", down)
        pause = WATCH_FIRST_PAUSE_S
        try:
            while True:
                time.sleep(pause)
                pause = min(pause * 2, WATCH_MAX_PAUSE_S)
                try:
                    with get_config(self.app).new_client() as client:
                        answers = client.ping()
                except (DflockError, OSError):
                    continue
                now = time.time()
                with self._watch_guard:
                    for answer in answers:
                        if not answer.reachable:
                            self.unreachable.setdefault(answer.address, now)
                        elif (since := self.unreachable.pop(answer.address, None)) is not None:
                            logger.warning(
                                "dflock: lock server %s is reachable again (found unreachable "
                                "%.0f s ago); runs waiting for it go on",
                                answer.address,
                                now - since,
                            )
                    if not self.unreachable:
                        # In the hold that saw none: a `_watch` from now on starts a watcher.
                        self._watching = False
                        return
        except BaseException:
            with self._watch_guard:
                self._watching = False
            raise

    def outage_report(self) -> dict[str, object]:
        """What ``celery inspect dflock_outages`` answers for this worker."""
        with self._watch_guard:
            unreachable = dict(self.unreachable)
        return {**self.outages.as_json(), "unreachable_since": unreachable}

    def on_worker_process_init(self, **_: Any) -> None:
        # Also sent by the solo pool in the worker's own process, which is no pool child.
        if not self._in_main_process():
            reset_runtime_after_fork(self.app, in_pool_child=True)

    def on_worker_process_shutdown(self, **_: Any) -> None:
        get_runtime(self.app).close()

    def on_worker_shutdown(self, sender: Any = None, **_: Any) -> None:
        if not self._ours(sender):
            return
        runtime = get_runtime(self.app)
        if runtime.records is not None and self._in_main_process():
            self._release_from(runtime.records, None, wait_s=0)
            runtime.records.remove_all()
        runtime.close()

    def on_task_failure(
        self, sender: Any = None, task_id: str | None = None, exception: Any = None, **_: Any
    ) -> None:
        if isinstance(exception, WorkerLostError | TimeLimitExceeded):
            self.lost_child(sender, task_id)

    def lost_child(self, sender: Any, task_id: object) -> None:
        """The pool child running ``task_id`` was lost or killed (``task_failure``,
        ``task_revoked`` with ``terminated``, or `LockedRequest` where Celery requeues its
        message instead): release what it held once it has exited (in a thread: the consumer
        must not block on a dying child). Celery's id as it came (an int too); the records hold
        it as text, as the run's ``Message`` reads it."""
        if not (task_id and self._in_main_process() and self._ours(sender)):
            return
        if (records := get_runtime(self.app).records) is not None:
            name = f"dflock-orphan-{task_id}"
            _in_a_thread(self._release_from, name, records, str(task_id), CHILD_EXIT_WAIT_S)

    def on_task_revoked(
        self, sender: Any = None, request: Any = None, terminated: bool = False, **_: Any
    ) -> None:
        task_id = getattr(request, "id", None)
        if terminated:
            self.lost_child(sender, task_id)
        elif self._ours(sender) and (held := hold_of(header(request, HOLD_HEADER))) is not None:
            # Dropped before it ran: its publish-time hold has no run to end it.
            whose = f"held for revoked task {task_id}"
            args = (held.key, held.token, None, whose, "it frees after lock_pending_ttl")
            _in_a_thread(self._release, f"dflock-revoked-{task_id}", *args)

    def _release(self, key: str, token: str, limit: int | None, whose: str, frees: str) -> None:
        """Release ``key`` for a holder that cannot (``whose``, for the log); ``frees``: when
        the key frees should this fail."""
        try:
            released = app_client(self.app).release(key, token, limit=limit)
        except (DflockError, OSError) as exc:
            logger.warning("dflock: could not release %r %s: %s (%s)", key, whose, exc, frees)
        else:  # not held any more: its lease or its holder's session ended first
            said = "dflock: released %r %s" if released else "dflock: %r %s was free already"
            logger.info(said, key, whose)

    def _clean_up_after_dead_workers(self, main_pid: int) -> None:
        for records in HeldRecords.left_by_dead_workers(main_pid, self._servers()):
            self._release_from(records, None, wait_s=0)
            if not records.entries():
                records.remove_all()
                logger.info("dflock: removed %s, left by a worker that is gone", records.directory)
        if earlier := HeldRecords.left_by_earlier_versions():
            for records in earlier:
                records.remove_all()
            logger.info(
                "dflock: removed %s: held-lock records left by gone workers of an earlier "
                "version (their servers unknown: nothing in them released)",
                ", ".join(str(records.directory) for records in earlier),
            )

    def _servers(self) -> tuple[tuple[str, int], ...]:
        return get_config(self.app).client.servers

    def _in_main_process(self) -> bool:
        return self.main_pid == os.getpid()

    def _release_from(self, records: HeldRecords, task_id: str | None, wait_s: float) -> None:
        for path, entry in records.entries(task_id):
            pid, key, token = entry.get("pid", 0), entry.get("key"), entry.get("token")
            if not (type(pid) is int and isinstance(key, str) and isinstance(token, str)):
                logger.warning("dflock: dropped a damaged held-lock record in %s: %r", path, entry)
                records.forget(path, entry)
            elif pid and not pid_gone(pid, wait_s):
                logger.info(
                    "dflock: pool child %s still runs task %s; it releases %r itself",
                    pid,
                    task_id,
                    key,
                )
            elif records.forget(path, entry):  # taken here: no other clean-up releases it too
                whose = f"left by dead pool child {pid}"
                self._release(key, token, entry.get("limit"), whose, "its lease will expire")


def request_failed(task: Any, task_id: object, exc: object) -> None:
    """`LockedTask`'s worker request saw its run fail with ``exc``: Celery sends no
    ``task_failure`` for a lost pool child whose message it requeues (``acks_late`` with
    ``reject_on_worker_lost``, or ``retry_on_worker_lost``), so a lost child's locks are
    released from here too."""
    exc = getattr(exc, "exc", exc)  # as billiard wraps it
    hooks = getattr(task._get_app(), _HOOKS_ATTR, None)
    # (SystemExit, KeyboardInterrupt: a child's exit, as billiard 4.3 reports it)
    lost = isinstance(exc, WorkerLostError | SystemExit | KeyboardInterrupt)
    if lost and isinstance(hooks, _Hooks):
        hooks.lost_child(task, task_id)


def _dflock_outages(state: Any, **_: Any) -> dict[str, object]:
    """Lock-server outages this worker met: outage retries, servers unreachable."""
    hooks = getattr(getattr(state.consumer, "app", None), _HOOKS_ATTR, None)
    return hooks.outage_report() if isinstance(hooks, _Hooks) else {}


def install_hooks(app: Any, locked_task: type[Any]) -> None:
    """Connect the worker hooks for ``app`` (idempotent); ``locked_task``: `LockedTask`."""
    if isinstance(getattr(app, _HOOKS_ATTR, None), _Hooks):
        return
    hooks = _Hooks(app, locked_task)
    setattr(app, _HOOKS_ATTR, hooks)
    hooks.connect()


def apply_task_locks(app: Any, locked_task: type[Any]) -> list[str]:
    """`celery_dflock.task.apply_task_locks`, with ``locked_task`` as `LockedTask`."""
    changed: list[str] = []
    tasks: Mapping[str, Any] = app.tasks
    for name, entry in get_config(app).task_locks.items():
        if (task := tasks.get(name)) is None:
            continue
        if isinstance(entry.key, str):  # as a task's own template is, when it is bound
            try:
                check_template(entry.key, task.run, task_name=name)
            except KeyDerivationError as exc:
                raise DflockConfigError(f"dflock_task_locks[{name!r}]['lock_key']: {exc}") from None
        if isinstance(task, locked_task):
            continue
        original: Any = task.__class__
        # A worker request of its own stays (else `LockedTask`'s: a lost child's release).
        own = {} if original.Request == BaseTask.Request else {"Request": original.Request}
        task.__class__ = type(
            original.__name__,
            (locked_task, original),
            {
                "__module__": original.__module__,
                "__qualname__": original.__qualname__,
                "throws": with_skip(getattr(original, "throws", ())),
                **own,
            },
        )
        changed.append(name)
    return changed


def check_task_options(app: Any, locked_task: type[Any]) -> None:
    """Resolve the lock options of every locked task of ``app`` once, as a worker starts:
    `DflockConfigError` for options that are each valid but cannot work together (the app's
    ``dflock_lock_from="publish"`` and a task's ``lock_limit``; a ``dflock_task_locks`` entry
    and a task's attribute), which would otherwise fail every run and publish of the task."""
    config, runtime = get_config(app), get_runtime(app)
    tasks: Mapping[str, Any] = app.tasks
    for name, task in sorted(tasks.items()):
        if isinstance(task, locked_task):
            options_for(task, config, runtime.task_runs(name), None)


def locked_options(app: Any, locked_task: type[Any]) -> Iterator[tuple[str, LockOptions]]:
    """Each locked task of ``app`` (by name) with its resolved lock options (a task with a bad
    option is left out: it fails where it is used)."""
    config, runtime = get_config(app), get_runtime(app)
    tasks: Mapping[str, Any] = app.tasks
    for name, task in sorted(tasks.items()):
        if not isinstance(task, locked_task):
            continue
        try:
            options = options_for(task, config, runtime.task_runs(name), None)
        except DflockError:
            continue
        if options is not None:
            yield name, options


def leases_above(app: Any, locked_task: type[Any], limit: int) -> list[str]:
    """A warning for each locked task of ``app`` whose ``lock_ttl`` (or ``lock_pending_ttl``)
    is above ``limit``, the longest lease its lock servers grant; and one for a
    ``dflock_session_ttl`` above it (the client cuts the session to ``limit``)."""
    warnings: list[str] = []
    if (session := get_config(app).client.session_ttl_s) > limit:
        warnings.append(
            f"dflock_session_ttl={session} is above the longest lease its lock servers grant "
            f"({limit} s, --max-lease-ttl): each session of this worker lasts {limit} s, and a "
            f"stall longer than about two thirds of that costs its locks; lower "
            f"dflock_session_ttl or raise the servers' --max-lease-ttl"
        )
    for name, options in locked_options(app, locked_task):
        leases: list[tuple[str, int | None, str]] = [("lock_ttl", options.ttl, "run")]
        if options.lock_from == "publish":
            leases.append(("lock_pending_ttl", options.pending_ttl, "send"))
        for option, lease, what in leases:
            if lease is not None and lease > limit:
                warnings.append(
                    f"task {name!r} asks for {option}={lease}, above the longest lease its "
                    f"lock servers grant ({limit} s, --max-lease-ttl): every {what} of it will "
                    f"be refused; lower {option} (or dflock_{option}) or raise the servers' "
                    "--max-lease-ttl"
                )
    return warnings


def countdowns_past_visibility(app: Any, locked_task: type[Any]) -> list[str]:
    """A warning when ``app``'s broker delivers a message again after a ``visibility_timeout``
    (Redis, SQS) not above the longest countdown a locked task's message may wait (the broker
    would deliver it twice)."""
    try:  # kombu's transport, whatever the URL names it (rediss, sentinel, redis+socket, ...)
        with app.connection_for_write() as connection:
            driver = connection.transport.driver_type
    except Exception:  # a transport kombu cannot load here: not one this check knows
        return []
    # kombu's transports that deliver a message again after it: name, default, in words
    known = {"redis": ("Redis", 3600.0, "an hour"), "sqs": ("SQS", 1800.0, "30 minutes")}
    if driver not in known:
        return []
    broker, default, in_words = known[driver]
    transport_options: Mapping[str, Any] = app.conf.broker_transport_options or {}
    try:
        visibility = float(transport_options.get("visibility_timeout", default))
    except (TypeError, ValueError):
        return []
    longest, why, locked = OUTAGE_MAX_COUNTDOWN_S, "an outage retry's countdown (up to 30 s)", 0
    for name, options in locked_options(app, locked_task):
        locked += 1
        retries = options.on_locked == "retry" and options.max_retries != 0
        if retries and options.retry_backoff_max > longest:
            longest = options.retry_backoff_max
            why = f"the busy-key retries of task {name!r} (lock_retry_backoff_max={longest:g} s)"
    if not locked or visibility > longest:
        return []
    return [
        f"the {broker} broker's visibility_timeout ({visibility:g} s, broker_transport_options) "
        f"is not above {why}: a worker holds a message sent again with a countdown "
        f"unacknowledged until it is due, and {broker} delivers it again after "
        f"visibility_timeout, so the run would run twice; raise visibility_timeout above "
        f"{longest:g} s (its default is {in_words}) or lower lock_retry_backoff_max"
    ]


def unknown_task_locks(app: Any) -> list[str]:
    """A warning for each ``dflock_task_locks`` entry that names no task of ``app``."""
    tasks = [str(name) for name in app.tasks]
    return [
        f"dflock_task_locks names {name!r}, which no task of this app has, so it is not "
        f"locked{close_matches(name, tasks, cutoff=0.5)}"
        for name in get_config(app).task_locks
        if name not in tasks
    ]


def with_skip(throws: object) -> tuple[type[BaseException], ...]:
    """A task's ``throws`` with `LockSkipped` in it (an expected error: INFO, no traceback)."""
    given = tuple(cast("tuple[type[BaseException], ...]", throws or ()))
    return given if LockSkipped in given else (*given, LockSkipped)
