"""``celery-dflock demo``: a lock server, two real workers and two beats, then a timeline.

Everything runs on this machine with embedded defaults: the lock server in this process (on
a free port), the filesystem broker in a scratch folder (or ``--broker redis://...``), two
prefork workers and two singleton beats as child processes. Every process the demo starts is
stopped when it ends, also on Ctrl-C.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Generator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any, Literal, TextIO

from celery_dflock.demo.timeline import Verdict, judge, read_events, render
from dflockd_server import Config
from dflockd_server.testing import ServerThread

DEMO_APP = "celery_dflock.demo.app"
SYNC_ACCOUNT = f"{DEMO_APP}.sync_account"
BUILD_REPORT = f"{DEMO_APP}.build_report"
WORKERS = 2
WORKER_CONCURRENCY = 2
BEATS = 2
ACCOUNTS = ("acme", "globex", "initech")
RUNS_PER_ACCOUNT = 3
ACCOUNT_RUN_S = 0.8
REPORT_SENDS = 3
REPORT_RUN_S = 2.5
READY_TIMEOUT_S = 30.0
FINISH_TIMEOUT_S = 45.0
MIN_BEAT_S = 4.0
STOP_TIMEOUT_S = 10.0
BROKER_CHECK_TIMEOUT_S = 5
CELERY_ENV_OVERRIDES = frozenset({"CELERY_BROKER_URL", "CELERY_BROKER_READ_URL",
    "CELERY_BROKER_WRITE_URL", "CELERY_RESULT_BACKEND", "CELERY_CONFIG_MODULE"})  # fmt: skip


@dataclass(frozen=True, slots=True)
class Child:
    """A process the demo started, in its own process group, with its log file."""

    name: str
    process: subprocess.Popen[bytes]
    log: Path


class _Stop(Exception):
    """SIGTERM or SIGINT asked the demo to stop."""


class _StopRequest:
    """Notes SIGTERM/SIGINT; the demo stops at its next sleep, never halfway through a spawn."""

    def __init__(self) -> None:
        self.signal_name: str | None = None

    def handle(self, signum: int, _frame: FrameType | None) -> None:
        self.signal_name = signal.Signals(signum).name

    def sleep(self, seconds: float) -> None:
        if self.signal_name is None:
            time.sleep(seconds)
        if self.signal_name is not None:  # asked before, or while it slept
            raise _Stop(self.signal_name)


@contextmanager
def _children() -> Generator[list[Child]]:
    """Collect started children; on exit stop them all (TERM, then KILL) and reap them."""
    started: list[Child] = []
    try:
        yield started
    finally:
        for child in started:
            _signal_group(child.process, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in started:
            with suppress(subprocess.TimeoutExpired):
                child.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            # Whatever the group still holds (pool children of a worker) goes too.
            _signal_group(child.process, signal.SIGKILL)
            child.process.wait()


def _signal_group(process: subprocess.Popen[bytes], signum: signal.Signals) -> None:
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signum)


def _spawn(
    started: list[Child], env: dict[str, str], folder: Path, name: str, argv: Sequence[str]
) -> None:
    log = folder / f"{name}.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", DEMO_APP, *argv],
            env={**env, "DFLOCK_DEMO_NAME": name},
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            process_group=0,  # own group: stopped as a whole, and a terminal's Ctrl-C is ours
        )
    started.append(Child(name, process, log))


def _check_alive(started: Sequence[Child]) -> None:
    for child in started:
        if (code := child.process.poll()) is not None:
            tail = child.log.read_text(encoding="utf-8", errors="replace")[-2000:]
            raise RuntimeError(f"{child.name} exited with code {code}; its log ends:\n{tail}")


def _wait_ready(started: Sequence[Child], folder: Path, out: TextIO, stop: _StopRequest) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    names = [c.name for c in started]
    while not all((folder / f"ready-{name}").exists() for name in names):
        _check_alive(started)
        if time.monotonic() > deadline:
            raise RuntimeError(f"the workers were not ready within {READY_TIMEOUT_S:.0f} s")
        stop.sleep(0.1)
    out.write(f"workers ready: {', '.join(names)}\n")


def progress_state(
    verdict: Verdict, elapsed: float, expected_runs: int
) -> Literal["running", "done", "tasks late"]:
    """Where the demo is: ``"running"``, ``"done"`` (every task finished and a beat has sent,
    or no beat sent within the finish timeout), or ``"tasks late"``. It waits for a beat's
    first send: on a loaded machine the beats start more slowly than the tasks run."""
    account_runs = sum(1 for r in verdict.runs if r.key.startswith("account:"))
    report_runs = sum(1 for r in verdict.runs if r.key.startswith("report:"))
    tasks_done = (
        account_runs >= expected_runs
        and report_runs + verdict.skips >= REPORT_SENDS
        and not verdict.unfinished
    )
    late = elapsed > FINISH_TIMEOUT_S
    if tasks_done and elapsed >= MIN_BEAT_S and (verdict.beat_sends or late):
        return "done"
    return "tasks late" if late and not tasks_done else "running"


def broker_problem(url: str) -> str | None:
    """Why the workers could not use the broker at ``url`` (``--broker``), or None."""
    if not url.strip():
        return "empty; give a broker URL, or leave --broker out for the embedded one"
    from kombu.connection import Connection

    try:
        broker: Any = Connection(url, connect_timeout=BROKER_CHECK_TIMEOUT_S)
        if broker.transport_cls == "memory":
            return (
                "kombu's in-memory broker lives inside one process, and the demo's workers "
                "and beats are processes of their own; give a broker they share "
                "(redis://127.0.0.1:6379/0, amqp://...), or leave --broker out"
            )
        with broker:
            broker.ensure_connection(max_retries=1, timeout=BROKER_CHECK_TIMEOUT_S)
    except Exception as exc:  # any refusal of the URL, by kombu or its transport: said
        return f"{type(exc).__name__}: {exc}"
    return None


def run(broker: str | None, out: TextIO) -> int:
    """Run the demo; print progress, then the timeline and verdict. 0 on a passing verdict."""
    stop = _StopRequest()
    previous = {s: signal.signal(s, stop.handle) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _run(broker, out, stop)
    except _Stop as stopped:
        out.write(f"\ndemo stopped by {stopped}; every process it started has been stopped\n")
        return 130
    except RuntimeError as exc:
        out.write(f"\ndemo failed: {exc}\n")
        return 1
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _run(broker: str | None, out: TextIO, stop: _StopRequest) -> int:
    with (
        tempfile.TemporaryDirectory(prefix="dflock-demo-") as tmp,
        ServerThread(Config(host="127.0.0.1", port=0)) as server,
        _children() as started,
    ):
        folder = Path(tmp)
        (folder / "broker").mkdir()
        events = folder / "events.jsonl"
        # Celery lets these variables override the app's own broker setting; the demo's broker
        # is the embedded one (or --broker), whatever the shell has exported.
        env = {
            **{k: v for k, v in os.environ.items() if k not in CELERY_ENV_OVERRIDES},
            "DFLOCK_SERVERS": f"{server.host}:{server.port}",
            "DFLOCK_DEMO_BROKER": broker or "filesystem://",
            "DFLOCK_DEMO_BROKER_DIR": str(folder / "broker"),
            "DFLOCK_DEMO_QUEUE": f"dflock-demo-{uuid.uuid4().hex[:8]}",
            "DFLOCK_DEMO_EVENTS": str(events),
            "DFLOCK_DEMO_DIR": str(folder),
        }
        out.write(
            f"lock server on {server.host}:{server.port}; broker {env['DFLOCK_DEMO_BROKER']}; "
            f"starting {WORKERS} workers (prefork, concurrency {WORKER_CONCURRENCY}) "
            f"and {BEATS} beats\n"
        )
        for i in range(1, WORKERS + 1):
            argv = [
                "worker", "-P", "prefork", "-c", str(WORKER_CONCURRENCY),
                "-n", f"worker-{i}@%h", "--loglevel", "WARNING",
                "--without-heartbeat", "--without-mingle", "--without-gossip",
            ]  # fmt: skip
            _spawn(started, env, folder, f"worker-{i}", argv)
        _wait_ready(started, folder, out, stop)
        for i in range(1, BEATS + 1):
            argv = [
                "beat", "-S", f"{DEMO_APP}:DemoScheduler",
                "-s", str(folder / f"beat-{i}.schedule"), "--loglevel", "WARNING",
            ]  # fmt: skip
            _spawn(started, env, folder, f"beat-{i}", argv)
        for name in CELERY_ENV_OVERRIDES:
            os.environ.pop(name, None)
        os.environ.update(env)  # the app module reads its settings at import
        from celery_dflock.demo.app import app

        began = time.monotonic()
        for _ in range(RUNS_PER_ACCOUNT):
            for account in ACCOUNTS:
                app.send_task(SYNC_ACCOUNT, kwargs={"account": account, "seconds": ACCOUNT_RUN_S})
        for _ in range(REPORT_SENDS):
            app.send_task(BUILD_REPORT, kwargs={"name": "daily", "seconds": REPORT_RUN_S})
            stop.sleep(0.4)
        expected_runs = len(ACCOUNTS) * RUNS_PER_ACCOUNT
        out.write(
            f"sent {expected_runs} sync_account tasks on {len(ACCOUNTS)} "
            f"accounts (on_locked='retry') and {REPORT_SENDS} build_report tasks "
            "(on_locked='skip')\n"
        )
        interactive = out.isatty()
        last_line = "[  0.0s]"
        while True:
            _check_alive(started)
            verdict = judge(read_events(events))
            elapsed = time.monotonic() - began
            line = (
                f"[{elapsed:5.1f}s] runs finished {len(verdict.runs)}/{expected_runs + 1}  "
                f"retries {verdict.retries}  skips {verdict.skips}  "
                f"beat sends {sum(verdict.beat_sends.values())}"
            )
            if interactive:
                out.write(f"\r{line}   ")
                out.flush()
            elif line[9:] != last_line[9:]:  # a log: one line per change, not per poll
                out.write(line + "\n")
                last_line = line
            state = progress_state(verdict, elapsed, expected_runs)
            if state == "done":
                break
            if state == "tasks late":
                out.write("\n")
                account_runs = sum(1 for r in verdict.runs if r.key.startswith("account:"))
                raise RuntimeError(
                    f"the tasks did not finish within {FINISH_TIMEOUT_S:.0f} s "
                    f"({account_runs}/{expected_runs} account runs)"
                )
            stop.sleep(0.25)
        out.write("\n\n" if interactive else "\n")
        out.write(f"{render(verdict)}\n")
        standby = [
            f"beat-{i}" for i in range(1, BEATS + 1) if f"beat-{i}" not in verdict.beat_sends
        ]
        out.write(f"standby beats (waited for the beat lock, sent nothing): {', '.join(standby)}\n")
        return 0 if verdict.passed() else 1
