"""Lock servers for the tests: the real ``dflockd`` console script in a subprocess (its log
followed line by line, or written to a file), and an in-process server a test may stop and
start again on the same port. The per-test fixtures (``dflock_server_factory``,
``dflock_server``, ``lock_server``) are in tests/conftest.py and build on
:class:`dflockd_server.testing.ServerThread`."""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from dflockd_server import Config
from dflockd_server.testing import ServerThread
from tests.support.ports import free_port
from tests.support.waiting import wait_until

STARTUP_TIMEOUT_S = 60.0
"""How long a ``dflockd`` process may take to log a line a test waits for (its listening
address, say). Idle, it starts in under a second; CI's other CPythons run at ``nice 10``
beside the main suite, whose processes keep both cores busy, and there two starts in a row
logged nothing within the 15 s this used to be (``dflockd --help`` took 14 s in the same
minute). A server that never logs the line still fails the test, a little later."""
LOCK_SERVER_LEASE_S = 30
"""Default lease of the ``lock_server`` fixture: no run of a test outlives its lock unless the
test means it to."""
_LISTENING = re.compile(r"listening on (\S+):(\d+) ")


def dflockd_executable() -> str:
    """The ``dflockd`` script installed next to this interpreter."""
    path = Path(sys.executable).parent / "dflockd"
    assert path.exists(), f"dflockd console script missing at {path}; run uv sync"
    return str(path)


def clean_env(extra: dict[str, str]) -> dict[str, str]:
    """The current environment without any DFLOCKD_* variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLOCKD_")}
    env.update(extra)
    return env


def run_dflockd(
    args: list[str], env: dict[str, str], timeout: float = 30.0
) -> subprocess.CompletedProcess[str]:
    """Run ``dflockd`` to completion (for start-up errors and --help)."""
    return subprocess.run(
        [dflockd_executable(), *args],
        env=clean_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


REBALANCE_TRIES = 5
"""How many times :func:`rebalance` runs ``dflockd rebalance`` while it says to run it again."""


def rebalance(cluster_url: str, timeout: float) -> str:
    """``dflockd rebalance --cluster cluster_url``, run again while it asks to, as its operator
    would: the leader evens the members out by itself once membership is still, and when that
    changes the shards the command meant to move, the command leaves them and says "run
    rebalance again" (CI saw "2222 shard(s) changed meanwhile and were left"). Returns what it
    printed; fails the test on any other failure, or after :data:`REBALANCE_TRIES` runs."""
    said = ""
    for _ in range(REBALANCE_TRIES):
        done = run_dflockd(["rebalance", "--cluster", cluster_url], {}, timeout)
        if done.returncode == 0:
            return done.stdout
        said = done.stdout + done.stderr
        assert "run rebalance again" in done.stderr, f"dflockd rebalance failed: {said}"
    raise AssertionError(f"dflockd rebalance: still asked to run again: {said}")


class DflockdProcess:
    """A ``dflockd`` subprocess whose stderr lines are collected by a reader thread.

    ``env`` is added to this process's environment without its DFLOCKD_* variables; with
    ``inherit_env=False`` it is the whole environment (a user's shell, say). ``cwd``: the
    directory it starts in (default: this process's)."""

    def __init__(
        self,
        args: list[str],
        env: dict[str, str],
        *,
        inherit_env: bool = True,
        cwd: Path | None = None,
    ) -> None:
        self.proc = subprocess.Popen(
            [dflockd_executable(), *args],
            env=clean_env(env) if inherit_env else env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, needle: str, timeout: float = STARTUP_TIMEOUT_S) -> str:
        """The first (new) log line containing ``needle``; fails on exit or timeout."""
        while True:
            try:
                line = self._queue.get(timeout=timeout)
            except queue.Empty:
                raise AssertionError(f"no log line with {needle!r}; got {self.lines}") from None
            if line is None:
                raise AssertionError(f"dflockd exited before logging {needle!r}: {self.lines}")
            self.lines.append(line)
            if needle in line:
                return line

    def drain(self) -> list[str]:
        """Every line logged so far (read into ``lines`` without waiting)."""
        while True:
            try:
                line = self._queue.get_nowait()
            except queue.Empty:
                return self.lines
            if line is None:
                self._queue.put(None)  # keep the end marker for wait_for
                return self.lines
            self.lines.append(line)

    def wait_listening(self) -> tuple[str, int]:
        line = self.wait_for("listening on")
        match = _LISTENING.search(line)
        assert match, line
        return match.group(1), int(match.group(2))

    def wait_exit(self, timeout: float = 30.0) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(5)
        while True:
            try:
                line = self._queue.get_nowait()
            except queue.Empty:
                break
            if line is not None:
                self.lines.append(line)
        return code

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._reader.join(10)  # EOF once the process is gone
        if self.proc.stderr is not None:
            self.proc.stderr.close()


@contextmanager
def dflockd_subprocess(
    log_path: Path, *args: str, port: int | None = None
) -> Iterator[tuple[subprocess.Popen[bytes], tuple[str, int]]]:
    """A real ``dflockd`` subprocess on a free local port, or on ``port`` (to start again
    where a killed one ran; it can be SIGSTOPped or killed), with extra command-line ``args``,
    its log in ``log_path``; its process and address. Killed on exit."""
    port = free_port() if port is None else port
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [dflockd_executable(), "--host", "127.0.0.1", "--port", str(port), *args],
            env=clean_env({}),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )  # fmt: skip
        address = ("127.0.0.1", port)

        def listening() -> bool:
            try:
                socket.create_connection(address, timeout=0.5).close()
            except OSError:
                return False
            return True

        try:
            wait_until(listening, timeout=15.0, what="dflockd listening")
            yield proc, address
        finally:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
            proc.wait(10)


class LockServer:
    """An in-process server (a ServerThread) that a test may stop and start again on the
    same port."""

    def __init__(self) -> None:
        self.thread: ServerThread | None = ServerThread(Config(host="127.0.0.1", port=0))
        self.thread.start()
        self.address: tuple[str, int] = self.thread.address

    def stop(self) -> None:
        if self.thread is not None:
            self.thread.stop()
            self.thread = None

    def restart(self) -> None:
        self.stop()
        self.thread = ServerThread(Config(host="127.0.0.1", port=self.address[1]))
        self.thread.start()
