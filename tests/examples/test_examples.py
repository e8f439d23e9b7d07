"""The example project (examples/proj) on a real prefork worker, Redis broker, real lock server;
and ``celery -A examples.proj dflock status|locks|ping`` against it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_dflock import DistributedLock
from examples.proj.ledger import FencedLedger, NoFenceError, StaleFenceError
from tests.support.ports import free_port
from tests.support.processes import kill_group
from tests.support.services import REDIS_URL_BASE

ROOT = Path(__file__).resolve().parents[2]
REDIS_DB = 13
EXPORT_S = 15.0
"""How long the export the commands look at holds its semaphore slot."""


def test_fenced_ledger_refuses_a_stale_fence(tmp_path: Path) -> None:
    ledger = FencedLedger(tmp_path / "ledger.sqlite3")
    assert ledger.add("acme", 5, fence=10) == 5
    assert ledger.add("acme", 5, fence=11) == 10
    with pytest.raises(StaleFenceError, match="fence 9 refused"):
        ledger.add("acme", 100, fence=9)
    assert ledger.balance("acme") == 10
    with pytest.raises(NoFenceError, match="issues no fencing tokens"):
        ledger.add("acme", 100, fence=None)  # lock.fence on a server without fences
    assert ledger.balance("acme") == 10


@pytest.fixture
def example_env(
    redis_required: None, dflock_server: Any, tmp_path: Path
) -> Iterator[dict[str, str]]:
    url = f"{REDIS_URL_BASE}/{REDIS_DB}"
    with redis.Redis.from_url(url) as client:
        client.flushdb()
    env = {
        **os.environ,
        "CELERY_BROKER_URL": url,
        "CELERY_RESULT_BACKEND": url,
        "DFLOCK_SERVERS": f"{dflock_server.host}:{dflock_server.port}",
        "EXAMPLE_LEDGER": str(tmp_path / "ledger.sqlite3"),
        "PYTHONPATH": str(ROOT),
    }
    yield env
    with redis.Redis.from_url(url) as client:
        client.flushdb()


def _celery(
    env: dict[str, str], *args: str, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "celery", "-A", "examples.proj", *args],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


@pytest.fixture
def worker(example_env: dict[str, str], tmp_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    log = (tmp_path / "worker.log").open("wb")
    name = f"example-{uuid.uuid4().hex[:6]}@%h"
    proc = subprocess.Popen(
        [sys.executable, "-m", "celery", "-A", "examples.proj", "worker", "-P", "prefork",
         "-c", "4", "-n", name, "--loglevel", "INFO", "--without-gossip", "--without-mingle"],
        env=example_env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, process_group=0,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 40
        while b"ready." not in (tmp_path / "worker.log").read_bytes():
            assert proc.poll() is None, (tmp_path / "worker.log").read_text()
            assert time.monotonic() < deadline, "worker not ready in 40 s"
            time.sleep(0.2)
        yield proc
    finally:
        kill_group(proc, timeout=None)
        log.close()


@pytest.mark.redis
@pytest.mark.slow
def test_every_example_task_runs_and_dflock_shows_the_held_lock(
    example_env: dict[str, str], worker: subprocess.Popen[bytes], monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in example_env.items():
        monkeypatch.setenv(name, value)
    from celery_dflock import LockNotAcquired
    from examples.proj.app import app

    def send(name: str, **kwargs: Any) -> Any:
        return app.send_task(f"examples.proj.app.{name}", kwargs=kwargs)

    syncs = [send("sync_account", account_id=7) for _ in range(3)]
    assert [r.get(timeout=60) for r in syncs] == ["account 7 synced"] * 3

    first, second = (
        send("charge_invoice", invoice_id="inv-1"),
        send("charge_invoice", invoice_id="inv-1"),
    )
    outcomes = []
    for res in (first, second):
        try:
            outcomes.append(res.get(timeout=30))
        except LockNotAcquired:
            outcomes.append("refused")
    assert "invoice inv-1 charged" in outcomes

    assert send("nightly_report").get(timeout=30) == "report built"
    balances = [send("add_to_balance", account="acme", amount=5).get(timeout=30) for _ in range(3)]
    assert balances == [5, 10, 15]

    # Long enough to outlast two `celery` commands started one after the other on a loaded
    # machine (with 4 s, the export had ended before `dflock status` looked).
    long_export = send("export_tenant", tenant="acme", seconds=EXPORT_S)
    deadline = time.monotonic() + 20
    listed = ""
    while time.monotonic() < deadline:
        shown = _celery(example_env, "dflock", "locks")
        assert shown.returncode == 0, shown.stderr
        if "export:acme" in shown.stdout:
            listed = shown.stdout
            break
        time.sleep(0.2)
    assert "semaphore/2" in listed, listed

    status = _celery(example_env, "dflock", "status", "--json")
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    assert report[0]["reachable"] is True
    assert any(s["key"] == "export:acme" for s in report[0]["stats"]["semaphores"])
    assert long_export.get(timeout=EXPORT_S + 30) == "acme exported"

    ping = _celery(example_env, "dflock", "ping")
    assert ping.returncode == 0 and ": ok" in ping.stdout


def test_dflock_status_reports_an_unreachable_server(tmp_path: Path) -> None:
    env = {**os.environ, "DFLOCK_SERVERS": "127.0.0.1:1", "PYTHONPATH": str(ROOT),
           "CELERY_BROKER_URL": "memory://"}  # fmt: skip
    shown = _celery(env, "dflock", "status")
    assert shown.returncode == 1
    assert "127.0.0.1:1" in shown.stdout and "NO" in shown.stdout
    assert "cannot reach the dflockd lock server" in shown.stdout


def test_every_dflock_command_names_every_unreachable_server(
    dflock_server_factory: Any, tmp_path: Path
) -> None:
    # issue 13, point 9: with one of three servers down, `locks` printed "no locks held".
    up = [dflock_server_factory(), dflock_server_factory()]
    down = f"127.0.0.1:{free_port()}"  # a port nothing listens on
    servers = ",".join([f"{s.host}:{s.port}" for s in up] + [down])
    env = {**os.environ, "DFLOCK_SERVERS": servers, "PYTHONPATH": str(ROOT),
           "CELERY_BROKER_URL": "memory://"}  # fmt: skip
    for command in ("locks", "status", "ping"):
        shown = _celery(env, "dflock", command)
        assert shown.returncode == 1, (command, shown.stdout, shown.stderr)
        lines = [line for line in shown.stdout.splitlines() if down in line]
        assert len(lines) == 1, (command, shown.stdout)
        assert "UNREACHABLE" in lines[0] or " NO " in lines[0], (command, shown.stdout)
        assert "cannot reach the dflockd lock server" in lines[0], (command, shown.stdout)
    shown = _celery(env, "dflock", "locks")
    assert "no locks held on the servers that answered stats" in shown.stdout
    with DistributedLock("cli:held", servers=[up[1].address]):
        shown = _celery(env, "dflock", "locks")
    assert shown.returncode == 1
    assert "cli:held" in shown.stdout and f"{down}: UNREACHABLE" in shown.stdout
    as_json = json.loads(_celery(env, "dflock", "locks", "--json").stdout)
    assert [r["reachable"] for r in as_json] == [True, True, False]
