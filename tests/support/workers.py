"""Real Celery worker subprocesses for the tests (prefork, threads, solo), and their run log.

Used through the fixtures in ``tests/celery/conftest.py`` (and by tests/faults and
tests/interop directly):

* :class:`EventLog` -- the JSON-lines log task bodies append to
  (``apps.common.record``), plus a datagram socket so a test can *wait* for an
  event instead of sleeping.
* :class:`Worker` / :class:`WorkerFactory` -- ``python -m celery -A <module>
  worker`` in its own process group, started with the whole Celery config in
  the environment, ready when its ``worker_ready`` event arrives, killed (the
  whole group) at teardown.
* :func:`filesystem_settings` / :func:`redis_settings` -- broker + backend
  settings for one test, isolated by directory or by queue name.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The filesystem broker: kombu's own ``filesystem://`` transport writes a message file in place
# and its reader takes any file with the queue's name, so a worker polling at that moment dies
# on a half-written message. The demo's transport renames complete messages into place; it is
# imported by the public name its module exports for exactly this use (``TRANSPORT``, "for the
# demo and the test harness"), here and nowhere else in the tests.
from celery_dflock.demo.fsbroker import TRANSPORT as FILESYSTEM_TRANSPORT
from tests.support.processes import kill_group, python_path
from tests.support.services import RABBITMQ_URL, REDIS_DBS, REDIS_URL_BASE

REPO = Path(__file__).resolve().parents[2]
CELERY_APPS_DIR = REPO / "tests" / "celery"
"""Where the worker apps are: a worker imports them as ``apps.tasks`` / ``apps.plain``, the
names their task names carry (tests send ``apps.tasks.<task>`` and assert on those names)."""

READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
REDIS_TEST_DB = REDIS_DBS["workers"]

Entry = dict[str, Any]


class EventLog:
    """The run log of one test: a JSON-lines file plus a datagram socket for wake-ups."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / "runs.log"
        self.path.touch()
        # AF_UNIX paths are limited to ~107 bytes: keep the socket in a short temp dir.
        self._sock_dir = tempfile.mkdtemp(prefix="dfl-ev-")
        self.socket_path = os.path.join(self._sock_dir, "events.sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self.socket_path)
        self._sock.settimeout(0.2)
        self._events: list[Entry] = []
        self._cond = threading.Condition()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._receive, name="event-log", daemon=True)
        self._thread.start()

    def _receive(self) -> None:
        while not self._closed.is_set():
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            with self._cond:
                self._events.append(json.loads(data))
                self._cond.notify_all()

    @property
    def env(self) -> dict[str, str]:
        """Environment a worker needs to write to this log."""
        return {"DFLOCK_TEST_LOG": str(self.path), "DFLOCK_TEST_EVENTS": self.socket_path}

    def entries(self, event: str | None = None, **match: Any) -> list[Entry]:
        """Every logged line (the file is the authority), optionally filtered."""
        lines = self.path.read_text().splitlines()
        found = [json.loads(line) for line in lines if line.strip()]
        return [e for e in found if _matches(e, event, match)]

    def events(self, event: str | None = None, **match: Any) -> list[Entry]:
        """Events received over the socket so far, optionally filtered."""
        with self._cond:
            return [e for e in self._events if _matches(e, event, match)]

    def wait_for(
        self, predicate: Callable[[list[Entry]], bool], timeout: float, what: str
    ) -> list[Entry]:
        """Block until ``predicate(events)`` holds; fail with ``what`` after ``timeout`` s."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not predicate(self._events):
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(
                        f"timed out after {timeout}s waiting for {what}; "
                        f"events: {self._events[-20:]}"
                    )
                self._cond.wait(left)
            return list(self._events)

    def wait_event(self, event: str, timeout: float = 30.0, count: int = 1, **match: Any) -> Entry:
        """The ``count``-th event named ``event`` matching ``match`` (waits for it)."""
        self.wait_for(
            lambda evs: sum(_matches(e, event, match) for e in evs) >= count,
            timeout,
            f"{count} x {event} {match}",
        )
        return self.events(event, **match)[count - 1]

    def close(self) -> None:
        self._closed.set()
        self._sock.close()
        self._thread.join(5)
        shutil.rmtree(self._sock_dir, ignore_errors=True)


def _matches(entry: Entry, event: str | None, match: dict[str, Any]) -> bool:
    if event is not None and entry.get("event") != event:
        return False
    return all(entry.get(k) == v for k, v in match.items())


@dataclass
class Worker:
    """One ``celery worker`` subprocess, leader of its own process group."""

    name: str
    proc: subprocess.Popen[bytes]
    output_path: Path
    pid: int = 0
    """The worker's main process id (from its ``worker_ready`` event)."""

    def output(self) -> str:
        return self.output_path.read_text(errors="replace")

    def wait_output(self, text: str, timeout: float = 10.0) -> bool:
        """True once ``text`` shows up in the worker's output (checked every 50 ms)."""
        deadline = time.monotonic() + timeout
        while text not in self.output():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send_signal(self, signum: int) -> None:
        """Send ``signum`` to the main worker process only."""
        if self.alive():
            os.kill(self.proc.pid, signum)

    def stop(self, signum: int = signal.SIGTERM, timeout: float = STOP_TIMEOUT_S) -> int:
        """Ask the worker to shut down (SIGTERM: warm) and wait; kill the group if it hangs."""
        self.send_signal(signum)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(
                f"worker {self.name} did not stop within {timeout}s:\n{self.output()[-3000:]}"
            ) from None

    def kill(self) -> None:
        """SIGKILL the worker's whole process group (main process and pool children)."""
        kill_group(self.proc)


