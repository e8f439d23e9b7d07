"""Processes a test starts: signalling and killing whole process groups, and running a
function in a forked child."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tests.support.waiting import wait_until

KILL_WAIT_S = 10.0
FORK_CHILD_TIMEOUT_S = 20.0


FAVOURED_NICE = -10
"""The niceness `favour` gives a measured process: ahead of the rest of the suite."""


def favour(pid: int) -> bool:
    """Schedule every thread of process ``pid`` ahead of other work on the machine (niceness
    `FAVOURED_NICE`); threads it starts later inherit it. False (nothing changed) where that is
    not allowed (not root, no ``CAP_SYS_NICE``).

    For the latency a test measures (the abuse suite's healthy client and its server): with the
    suite in two processes, the other one's Celery workers share the cores, and that would be
    measured instead of the abuse. The abusers themselves run last (``SCHED_IDLE``)."""
    try:
        threads = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
        for tid in threads:
            os.setpriority(os.PRIO_PROCESS, tid, FAVOURED_NICE)
    except (PermissionError, FileNotFoundError, ProcessLookupError):
        return False
    return True


def python_path(*directories: Path) -> str:
    """A ``PYTHONPATH`` for a child process: ``directories`` first, then this one's."""
    inherited = os.environ.get("PYTHONPATH")
    return os.pathsep.join([*map(str, directories), *([inherited] if inherited else [])])


def signal_group(pid: int, signum: int) -> None:
    """Send ``signum`` to the process group led by ``pid`` (a process started with
    ``start_new_session=True`` or ``process_group=0``); nothing if the group is gone."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signum)


def kill_group(proc: subprocess.Popen[Any], timeout: float | None = KILL_WAIT_S) -> None:
    """SIGKILL ``proc``'s whole process group (its children too) and reap ``proc`` (waiting
    at most ``timeout`` seconds; ``None``: as long as it takes)."""
    signal_group(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout)


def run_in_fork(
    child: Callable[[], dict[str, object]], timeout: float = FORK_CHILD_TIMEOUT_S
) -> tuple[int, dict[str, object]]:
    """Run ``child()`` in a forked child; its exit code and the dict it returned (as JSON).

    An exception in the child is reported as ``{"error": repr(exc)}`` with exit code 1.
    """
    read_fd, write_fd = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # 3.12+: fork with threads
        pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child, reported through the pipe
        code = 1
        try:
            os.close(read_fd)
            report = child()
            code = 0
        except BaseException as exc:
            report = {"error": repr(exc)}
        try:
            os.write(write_fd, json.dumps(report).encode())
        finally:
            os._exit(code)
    os.close(write_fd)
    data = b""
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([read_fd], [], [], deadline - time.monotonic())
            if not ready:
                break
            chunk = os.read(read_fd, 65536)
            if not chunk:
                break
            data += chunk
        while (waited := os.waitpid(pid, os.WNOHANG)) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                raise AssertionError("the forked child did not finish")
            time.sleep(0.01)
    finally:
        os.close(read_fd)
    return os.waitstatus_to_exitcode(waited[1]), json.loads(data or b"{}")


def main_thread_waits_on_io(pid: int) -> bool:
    """Whether the main thread of process ``pid`` sleeps in the kernel on something other than
    a lock (Linux /proc: state ``S``, its ``wchan`` not a futex): blocked in a ``recv`` or a
    ``poll``, say, rather than running or waiting for the GIL. Where the kernel does not name
    the wait (``wchan`` reads ``0``), a sleeping thread counts."""
    task = Path(f"/proc/{pid}/task/{pid}")
    try:
        state = _state(task)
        wchan = (task / "wchan").read_text().strip()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state == "S" and "futex" not in wchan


def _state(task: Path) -> str:
    """The state letter of a thread (``/proc/<pid>/task/<tid>``) in its ``stat``: ``R``,
    ``S``, ``T``, ... (its name, in parentheses, may hold any character)."""
    stat = (task / "stat").read_text()
    return stat[stat.rindex(")") + 2 :].split(" ", 1)[0]


class Script:
    """``python -c SOURCE ARGS`` driven line by line: the script prints a line when it is at
    a step, and reads a line from stdin to go on (``step``)."""

    def __init__(self, child: subprocess.Popen[str]) -> None:
        self.child = child
        self.pid = child.pid

    def line(self) -> str:
        """The script's next line, stripped; fails with its stderr if it ended instead."""
        stdout = self.child.stdout
        assert stdout is not None
        said = stdout.readline()
        if not said:
            self.child.kill()
            raise AssertionError(f"the script ended: {self.child.communicate()[1]}")
        return said.strip()

    def go(self) -> None:
        """Let the script go on from the step it waits at."""
        stdin = self.child.stdin
        assert stdin is not None
        stdin.write("go\n")
        stdin.flush()

    def step(self) -> str:
        """``go``, then the line the script says next."""
        self.go()
        return self.line()


@contextlib.contextmanager
def python_script(source: str, *args: str) -> Iterator[Script]:
    """Run ``source`` in this interpreter with ``args``, its stdin, stdout and stderr piped;
    killed on exit."""
    command = [sys.executable, "-c", source, *args]
    with subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as child:
        try:
            yield Script(child)
        finally:
            child.kill()


STOP_TIMEOUT_S = 10.0
"""How long ``stop_process`` waits for every thread of the process to be stopped."""


def stop_process(pid: int) -> None:
    """SIGSTOP process ``pid`` and return once every one of its threads is stopped.

    The kernel stops a process's threads only when one of them takes the signal: on a loaded
    machine the thread picked may wait for a CPU while the others run on, and answer a call
    sent after ``kill`` returned (CI saw a paused etcd node answer so)."""
    os.kill(pid, signal.SIGSTOP)
    wait_until(
        lambda: _all_threads_stopped(pid),
        timeout=STOP_TIMEOUT_S,
        what=f"process {pid} stopped after SIGSTOP",
        poll=0.001,
        poll_max=0.01,
    )


@contextlib.contextmanager
def paused(pid: int) -> Iterator[None]:
    """Process ``pid`` stopped (`stop_process`) for the block, and SIGCONT after it, however
    the block ends."""
    stop_process(pid)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of ``pid`` is stopped (``T``), traced (``t``) or ended (``Z``,
    ``X``)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            state = _state(task)
        except (FileNotFoundError, ProcessLookupError):
            continue  # the thread ended
        if state not in ("T", "t", "Z", "X"):
            return False
    return True
