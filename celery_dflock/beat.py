# pyright: reportMissingTypeStubs=false
"""One active ``celery beat`` among many: `SingletonScheduler`. What users see (failover,
"start from now", the shared store, entries that never overlap) is in
[One active beat among many](../beat.md).

What the code adds to that page:
- ``SingletonScheduler`` wraps the class named in ``dflock_beat_scheduler`` by *dynamic
  subclassing* (``class Singleton<Wrapped>(SingletonScheduler, Wrapped)``): Celery's
  ``Scheduler.tick`` calls ``reserve``/``apply_entry``/``apply_async`` on ``self``, so the send
  gate must sit in the wrapped class's method resolution. A class written as
  ``class MyScheduler(SingletonScheduler, SomeScheduler)`` is used as it is.
- The wrapped store is built with ``lazy=True``: ``setup_schedule`` runs each time this beat
  becomes active, ``sync`` only while the lock server confirms the lock, ``close`` before the
  lock is released. A send whose entry still carries a ``last_run_at`` older than the takeover
  (a scheduler that re-reads its store may bring one back) is skipped once, with a log line.
- `Leadership`: a background thread queues on the lock (``enqueue``, then a bounded ``wait``),
  bumps its ``term`` when granted and waits for a loss or ``stop``; the scheduler's thread only
  reads the state and calls ``confirm`` before each send, so a long tick never delays renewal.
- Per-run markers on the lock server would not catch up missed runs: the server frees a dead
  client's locks at the end of its session, in exactly the crash they would cover.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
from collections.abc import Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Final, Self, cast

from celery.beat import PersistentScheduler, Scheduler
from celery.utils.imports import (
    load_extension_class_names,
    symbol_by_name,  # pyright: ignore[reportUnknownVariableType]
)
from celery.utils.time import maybe_make_aware

from celery_dflock._celery import signals as celery_signals
from celery_dflock._request import BEAT_ENTRY_HEADER, LOCK_OPTIONS_HEADER, beat_note
from celery_dflock._settings import (
    BEAT_SETTING_SPECS,
    DEFAULT_BEAT_KEY_PREFIX,
    DEFAULT_BEAT_LEASE_TTL_S,
    LOCK_OPTIONS,
)
from celery_dflock.client import DistributedLock
from celery_dflock.client.clients import leave_signals_to_the_main_thread
from celery_dflock.client.errors import DflockError, InvalidValueError
from celery_dflock.config import DflockConfig, DflockConfigError, get_config, read_settings
from celery_dflock.keys import safe_key

__all__ = ["BEAT_ENTRY_HEADER", "DEFAULT_BEAT_LEASE_TTL_S", "BeatSettings", "SingletonScheduler"]

logger = logging.getLogger("celery_dflock.beat")

STANDBY_TICK_S: Final = 1.0
"""Longest a standby's tick blocks waiting to be promoted."""
STANDBY_RETURN_S: Final = 0.001
_LAZY_POSITION: Final = 4  # lazy's index among Scheduler.__init__'s positional arguments
_BROKER_CACHE: Final = ("producer", "connection")
"""The cached properties through which Celery's ``Scheduler`` publishes (its ``close`` pops
them and, from Celery 5.7 on, releases the connection)."""
STANDBY_ACQUIRE_TIMEOUT_S: Final = 10
"""Seconds one queued acquire waits before it is issued again (to notice a stop)."""
RETRY_UNREACHABLE_S: Final = 1.0


