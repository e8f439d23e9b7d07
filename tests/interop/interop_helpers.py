"""What the interop tests share (the fixtures are in conftest.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


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
