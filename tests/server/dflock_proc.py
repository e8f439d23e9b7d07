"""Run the real ``dflockd`` console script in a subprocess and follow its log."""

from __future__ import annotations

import os
import queue
import re
import subprocess
import sys
import threading
from pathlib import Path

STARTUP_TIMEOUT_S = 15.0
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


class DflockdProcess:
    """A ``dflockd`` subprocess whose stderr lines are collected by a reader thread."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [dflockd_executable(), *args],
            env=clean_env(env),
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
