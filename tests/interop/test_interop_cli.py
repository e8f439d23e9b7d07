"""``celery -A proj dflock status|ping|locks`` against the real dflockd 0.5.0 server (issue 13,
point 13): it answers ``hello`` and ``stats`` with ``error``, so it is reachable, without stats."""

from __future__ import annotations

import json

from tests.interop.interop_helpers import ForeignServer, dflock_cli


def test_dflock_status_ping_and_locks_report_the_foreign_server_reachable(
    dflockd_050: ForeignServer,
) -> None:
    address = f"{dflockd_050.host}:{dflockd_050.port}"
    status = dflock_cli(address, "status")
    assert status.returncode == 0, status.stdout + status.stderr
    (row,) = [line for line in status.stdout.splitlines() if line.startswith(address)]
    assert row.split()[1] == "yes", status.stdout
    assert "no stats" in row and "older dflockd" in row, status.stdout  # what it lacks
    ping = dflock_cli(address, "ping")
    assert ping.returncode == 0, ping.stdout + ping.stderr
    assert f"{address}: ok" in ping.stdout
    locks = dflock_cli(address, "locks")
    assert locks.returncode == 0, locks.stdout + locks.stderr
    assert f"{address}: reachable, older dflockd (no hello): no stats" in locks.stdout
    assert "no locks held\n" not in locks.stdout  # its locks are unknown, not absent
    report = json.loads(dflock_cli(address, "status", "--json").stdout)
    assert report[0]["reachable"] is True and report[0]["stats"] is None
    assert set(report[0]["unsupported"]) == {"hello", "stats", "ping", "fence"}


def test_dflock_release_on_the_foreign_server_says_it_predates_force_release(
    dflockd_050: ForeignServer,
) -> None:
    """dflockd 0.5.0 answers ``hello`` with ``error``: it is never sent ``fr``; the command
    says why the key was not released and exits 1."""
    address = f"{dflockd_050.host}:{dflockd_050.port}"
    released = dflock_cli(address, "release", "job:1")
    assert released.returncode == 1, released.stdout + released.stderr
    assert "job:1: NOT released: server " in released.stdout
    assert "does not list 'force_release' in its hello: it predates force release" in (
        released.stdout
    )