def worker_command(
    app: str,
    *,
    pool: str,
    concurrency: int,
    name: str,
    queue: str,
    extra_args: tuple[str, ...] = (),
) -> list[str]:
    """``celery -A <app> worker`` on ``queue`` under this interpreter, logging at INFO, without
    gossip, mingle and heartbeats (a test's workers need none of them, and they slow start-up)."""
    return [
        sys.executable, "-m", "celery", "-A", app, "worker", "-P", pool, "-c", str(concurrency),
        "-n", name, "-Q", queue, "--without-gossip", "--without-mingle", "--without-heartbeat",
        "-l", "INFO", *extra_args,
    ]  # fmt: skip


@dataclass
class WorkerFactory:
    """Starts workers for one test and kills them all at teardown."""

    log: EventLog
    directory: Path
    settings: dict[str, Any]
    workers: list[Worker] = field(default_factory=list[Worker])

    def start(
        self,
        app: str = "apps.tasks",
        *,
        pool: str = "prefork",
        concurrency: int = 2,
        settings: dict[str, Any] | None = None,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> Worker:
        """Start ``celery -A <app> worker`` and return once it is ready to consume."""
        name = f"w{len(self.workers) + 1}-{uuid.uuid4().hex[:6]}@dflock"
        all_settings = {**self.settings, **(settings or {})}
        worker_env = {
            **os.environ,
            **self.log.env,
            "DFLOCK_TEST_SETTINGS": json.dumps(all_settings),
            "DFLOCK_TEST_WORKER": name,
            "PYTHONPATH": python_path(CELERY_APPS_DIR, REPO),
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        output = self.directory / f"{name.split('@', maxsplit=1)[0]}.out"
        command = worker_command(
            app,
            pool=pool,
            concurrency=concurrency,
            name=name,
            queue=all_settings["task_default_queue"],
            extra_args=extra_args,
        )
        with output.open("wb") as out:
            proc = subprocess.Popen(
                command,
                cwd=self.directory,
                env=worker_env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        worker = Worker(name=name, proc=proc, output_path=output)
        self.workers.append(worker)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            ready = self.log.events("worker_ready", worker=name)
            if ready:
                worker.pid = ready[0]["pid"]
                return worker
            if not worker.alive() or time.monotonic() > deadline:
                worker.kill()
                raise AssertionError(
                    f"worker {name} did not become ready:\n{worker.output()[-4000:]}"
                )
            try:
                self.log.wait_for(
                    lambda evs: any(
                        e.get("event") == "worker_ready" and e.get("worker") == name for e in evs
                    ),
                    timeout=0.5,
                    what="worker_ready",
                )
            except AssertionError:
                continue  # re-check that the process is still alive

    def close(self) -> None:
        for worker in self.workers:
            worker.kill()


def common_settings(queue: str) -> dict[str, Any]:
    return {
        "task_default_queue": queue,
        "worker_prefetch_multiplier": 1,
        "broker_connection_retry_on_startup": True,
        "worker_hijack_root_logger": False,
        "result_expires": 600,
        # Report a killed pool child's task at once (default: after 10 s).
        "worker_lost_wait": 1.0,
    }


def filesystem_settings(directory: Path, queue: str) -> dict[str, Any]:
    """Settings for kombu's filesystem broker and the file result backend under ``directory``."""
    data = directory / "broker-data"
    control = directory / "broker-control"
    results = directory / "results"
    for d in (data, control, results):
        d.mkdir(parents=True, exist_ok=True)
    return {
        **common_settings(queue),
        "broker_url": "filesystem://",
        # kombu's filesystem transport writes a message in place, and a worker polling at that
        # moment dies on the half-written file; this one renames complete messages into place.
        "broker_transport": FILESYSTEM_TRANSPORT,
        "broker_transport_options": {
            "data_folder_in": str(data),
            "data_folder_out": str(data),
            "control_folder": str(control),
            "polling_interval": 0.05,
        },
        "result_backend": f"file://{results}",
    }


def redis_settings(queue: str, db: int = REDIS_TEST_DB) -> dict[str, Any]:
    """Settings for the Redis broker and backend on database ``db``."""
    url = f"{REDIS_URL_BASE}/{db}"
    return {
        **common_settings(queue),
        "broker_url": url,
        "result_backend": url,
        "broker_transport_options": {"polling_interval": 0.05, **redis_unacked_keys(queue)},
    }


def redis_unacked_keys(queue: str) -> dict[str, str]:
    """kombu's Redis keys of the messages a worker reserved and has not acknowledged, named
    after ``queue`` (so ``redis_cleanup`` deletes them too).

    kombu keeps them in one hash per database by default (``unacked``), and every worker on
    the database sweeps that hash, giving back to their queues the messages older than its
    own ``visibility_timeout``. A test whose workers use a short one (a few seconds, to see
    an acks_late message delivered again) would then deliver again the messages another
    test's worker holds until they are due, as any countdown is held (a retry, an outage
    retry): run a second time, while the worker still has the first copy. Per queue, a
    test's workers sweep their own messages only."""
    return {
        "unacked_key": f"{queue}.unacked",
        "unacked_index_key": f"{queue}.unacked_index",
        "unacked_mutex_key": f"{queue}.unacked_mutex",
    }


def rabbitmq_settings(queue: str, db: int = REDIS_TEST_DB) -> dict[str, Any]:
    """Settings for the RabbitMQ broker, with results in Redis database ``db``."""
    return {
        **common_settings(queue),
        "broker_url": RABBITMQ_URL,
        "result_backend": f"{REDIS_URL_BASE}/{db}",
    }


def close_app(app: Any) -> None:
    """Close a client app and every connection its result backend opened (Redis's result
    consumer keeps a pub/sub connection that ``app.close()`` leaves to the garbage collector,
    which then warns in whichever test happens to run)."""
    import gc

    gc.collect()  # finished AsyncResults unsubscribe now, while the connection is open
    backend = getattr(app._local, "backend", None)  # only if this thread's app made one
    if backend is not None:
        consumer = getattr(backend, "result_consumer", None)
        if consumer is not None:
            consumer.stop()
        client = getattr(backend, "client", None)
        if client is not None:
            client.close()
            client.connection_pool.disconnect()
    app.close()
    # What Celery's canvas (a chord over the Redis backend) leaves to the garbage collector
    # holds a Redis connection it never closes: collect it here, quietly, rather than in
    # whichever later test the collector happens to run in.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        gc.collect()


def with_server(settings: dict[str, Any], server: Any, **extra: Any) -> dict[str, Any]:
    """``settings`` plus ``dflock_servers`` pointing at ``server`` (a ServerThread)."""
    return {**settings, "dflock_servers": f"{server.host}:{server.port}", **extra}


def redis_cleanup(queue: str, db: int = REDIS_TEST_DB) -> None:
    """Delete this test's queue and binding keys (results expire; other tests' keys stay)."""
    import redis

    client = redis.Redis.from_url(f"{REDIS_URL_BASE}/{db}")
    try:
        keys = [
            key
            for pattern in (f"{queue}*", f"_kombu.binding.{queue}*", f"_kombu.binding_*.{queue}*")
            for key in client.scan_iter(match=pattern)
        ]
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def iter_overlaps(runs: list[Entry]) -> Iterator[tuple[Entry, Entry]]:
    """Pairs of ``run`` entries on the same key whose [start, end] intervals overlap."""
    by_key: dict[str, list[Entry]] = {}
    for run in runs:
        by_key.setdefault(run["key"], []).append(run)
    for key_runs in by_key.values():
        key_runs.sort(key=lambda r: r["start"])
        for before, after in itertools.pairwise(key_runs):
            if after["start"] < before["end"]:
                yield before, after