class Leadership:
    """Campaign for one lock in a daemon thread; expose whether this process is the leader.
    ``make_lock(on_lost)`` builds a fresh lock for each campaign."""

    def __init__(
        self, make_lock: Callable[[Callable[[object], None]], DistributedLock], describe: str
    ) -> None:
        self._make_lock = make_lock
        self.describe = describe
        # Re-entrant: beat's signal handler runs close() (and with it stop() and confirm()) in
        # the main thread, possibly while the interrupted main thread holds the guard.
        self._guard = threading.RLock()
        self._lock: DistributedLock | None = None
        self._term = 0
        self._active = threading.Event()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self.refused: InvalidValueError | None = None
        """Why the server refuses every acquire of the lock (a lease above its
        ``--max-lease-ttl``): no retry can take it, and the campaign has ended."""

    @property
    def term(self) -> int:
        """Increases by one every time this process is granted the lock."""
        with self._guard:
            return self._term

    def start(self) -> None:
        """Start campaigning (once: a campaign stopped before it started ends at once)."""
        threading.Thread(target=self._run, name="dflock-beat-leader", daemon=True).start()
        logger.info("beat: standby, waiting for %s", self.describe)

    def is_active(self) -> bool:
        """True while this process holds the lock and has not seen it lost."""
        with self._guard:
            lock = self._lock
        return self._active.is_set() and lock is not None and not lock.lost

    def wait_active(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` for this process to become the leader."""
        return self._active.wait(timeout_s) and self.is_active()

    def confirm(self) -> bool:
        """Ask the lock server, now, whether this process still holds the lock (a renewal);
        a refusal, or an answer read after the lease it renewed ran out, demotes this process
        at once: the caller must not send."""
        with self._guard:
            lock = self._lock
        if lock is None or not self._active.is_set() or lock.lost:
            return False
        why = "the lock server no longer confirms it"
        with suppress(DflockError):
            if lock.renew():
                # An answer read after the lease it renewed ran out (this beat paused while
                # it was on its way) confirms nothing: another beat may lead by now.
                if lock.owned():
                    return True
                why = "its lease ran out before the lock server's answer was read"
        self._demote(lock, why)
        return False

    def stop(self, *, release: bool = True) -> None:
        """Stop campaigning and release the lock if held (idempotent). A campaign thread
        blocked in a queued acquire is not waited for: granted later, it releases at once.

        ``release=False`` (the caller's thread is in the middle of a request on the lock's
        connection): keep the lock for a later ``stop()`` to release.
        """
        self._stop.set()
        self._wake.set()
        lock = None
        if release:
            with self._guard:
                lock, self._lock = self._lock, None
        self._active.clear()
        if lock is None:
            return
        if _release_quietly(lock):
            logger.info("beat: released %s", self.describe)
        else:
            logger.warning(
                "beat: %s was no longer held when this beat stopped (its lease ran out, or "
                "it was released by another, or the lock server did not answer): another "
                "beat may have become active before",
                self.describe,
            )

    def _on_lost(self, _lock: object) -> None:
        self._active.clear()
        self._wake.set()

    def _demote(self, lock: DistributedLock, why: str) -> None:
        with self._guard:
            if self._lock is not lock:
                return
            self._lock = None
        self._on_lost(lock)
        _release_quietly(lock)
        logger.warning("beat: lost %s (%s); stopped sending, back to standby", self.describe, why)

    def _run(self) -> None:
        leave_signals_to_the_main_thread()
        unreachable = False
        while not self._stop.is_set():
            lock: DistributedLock | None = None
            try:
                lock = self._make_lock(self._on_lost)
                granted = bool(lock.enqueue())  # join the FIFO queue (or take a free lock)
                if unreachable:
                    logger.info(
                        "beat: standby, lock server reachable again, waiting for %s", self.describe
                    )
                    unreachable = False
                if not granted:
                    granted = lock.wait(STANDBY_ACQUIRE_TIMEOUT_S)
            except Exception as exc:  # a DflockError, or a bug: never let the thread die
                if lock is not None:
                    _release_quietly(lock)
                if isinstance(exc, InvalidValueError):  # refused whatever the retry: say so
                    self.refused = exc
                    self._active.set()  # wakes wait_active; tick then raises `refused`
                    return
                if not isinstance(exc, DflockError):
                    logger.exception("beat: unexpected error while waiting for %s", self.describe)
                if not unreachable:
                    logger.warning(
                        "beat: standby, cannot take %s (%s); retrying every %.1fs",
                        self.describe,
                        exc,
                        RETRY_UNREACHABLE_S,
                    )
                unreachable = True
                self._stop.wait(RETRY_UNREACHABLE_S)
                continue
            if not granted:
                continue
            try:
                _name_this_beat(lock)
            except Exception:  # a bug: the lock is held all the same
                logger.exception("beat: error after taking %s", self.describe)
            with self._guard:
                if self._stop.is_set():
                    _release_quietly(lock)
                    return
                self._wake.clear()
                self._lock = lock
                self._term += 1
                self._active.set()
            logger.info("beat: active, holding %s", self.describe)
            self._hold(lock)

    def _hold(self, lock: DistributedLock) -> None:
        while not self._stop.is_set() and not lock.lost:
            with self._guard:
                if self._lock is not lock:
                    return  # demoted by confirm(); already logged and released
            self._wake.wait(STANDBY_ACQUIRE_TIMEOUT_S)
            self._wake.clear()
        if lock.lost:
            self._demote(lock, "renewal refused or the lock server is gone")


def _release_quietly(lock: DistributedLock) -> bool:
    """``lock.release()``: True if the server confirmed it."""
    try:
        return lock.release()
    except DflockError as exc:
        logger.debug("beat: release after loss failed: %s", exc)
        return False


@dataclass(frozen=True, slots=True)
class BeatSettings:
    """The beat-specific ``dflock_beat_*`` settings of one app, validated."""

    lock_key: str
    scheduler: type[Scheduler]
    lease_ttl_s: int
    nonoverlap: bool

    @classmethod
    def from_app(cls, app: Any, config: DflockConfig) -> BeatSettings:
        """Read the ``dflock_beat_*`` settings (`celery_dflock._settings.BEAT_SETTING_SPECS`)."""
        got = read_settings(app.conf, BEAT_SETTING_SPECS)
        key = got["dflock_beat_lock_key"] or f"{DEFAULT_BEAT_KEY_PREFIX}{app.main or 'default'}"
        return cls(
            lock_key=safe_key(config.key_prefix + key),
            scheduler=_wrapped_class(got["dflock_beat_scheduler"], app.conf.beat_scheduler),
            lease_ttl_s=cast("int", got["dflock_beat_lease_ttl"]),
            nonoverlap=bool(got["dflock_beat_nonoverlap"]),
        )


def _wrapped_class(setting: object, beat_scheduler: object) -> type[Scheduler]:
    """``dflock_beat_scheduler``; unset, the app's ``beat_scheduler`` unless that names a
    `SingletonScheduler` (then ``PersistentScheduler``)."""
    where, value = "dflock_beat_scheduler", setting
    if setting is None:
        where, value = "beat_scheduler", beat_scheduler
    found: object = value
    if isinstance(value, str):
        try:
            # As beat loads it: "django" is an alias (entry points celery.beat_schedulers).
            aliases = dict(load_extension_class_names("celery.beat_schedulers"))
            found = cast("object", symbol_by_name(value, aliases=aliases))
        except (ImportError, AttributeError, ValueError) as exc:
            raise DflockConfigError(
                f"{where}: cannot import {value!r} ({exc}); give 'package.module:ClassName'"
            ) from exc
    if not isinstance(found, type) or not issubclass(found, Scheduler):
        raise DflockConfigError(
            f"{where} must name a celery.beat.Scheduler subclass "
            f"(e.g. 'django_celery_beat.schedulers:DatabaseScheduler'); got {value!r}"
        )
    if issubclass(found, SingletonScheduler):
        if setting is None:
            return PersistentScheduler
        raise DflockConfigError(
            f"{where} names {value!r}, which already is a SingletonScheduler; "
            "name the scheduler to wrap instead"
        )
    return found


def _nonoverlap_options(name: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` for one send of entry ``name`` under its non-overlap lock: the entry named
    in `BEAT_ENTRY_HEADER`, and in `LOCK_OPTIONS_HEADER` beside the entry's own lock options
    (per call: above the task's; the entry's key and ``skip``, below: ``read_message_options``)."""
    result = {k: v for k, v in options.items() if k not in LOCK_OPTIONS}
    headers = dict(_entry_mapping(name, "options['headers']", options.get("headers")))
    result["headers"] = headers
    if not headers.setdefault(BEAT_ENTRY_HEADER, name):
        return dict(options)  # the entry opted out
    where = f"options['headers'][{LOCK_OPTIONS_HEADER!r}]"
    headers[LOCK_OPTIONS_HEADER] = {
        **_entry_mapping(name, where, headers.get(LOCK_OPTIONS_HEADER)),
        **{k: v for k, v in options.items() if k in LOCK_OPTIONS},
        BEAT_ENTRY_HEADER: headers[BEAT_ENTRY_HEADER],
    }
    return result


def _entry_mapping(name: str, where: str, value: object) -> Mapping[str, Any]:
    """``value``, the entry's ``where``, checked to be a mapping (None: an empty one)."""
    if not value:
        return {}
    if not isinstance(value, Mapping):
        raise DflockConfigError(
            f"beat entry {name!r}: {where} must be a mapping (a dict), not "
            f"{type(value).__name__} {value!r}; dflock_beat_nonoverlap adds to it"
        )
    return cast("Mapping[str, Any]", value)


def _app_from(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    app = kwargs.get("app", args[0] if args else None)
    if app is None:
        raise TypeError("SingletonScheduler needs the Celery app (first argument or app=)")
    return app


def _older(when: datetime, than: datetime) -> bool:
    try:
        return when < than
    except TypeError:  # one naive, one aware: compare both as aware
        return maybe_make_aware(when) < maybe_make_aware(than)


class SingletonScheduler(Scheduler):
    """A beat scheduler that only sends while it holds the beat's dflockd lock (see the
    module documentation)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Self:
        concrete = cls
        if not any(  # cls brings no concrete scheduler of its own (only Scheduler itself)
            issubclass(base, Scheduler)
            and base is not Scheduler
            and not issubclass(base, SingletonScheduler)
            for base in cls.__mro__
        ):
            app = _app_from(args, kwargs)
            wrapped = BeatSettings.from_app(app, get_config(app)).scheduler
            name = f"Singleton{wrapped.__name__}" if cls is SingletonScheduler else cls.__name__
            concrete = cast(
                "type[Self]",
                type(name, (cls, wrapped), {"__module__": cls.__module__, "__qualname__": name}),
            )
        return super().__new__(concrete)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        app = _app_from(args, kwargs)
        config = get_config(app)
        self._dflock_settings = BeatSettings.from_app(app, config)
        self._dflock_client = config.new_client()  # no I/O until the leader lock is taken
        self._leadership: Leadership | None = None
        self._term_seen = 0
        self._active_since: dict[str, datetime] = {}
        self._store_open = False
        self._store_write_confirmed = False
        self._send_confirmed = False
        self._sending = False
        self._asking_lock_server = False
        # The wrapped scheduler opens its store (setup_schedule) only once this beat is active.
        if len(args) > _LAZY_POSITION:
            args = (*args[:_LAZY_POSITION], True, *args[_LAZY_POSITION + 1 :])
        else:
            kwargs["lazy"] = True
        self._base().__init__(*args, **kwargs)
        celery_signals.beat_embedded_init.connect(
            _close_on_sigterm, weak=False, dispatch_uid=_close_on_sigterm.__qualname__
        )
        # A wrapped RedBeat's own Redis lock must be off (docs/beat.md, "RedBeat").
        wrapped = [c for c in type(self).__mro__ if c.__module__.startswith("redbeat")]
        key: object = getattr(self, "lock_key", None)
        if wrapped and key:
            raise DflockConfigError(
                f"SingletonScheduler wraps RedBeat ({wrapped[0].__name__}) with its own beat "
                f"lock on (redbeat_lock_key, {key!r}): each standby would wait for that Redis "
                "lock in beat's start-up, and a killed beat would keep it for "
                "redbeat_lock_timeout. Set app.conf.redbeat_lock_key = None: "
                "SingletonScheduler's lock decides which beat sends"
            )

    def _base(self) -> Any:
        """``super()``, typed loosely: Celery is untyped."""
        return super()

    @property
    def lock_description(self) -> str:
        """This beat's lock and the server that holds it (after sharding), for the log."""
        host, port = self._dflock_client.server_for(self._dflock_settings.lock_key)
        return f"lock {self._dflock_settings.lock_key!r} on {host}:{port}"

    def _make_lock(self, on_lost: Callable[[object], None]) -> DistributedLock:
        return self._dflock_client.lock(
            self._dflock_settings.lock_key,
            acquire_timeout_s=STANDBY_ACQUIRE_TIMEOUT_S,
            lease_ttl_s=self._dflock_settings.lease_ttl_s,
            on_lost=on_lost,
        )

    def _leader(self) -> Leadership:
        if self._leadership is None:
            self._leadership = Leadership(self._make_lock, self.lock_description)
            self._leadership.start()
        return self._leadership

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """Delegate to the wrapped scheduler while active; otherwise wait to be promoted."""
        leader = self._leader()
        if leader.refused is not None:
            raise DflockConfigError(f"beat cannot take its lock: {leader.refused}")
        if not leader.is_active():
            self._drop_store()
            wait_s = min(float(cast("Any", self).max_interval), STANDBY_TICK_S)
            if not leader.wait_active(wait_s):
                # Already waited in here: come straight back (beat still syncs in between).
                return STANDBY_RETURN_S
        if leader.term != self._term_seen:
            self._drop_store()  # opened in an earlier term: read what the leaders since wrote
            self._store_open = True
            try:
                self._base().setup_schedule()
            except BaseException:
                self._drop_store()
                raise
            if not self._store_open:  # the lock was lost while the store was being set up
                return STANDBY_RETURN_S
            self._take_over(leader.term)
        return cast("float", self._base().tick(*args, **kwargs))

    def _drop_store(self) -> None:
        """Close the wrapped store without writing to it: this beat is no longer the leader.
        Only ``PersistentScheduler``'s shelve is closed (its unsaved cache discarded); other
        schedulers keep their objects, unsynced until this beat is active again."""
        if not self._store_open:
            return
        self._store_open = False
        if isinstance(self, PersistentScheduler):
            store = cast("Any", self)._store
            cast("Any", self)._store = None
            if store is not None:
                store.cache = {}  # shelve's writeback cache: what close() would write
                try:
                    store.close()
                except Exception as exc:  # the file is the next leader's: nothing to repair
                    logger.warning("beat: closing the schedule store failed: %s", exc)

    def _confirmed(self, leadership: Leadership | None) -> bool:
        """Ask the lock server now whether this beat leads, flagged as under way (see
        `close`)."""
        if leadership is None:
            return False
        asking, self._asking_lock_server = self._asking_lock_server, True
        try:
            return leadership.confirm()
        finally:
            self._asking_lock_server = asking

    def sync(self) -> None:
        """Write the wrapped store, only while the lock server confirms this beat leads."""
        if not self._store_open:
            return  # a standby never touches the store
        if self._store_write_confirmed or self._confirmed(self._leadership):
            self._base().sync()
        else:
            self._drop_store()

    def _take_over(self, term: int) -> None:
        """Start every entry from now (docs/beat.md, "Failover without double sends")."""
        self._term_seen = term
        self._active_since = {}
        schedule = cast("Mapping[str, Any]", cast("Any", self).schedule)
        for name, entry in schedule.items():
            try:
                entry.last_run_at = self._active_since[name] = cast("datetime", entry.default_now())
            except Exception as exc:  # a broken entry must not stop the others
                logger.warning("beat: cannot restart entry %r from now: %s", name, exc)
        cast("Any", self)._heap = None  # rebuilt from the new last_run_at on the next tick
        again = cast("Mapping[str, Any]", cast("Any", self).schedule)
        # A scheduler that re-reads a shared store at every access (RedBeat) undoes the reset.
        next_runs = (
            "continues from the last run its store recorded"
            if any(again.get(name) is not entry for name, entry in schedule.items())
            else f"({len(self._active_since)}) runs next one period from now"
        )
        logger.info("beat: took over %s; every entry %s", self.lock_description, next_runs)

    def apply_entry(self, entry: Any, producer: Any = None) -> None:
        """Send ``entry`` unless its run predates this beat's takeover or the lock is gone."""
        since = self._active_since.get(entry.name)
        if since is not None and _older(entry.last_run_at, since):
            logger.info(
                "beat: not sending %r: it fell due before this beat took over "
                "(the previous leader owned that run); next run scheduled from now",
                entry.name,
            )
            return
        # Confirmed before Celery's apply_entry, which in 5.3.0-5.3.1 reads ``.id`` of
        # apply_async's result unchecked (a None would crash beat).
        if not self._confirm_send(entry):
            return
        self._send_confirmed = True
        try:
            self._base().apply_entry(entry, producer=producer)
        finally:
            self._send_confirmed = False

    def _confirm_send(self, entry: Any) -> bool:
        if self._confirmed(self._leader()):
            return True
        logger.warning(
            "beat: not sending %r: this beat no longer holds %s", entry.name, self.lock_description
        )
        return False

    def apply_async(
        self, entry: Any, producer: Any = None, advance: bool = True, **kwargs: Any
    ) -> Any:
        """Confirm the lock with the server (unless `apply_entry` just did), then send
        (with the non-overlap header if on); None, sending nothing, when not confirmed."""
        confirmed, self._send_confirmed = self._send_confirmed, False
        if not confirmed and not self._confirm_send(entry):
            return None
        base = self._base()
        if advance:
            entry = base.reserve(entry)
        if getattr(getattr(entry, "model", None), "one_off", False) is True:
            # django-celery-beat's one-off entry: its run (reserved) written before it is sent,
            # not at the next sync minutes away: a leader after a kill -9 never sends it again.
            self.sync()
            if not self._store_open:
                return None  # the lock server did not confirm the lock: nothing written or sent
        original = cast("Mapping[str, Any]", entry.options)
        if self._dflock_settings.nonoverlap:
            entry.options = _nonoverlap_options(entry.name, original)  # for this send only
        self._sending = True
        try:
            return base.apply_async(entry, producer, False, **kwargs)
        finally:
            self._sending = False
            entry.options = original

    def close(self) -> None:
        """Write and close the wrapped store (if the confirmed leader; else nothing is
        written), then release the lock to the next standby.

        Beat's SIGTERM/SIGINT handler may call it in this thread mid-request; the close beat
        makes again on its way out then finishes the job. In the middle of a send, the broker
        connection is left open: Celery 5.7+'s ``Scheduler.close`` would release the one the
        send reads from, and that error would replace the SystemExit (beat would carry on
        without its lock). While this thread waits for the lock server, the lock's connection
        is the interrupted request's: this beat counts as unconfirmed and stops campaigning
        without a release, leaving the client alone.
        """
        interrupted_ask = self._asking_lock_server
        cache = self.__dict__
        kept = {n: cache.pop(n) for n in _BROKER_CACHE if n in cache} if self._sending else {}
        try:
            if self._store_open and not interrupted_ask and self._confirmed(self._leadership):
                self._store_write_confirmed = True
                try:
                    self._base().close()
                finally:
                    self._store_write_confirmed = False
                    self._store_open = False
            else:
                self._drop_store()
                Scheduler.close(self)  # the publishing side only; no store was opened
        finally:
            try:
                if self._leadership is not None:
                    self._leadership.stop(release=not interrupted_ask)
                if not interrupted_ask:
                    self._dflock_client.close()
            finally:
                for name, value in kept.items():
                    cache.setdefault(name, value)

    @property
    def info(self) -> str:  # pyright: ignore[reportIncompatibleMethodOverride]
        """The banner lines: the wrapped scheduler's, then the lock."""
        wrapped = cast("str", self._base().info)
        mine = (
            f"    . dflock -> {self.lock_description} "
            f"(lease {self._dflock_settings.lease_ttl_s}s, sends only while held)"
        )
        return f"{wrapped}\n{mine}" if wrapped else mine


def _close_on_sigterm(sender: Any, **_: object) -> None:
    """``celery worker -B`` stops its embedded beat with SIGTERM, then sends one more as it
    exits, which (left at its default) would kill the process in the middle of the close and
    keep the lock held for its session's time. Here a stop closes the scheduler (the lock
    released) with further stops ignored, then exits, as ``celery beat`` does on its own."""
    if not isinstance(sender.scheduler, SingletonScheduler):
        return

    stops = (signal.SIGTERM, signal.SIGINT)

    def close_and_exit(signum: int, frame: object) -> None:
        for stop in stops:  # a second one (the worker's exit sends one) must not cut the close
            signal.signal(stop, signal.SIG_IGN)
        sender.sync()
        raise SystemExit

    for stop in stops:
        signal.signal(stop, close_and_exit)


def _name_this_beat(lock: DistributedLock) -> None:
    """Give the leader lock this beat's pid and host as its owner note (shown by
    ``celery dflock locks``; enqueue and wait carry none)."""
    note = beat_note(os.getpid(), socket.gethostname())
    if note is None or lock.token is None:
        return
    try:
        lock.note_token(lock.token, note)
    except DflockError as exc:  # HoldsUnsupported, or the server went away: no note
        logger.debug("beat: the leader lock carries no owner note: %s", exc)
