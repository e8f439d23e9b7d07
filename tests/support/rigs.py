"""The one rig of the tests that run real workers: a real lock server, real ``celery worker``
subprocesses of one app module on a real broker, the run log they write to, and client apps in
the test process. Used by tests/celery and tests/faults through their own ``rig`` fixtures
(module- or test-scoped, on the broker and server each module needs), built with
:func:`open_rig`.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from celery import Celery

from celery_dflock import DistributedLock
from dflockd_server import Config
from dflockd_server.testing import ServerThread
from tests.support.apps import make_app
from tests.support.workers import EventLog, Worker, WorkerFactory, close_app

RigT = TypeVar("RigT", bound="Rig")

HOLDER_WAIT_S = 2.0
"""How long :meth:`Rig.holder` waits for a key it takes as "another worker"."""


@dataclass
class Rig:
    """What one test (or one module's tests) runs against; :meth:`close` ends it all.

    ``settings`` are the Celery settings of the workers and of :attr:`app` (broker, backend,
    queue, ``dflock_servers`` when the rig has a lock server); a worker or client app may add
    its own on top. ``address`` is the lock server's.
    """

    tmp: Path
    log: EventLog
    app_module: str
    settings: dict[str, Any]
    app: Celery
    factory: WorkerFactory
    address: tuple[str, int] | None = None
    server: ServerThread | None = None
    """The in-process lock server, when the rig started one (see :func:`open_rig`)."""
    tasks: dict[str, Any] = field(default_factory=dict[str, Any])
    """The app module's tasks defined on :attr:`app` (``define_tasks`` of :func:`open_rig`)."""
    apps: list[Celery] = field(default_factory=list[Celery])

    @property
    def worker(self) -> Worker:
        """The first worker this rig started."""
        return self.factory.workers[0]

    def start_worker(
        self,
        *,
        settings: Mapping[str, Any] | None = None,
        pool: str = "prefork",
        concurrency: int = 2,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> Worker:
        """A ready ``celery -A <app_module> worker`` on the rig's settings plus ``settings``."""
        return self.factory.start(
            self.app_module,
            pool=pool,
            concurrency=concurrency,
            settings=dict(settings or {}),
            extra_args=extra_args,
            env=env,
        )

    def client(self, settings: Mapping[str, Any], main: str = "dflock-rig-client") -> Celery:
        """Another client app (closed with the rig) on ``settings`` alone."""
        app = make_app(main, settings)
        self.apps.append(app)
        return app

    def send(self, task: str, *args: Any, **options: Any) -> Any:
        """``send_task("<app_module>.<task>", args, **options)`` through :attr:`app`."""
        return self.app.send_task(f"{self.app_module}.{task}", args, **options)

    def lock(self, key: str, wait_s: float) -> DistributedLock:
        """A lock on ``key`` at the rig's lock server that waits up to ``wait_s`` for it."""
        assert self.address is not None, "this rig has no lock server"
        return DistributedLock(key, acquire_timeout_s=wait_s, servers=[self.address])

    def holder(self, key: str) -> DistributedLock:
        """``key`` taken by "another worker" (this test); the test releases it."""
        lock = self.lock(key, HOLDER_WAIT_S)
        assert lock.acquire()
        return lock

    def key_free(self, key: str, wait_s: float) -> bool:
        """True once ``key`` can be taken (waiting up to ``wait_s`` in its FIFO queue); the
        lock taken to find out is released at once."""
        lock = self.lock(key, wait_s)
        got = lock.acquire()
        if got:
            lock.release()
        return got

    def release_file(self, name: str) -> Path:
        """The file whose creation lets a blocking run of ``name`` end."""
        return self.tmp / f"release-{name}"

    def close(self) -> None:
        self.factory.close()
        for app in [self.app, *self.apps]:
            close_app(app)
        self.log.close()


@contextlib.contextmanager
def open_rig(
    tmp: Path,
    app_module: str,
    settings: Mapping[str, Any] | None = None,
    *,
    server: Config | tuple[str, int] | None = None,
    main: str = "dflock-rig-client",
    define_tasks: Callable[[Celery], dict[str, Any]] | None = None,
    cleanup: Callable[[], object] | None = None,
    rig_class: type[RigT] = Rig,
) -> Iterator[RigT]:
    """A :class:`Rig` in ``tmp`` for workers of ``app_module`` (no worker started yet).

    ``server``: a ``Config`` starts an in-process lock server (stopped on the way out); an
    address uses a server the caller runs; either goes into ``dflock_servers``. None: the
    settings name the servers, or each worker brings its own (tests/faults).
    ``define_tasks`` defines the app module's tasks on the rig's client app (:attr:`Rig.tasks`).
    ``cleanup`` runs last (e.g. deleting the test's Redis queues). ``rig_class``: a subclass
    of :class:`Rig` with a module's own helpers (its own fields need defaults).
    """
    with contextlib.ExitStack() as stack:
        if cleanup is not None:
            stack.callback(cleanup)
        thread: ServerThread | None = None
        address: tuple[str, int] | None = None
        if isinstance(server, Config):
            thread = stack.enter_context(ServerThread(server))
            address = thread.address
        elif server is not None:
            address = server
        full = dict(settings or {})
        if address is not None:
            full["dflock_servers"] = f"{address[0]}:{address[1]}"
        log = EventLog(tmp)
        app = make_app(main, full)
        rig = rig_class(
            tmp=tmp,
            log=log,
            app_module=app_module,
            settings=full,
            app=app,
            factory=WorkerFactory(log=log, directory=tmp, settings=full),
            address=address,
            server=thread,
            tasks=define_tasks(app) if define_tasks is not None else {},
        )
        stack.callback(rig.close)
        yield rig


def unique(prefix: str) -> str:
    """``prefix`` plus a random suffix: a name (queue, key, run) no other test uses."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"
