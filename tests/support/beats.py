"""Real ``celery beat`` / ``celery worker`` subprocesses of the beat tests' app
(tests/beat/beatapp.py), and the Redis view.

* :class:`Proc` -- one Celery subprocess in its own process group; its output is read by a
  thread, so a test *waits* for a log line (``wait_line``) instead of sleeping.
* :class:`Cluster` -- starts beats and workers of the test app ``beatapp`` with one settings
  dict, and kills every process group at teardown.
* :class:`Broker` -- the Redis view: the messages beat queued (each stamped by ``beatapp`` with
  the sending pid and time) and the run/skip records the test tasks append.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import redis

from tests.support.processes import kill_group, python_path, signal_group
from tests.support.services import redis_url
from tests.support.workers import worker_command

BEAT_APP_DIR = Path(__file__).resolve().parent.parent / "beat"
"""Where the app ``beatapp`` is (the processes import it by that name, the name its task
names and schedule entries carry)."""
REDIS_URL = redis_url("beats")

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0

ACTIVE = re.compile(r"beat: active, holding")
STANDBY = re.compile(r"beat: standby, waiting for")
LOST = re.compile(r"beat: lost ")
SCHEDULER = "celery_dflock.beat:SingletonScheduler"
STARTED = re.compile(r"beat: (standby, waiting|active, holding)")


class Proc:
    """One Celery subprocess, leader of its own process group, output collected by a thread."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], cwd: Path) -> None:
        self.name = name
        self.output_path = cwd / f"{name}.out"
        self._lines: list[str] = []
        self._cond = threading.Condition()
        self.proc = subprocess.Popen(
            command,
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._reader = threading.Thread(target=self._read, name=f"out-{name}", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.output_path.open("w") as copy:
            for raw in self.proc.stdout:
                line = raw.decode(errors="replace").rstrip("\n")
                copy.write(line + "\n")
                copy.flush()
                with self._cond:
                    self._lines.append(line)
                    self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def lines(self) -> list[str]:
        with self._cond:
            return list(self._lines)

    def count(self, pattern: re.Pattern[str]) -> int:
        return sum(1 for line in self.lines() if pattern.search(line))

    def output(self, tail: int = 60) -> str:
        return "\n".join(self.lines()[-tail:])

    def wait_line(self, pattern: re.Pattern[str], timeout: float, count: int = 1) -> str:
        """Wait until ``count`` output lines match ``pattern``; return the last of them."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = [line for line in self._lines if pattern.search(line)]
                if len(found) >= count:
                    return found[count - 1]
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(
                        f"{self.name}: no {count} x {pattern.pattern!r} within {timeout}s "
                        f"(exit code {self.proc.poll()}):\n{self.output()}"
                    )
                self._cond.wait(min(left, 0.5))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, signum: int) -> None:
        """Send ``signum`` to the whole process group."""
        signal_group(self.proc.pid, signum)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM (a warm shutdown) and wait; SIGKILL the group if it hangs."""
        self.send(signal.SIGCONT)
        self.send(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.name} ignored SIGTERM:\n{self.output()}") from None

    def kill(self) -> None:
        """SIGKILL the whole process group and reap it."""
        kill_group(self.proc)
        self._reader.join(5)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def base_settings(queue: str, server: tuple[str, int]) -> dict[str, Any]:
    """Celery + dflock settings shared by the beats and workers of one test."""
    return {
        "broker_url": REDIS_URL,
        "result_backend": REDIS_URL,
        "task_default_queue": queue,
        "broker_connection_retry_on_startup": True,
        "broker_transport_options": {"polling_interval": 0.05},
        "worker_prefetch_multiplier": 1,
        "worker_hijack_root_logger": False,
        "beat_max_loop_interval": 1,
        "beat_schedule": {"every-second": {"task": "beatapp.tick", "schedule": 1.0}},
        "dflock_servers": f"{server[0]}:{server[1]}",
        "dflock_beat_lock_key": f"beat-test:{queue}",
        "dflock_beat_lease_ttl": 10,
        "task_ignore_result": True,
    }


@dataclass
class Cluster:
    """Beats and workers of ``beatapp`` for one test; every process is killed at teardown."""

    directory: Path
    settings: dict[str, Any]
    procs: list[Proc] = field(default_factory=list[Proc])
    extra_env: dict[str, str] = field(default_factory=dict[str, str])

    def _env(self, name: str) -> dict[str, str]:
        return {
            **os.environ,
            **self.extra_env,
            "BEAT_TEST_SETTINGS": json.dumps(self.settings),
            "BEAT_TEST_NAME": name,
            "PYTHONPATH": python_path(BEAT_APP_DIR),
            "PYTHONUNBUFFERED": "1",
        }

    def run_python(self, code: str, timeout: float = START_TIMEOUT_S) -> None:
        """Run ``code`` in a fresh interpreter with the cluster's environment (must succeed)."""
        done = subprocess.run(
            [sys.executable, "-c", code],
            cwd=self.directory,
            env=self._env("setup"),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr

    def dflock_cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        """``celery -A beatapp dflock ARGS`` with the cluster's settings, as a user runs it."""
        return subprocess.run(
            [sys.executable, "-m", "celery", "-A", "beatapp", "dflock", *args],
            cwd=self.directory,
            env=self._env("cli"),
            capture_output=True,
            text=True,
            timeout=START_TIMEOUT_S,
            check=False,
        )

    def start_beats(self, count: int, own_schedule_file: bool = True) -> list[Proc]:
        """Start ``count`` beats at once; return when every one is active or standing by.

        ``own_schedule_file=False`` leaves out ``-s``: the beat keeps beat's default
        ``celerybeat-schedule`` in the cluster's folder, the one file every beat started so shares.
        """
        procs = [self._spawn_beat(own_schedule_file) for _ in range(count)]
        for proc in procs:
            proc.wait_line(STARTED, START_TIMEOUT_S)
        return procs

    def start_beat(self, own_schedule_file: bool = True) -> Proc:
        """Start one beat; return when it is active or standing by."""
        return self.start_beats(1, own_schedule_file)[0]

    def _spawn_beat(self, own_schedule_file: bool = True) -> Proc:
        name = f"beat{sum(p.name.startswith('beat') for p in self.procs) + 1}"
        schedule = ["-s", str(self.directory / f"{name}-schedule")] if own_schedule_file else []
        command = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "beatapp",
            "beat",
            "-S",
            SCHEDULER,
            *schedule,
            "--pidfile=",
            "-l",
            "INFO",
        ]
        proc = Proc(name, command, self._env(name), self.directory)
        self.procs.append(proc)
        return proc

    def start_worker(self, concurrency: int = 3, *, beat: bool = False) -> Proc:
        """Start a prefork worker on the test queue; return once it is ready. ``beat``: with
        an embedded ``SingletonScheduler`` beat (``-B``), consuming another queue, so what
        it sends stays in the test queue."""
        name = f"worker{sum(p.name.startswith('worker') for p in self.procs) + 1}"
        queue = self.settings["task_default_queue"]
        schedule = str(self.directory / f"{name}-schedule")
        command = worker_command(
            "beatapp",
            pool="prefork",
            concurrency=concurrency,
            name=f"{name}-{uuid.uuid4().hex[:6]}@beat-test",
            queue=f"{queue}-worker" if beat else queue,
            extra_args=("-B", "--scheduler", SCHEDULER, "-s", schedule) if beat else (),
        )
        proc = Proc(name, command, self._env(name), self.directory)
        self.procs.append(proc)
        proc.wait_line(re.compile(r"\bready\.$"), START_TIMEOUT_S)
        return proc

    def beats(self) -> list[Proc]:
        return [p for p in self.procs if p.name.startswith("beat")]

    def by_pid(self, pid: int) -> Proc:
        """The process with main pid ``pid``."""
        for proc in self.procs:
            if proc.pid == pid:
                return proc
        raise AssertionError(f"no process of this test has pid {pid}")

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()


@dataclass(frozen=True)
class Sent:
    """One message beat queued: the entry, and the pid, send time and run time (when beat
    reserved the run: ``None`` if the sender found no schedule entry) stamped by the sender."""

    entry: str
    pid: int
    at: float
    headers: dict[str, Any]
    run_at: float | None = None


class Broker:
    """Read what beats queued (no worker consuming) and what test tasks recorded."""

    def __init__(self, queue: str) -> None:
        self.queue = queue
        self.client = redis.Redis.from_url(REDIS_URL)

    def sent(self) -> list[Sent]:
        """Every message waiting in the test queue, oldest first."""
        raw: list[bytes] = self.client.lrange(self.queue, 0, -1)  # type: ignore[assignment]
        messages: list[Sent] = []
        for item in reversed(raw):  # kombu LPUSHes, consumers pop from the right
            headers: dict[str, Any] = json.loads(item)["headers"]
            messages.append(
                Sent(
                    entry=str(headers.get("test_entry") or headers.get("task")),
                    pid=int(headers["test_pid"]),
                    at=float(headers["test_sent_at"]),
                    headers=headers,
                    run_at=headers.get("test_run_at"),
                )
            )
        return messages

    def wait_sent(
        self, count: int, timeout: float, after: float | None = None, **match: Any
    ) -> list[Sent]:
        """Wait until at least ``count`` queued messages match (polls Redis every 50 ms):
        ``match``'s fields equal, and sent later than ``after`` (a ``time.time()``) if given."""
        deadline = time.monotonic() + timeout
        while True:
            found = [
                m
                for m in self.sent()
                if all(getattr(m, k) == v for k, v in match.items())
                and (after is None or m.at > after)
            ]
            if len(found) >= count:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"only {len(found)} of {count} messages matching {match} within {timeout}s"
                )
            time.sleep(0.05)

    def records(self, kind: str) -> list[dict[str, Any]]:
        """Records the test tasks appended (``kind`` is "runs" or "skipped")."""
        raw: list[bytes] = self.client.lrange(f"{self.queue}:{kind}", 0, -1)  # type: ignore[assignment]
        return [json.loads(item) for item in raw]

    def cleanup(self) -> None:
        keys = list(self.client.scan_iter(match=f"{self.queue}*"))
        keys += list(self.client.scan_iter(match=f"_kombu.binding*.{self.queue}"))
        if keys:
            self.client.delete(*keys)
        self.client.close()


def iter_overlaps(runs: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    """Pairs of runs (by [start, end]) of the same entry that overlap in time."""
    ordered = sorted(runs, key=lambda r: r["start"])
    for before, after in itertools.pairwise(ordered):
        if after["start"] < before["end"]:
            yield before, after


def max_for_one_beat(sent: list[Sent], period: float) -> int:
    """The most sends one beat can make between the first and last of ``sent`` (+1 period)."""
    if not sent:
        return 0
    span = max(m.at for m in sent) - min(m.at for m in sent)
    return int(span / period) + 2


def assert_no_double_send(sent: list[Sent], period: float) -> None:
    """No run of the entry is sent twice: the runs sent, by their run times (when beat reserved
    each), are at least 0.9 period apart, whichever beats sent them.

    Beat reserves a run (its ``last_run_at`` becomes now) only when the entry is due, a period
    after the run before (the new leader's first: a period after its takeover); the lock
    server's confirm and the publish come after that. So runs stay a period apart however late
    a send leaves, and send times do not: after a late send the next run may leave on time,
    less than a period after it. Celery 5.3 times the next run from the reserve (CI: 0.12 s
    late, the next 0.88 s after it), and so does django-celery-beat's ``DatabaseScheduler``,
    with any Celery, when it reloads its entries on a change: it rebuilds beat's heap from the
    database, which holds the reserve time (a send 0.8 s late on a loaded machine, then the
    edit's reload: the next run 0.2 s after it). A run sent twice carries its run time again,
    or is reserved again at once (a scheduler that lost the record of the first); two active
    beats interleave their runs, and some two come within half a period.
    """
    missing = [m for m in sent if m.run_at is None]
    assert not missing, f"sends without a run time (test_run_at): {missing}"
    ordered = sorted(sent, key=lambda m: cast("float", m.run_at))
    for before, after in itertools.pairwise(ordered):
        gap = cast("float", after.run_at) - cast("float", before.run_at)
        assert gap >= 0.9 * period, (
            f"two runs within one period: pid {before.pid} ran at {before.run_at:.3f} "
            f"(sent {before.at:.3f}), pid {after.pid} ran at {after.run_at:.3f} "
            f"(sent {after.at:.3f})"
        )
