"""The real dflockd peers against our server (issue 13, point 15): dflockd 0.5.0's sync and
async clients and dflockd-client 2.1.1's, each run by the peers' own interpreter."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from dflockd_server.testing import ServerThread

CHECKS = Path(__file__).with_name("peer_checks.py")


@pytest.mark.parametrize(
    "check", ["dflockd-sync", "dflockd-async", "dflockd-client-sync", "dflockd-client-async"]
)
def test_a_dflockd_peer_client_works_against_our_server(
    peer_python: Path, dflock_server: ServerThread, check: str
) -> None:
    host, port = dflock_server.address
    done = subprocess.run(
        [str(peer_python), str(CHECKS), host, str(port), check],
        capture_output=True, text=True, timeout=90, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split("\n")[-2] == f"ok {check}", done.stdout
