"""What the interop tests share (the fixtures are in conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def dflock_cli(servers: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``celery -A examples.proj dflock ARGS`` with ``DFLOCK_SERVERS=servers``."""
    env = {**os.environ, "DFLOCK_SERVERS": servers, "PYTHONPATH": str(ROOT),
           "CELERY_BROKER_URL": "memory://"}  # fmt: skip
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "examples.proj", "dflock", *args],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip


@dataclass
class ForeignServer:
    """A real dflockd 0.5.0 server in a subprocess (no ping, stats, hello or fences)."""

    host: str
    port: int
    log: Path

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    def connections_accepted(self) -> int:
        """Connections the server has accepted so far (it logs each one)."""
        return self.log.read_text().count("client connected")
