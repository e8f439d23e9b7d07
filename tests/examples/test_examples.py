"""The example project (examples/proj) on a real prefork worker, Redis broker, real lock server;
and ``celery -A examples.proj dflock status|locks|ping`` against it."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from celery_dflock import Client, DistributedLock
from celery_dflock.cli import (
    RESTORED_MARK,
    ServerReport,
    format_locks,
    format_ping,
    format_status,
)
from celery_dflock.client.clients import ServerInfo
from examples.proj.ledger import FencedLedger, NoFenceError, StaleFenceError
from tests.support.ports import free_port
from tests.support.processes import kill_group
from tests.support.servers import DflockdProcess
from tests.support.services import redis_url
from tests.support.wire import Wire

ROOT = Path(__file__).resolve().parents[2]
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
    url = redis_url("examples")  # its own: emptied before and after each example
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


def _cli_env(address: str) -> dict[str, str]:
    return {**os.environ, "DFLOCK_SERVERS": address, "PYTHONPATH": str(ROOT),
            "CELERY_BROKER_URL": "memory://"}  # fmt: skip


def _reachable(address: str, stats: dict[str, Any]) -> ServerReport:
    return ServerReport(address, stats, server=ServerInfo("dflockd", "0", frozenset({"stats"})))


def test_dflock_status_and_locks_leave_out_what_an_older_server_does_not_send() -> None:
    older = {"connections": 1, "locks": [{"key": "k", "lease_expires_in_s": 3.0, "waiters": 0}],
             "semaphores": [], "grace_remaining_s": 0.0}  # fmt: skip
    report = _reachable("127.0.0.1:6388", older)
    status = format_status([report])
    assert "journal" not in status and "grace" not in status
    assert len(status.splitlines()) == 3  # header, rule, one row
    locks = format_locks([report])
    assert RESTORED_MARK not in locks and "note" not in locks.splitlines()[0]
    # A grace from an older server (no grace_reason) shows without a reason.
    graced = format_status([_reachable("127.0.0.1:6388", {**older, "grace_remaining_s": 12.25})])
    said = graced.splitlines()[-1]
    assert said.startswith("127.0.0.1:6388: restart grace until "), said
    assert said.endswith(" UTC (12.2 s left), no key granted"), said


def test_dflock_status_and_locks_show_a_number_a_server_sent_malformed_as_unknown() -> None:
    """A server that is not this package's (another dflockd build, a proxy in between) may
    send a count or a lease as text: ``status`` and ``locks`` stopped with a Python
    traceback (``int('many')``). The value now counts as unknown, and the rest shows."""
    lock = {"key": "k", "lease_expires_in_s": "soon", "waiters": "many"}
    report = _reachable("127.0.0.1:6388", {"connections": 1, "locks": [lock], "semaphores": []})
    (row,) = format_status([report]).splitlines()[2:]
    assert row.split()[:7] == ["127.0.0.1:6388", "yes", "1", "-", "1", "0", "0"], row
    (held,) = [line for line in format_locks([report]).splitlines() if " k " in line]
    assert held.split()[1:4] == ["k", "lock", "-"], held


def test_dflock_status_and_locks_show_grace_journal_and_restored_from_the_stats_fields() -> None:
    """The fields of the durable leases' `stats` (DURABLE-CONTRACT): grace_reason, journal and
    each lock's restored; the tests below read them from a real server."""
    lock = {"key": "k", "lease_expires_in_s": 3.0, "waiters": 0, "owner": "", "restored": True}
    journal = {"state_dir": "/var/lib/dflockd", "fsync": "everysec", "restored": 2,
               "dropped_records": 1, "writes": 9, "fsyncs": 3}  # fmt: skip
    stats = {"connections": 0, "locks": [lock, {**lock, "key": "j", "restored": False}],
             "semaphores": [], "grace_remaining_s": 41.0, "grace_reason": "journal damaged",
             "journal": journal}  # fmt: skip
    a, b = "10.0.0.5:6388", "10.0.0.6:6388"
    off = {"connections": 0, "locks": [], "semaphores": [], "grace_remaining_s": 0.0,
           "grace_reason": "", "journal": None}  # fmt: skip
    status = format_status([_reachable(a, stats), _reachable(b, off)]).splitlines()
    assert status[-3].endswith(" UTC (41.0 s left), no key granted (journal damaged)")
    assert status[-2:] == [
        f"{a}: journal on: state dir /var/lib/dflockd, fsync everysec, 2 lease(s) restored, "
        "1 record(s) dropped",
        f"{b}: journal off",
    ]
    locks = format_locks([_reachable(a, stats)]).splitlines()
    assert locks[0].split()[-1] == "note"
    assert locks[2].endswith(RESTORED_MARK) and locks[2].split()[1] == "k"
    assert locks[3].split()[1] == "j" and not locks[3].endswith(RESTORED_MARK)


def test_dflock_status_and_ping_say_each_degraded_state_and_fail_when_nothing_is_granted() -> None:
    """Issue 73: a server that answers but cannot write its journal looked healthy ("journal
    on", "ok", exit 0). The states come from `stats`' ``degraded`` (the server's words)."""
    read_only = {"name": "journal_read_only", "severity": "error", "title": "Read-only",
                 "message": "the lease journal under /s cannot be written (No space left on "
                 "device). Free space under /s."}  # fmt: skip
    moving = {"name": "shards_moving", "severity": "warning", "title": "Shards moving",
              "message": "3 shard(s) moving out."}  # fmt: skip
    journal = {"state_dir": "/s", "fsync": "everysec", "restored": 0, "dropped_records": 0,
               "writable": False, "write_failure": "No space left on device"}  # fmt: skip
    base = {"connections": 1, "locks": [], "semaphores": [], "grace_remaining_s": 0.0}
    a, b = "10.0.0.5:6388", "10.0.0.6:6388"
    ours = ServerInfo("dflockd-server", "0.2.0", frozenset({"stats", "ping", "fence", "hello"}))
    full = ServerReport(a, {**base, "journal": journal, "degraded": [read_only]}, server=ours)
    busy = ServerReport(b, {**base, "journal": None, "degraded": [moving]}, server=ours)
    assert (full.healthy, busy.healthy) == (False, True)
    status = format_status([full, busy]).splitlines()
    assert status[2].split()[:2] == [a, "yes"] and "READ-ONLY" in status[2]
    assert "shards moving" in status[3]
    assert f"{a}: READ-ONLY: the lease journal under /s cannot be written" in status[5]
    assert status[-1] == f"{b}: Shards moving: 3 shard(s) moving out."
    ping = format_ping([full, busy]).splitlines()
    assert ping[0].startswith(f"{a}: answers, but grants nothing new: READ-ONLY: the lease")
    assert ping[1] == f"{b}: ok; Shards moving: 3 shard(s) moving out."
    # An older server of ours (no degraded list): the journal's own field says it.
    older = _reachable(a, {**base, "journal": journal})
    assert older.healthy and "READ-ONLY: the journal cannot be written" in format_status([older])


def _state_server(state: Path, port: int, *args: str) -> DflockdProcess:
    server = DflockdProcess(
        ["--host", "127.0.0.1", "--port", str(port), "--state-dir", str(state), *args], {}
    )
    server.wait_listening()
    return server


def test_dflock_status_and_locks_show_the_journal_and_the_restored_leases(
    tmp_path: Path,
) -> None:
    """A holder's lease survives a kill -9 of its server (the journal); until a connection
    renews it, `locks` marks it restored, and `status` shows the journal and what it restored."""
    state, port = tmp_path / "state", free_port()
    address = f"127.0.0.1:{port}"
    first = _state_server(state, port, "--journal-fsync", "always")
    try:
        with Wire(("127.0.0.1", port)) as holder:
            granted = holder.req("l", "cli:durable", "0 60").split()
            assert granted[0] == "ok", granted
            first.proc.kill()  # a crash: nothing released, nothing flushed by a stop
            first.wait_exit()
    finally:
        first.kill()
    second = _state_server(state, port, "--journal-fsync", "always")
    try:
        assert any("journal: restored 1 lease(s)" in line for line in second.lines), second.lines
        env = _cli_env(address)
        locks = _celery(env, "dflock", "locks")
        assert locks.returncode == 0, locks.stdout + locks.stderr
        (row,) = [line for line in locks.stdout.splitlines() if "cli:durable" in line]
        assert row.endswith(RESTORED_MARK), locks.stdout
        status = _celery(env, "dflock", "status")
        assert status.returncode == 0, status.stdout + status.stderr
        assert (
            f"{address}: journal on: state dir {state}, fsync always, 1 lease(s) restored, "
            "0 record(s) dropped"
        ) in status.stdout.splitlines(), status.stdout
        assert "restart grace" not in status.stdout  # the journal was whole: no grace
        (report,) = json.loads(_celery(env, "dflock", "status", "--json").stdout)
        assert report["stats"]["journal"]["restored"] == 1
        (lock,) = report["stats"]["locks"]
        assert lock["restored"] is True

        # Its holder comes back and renews by token: no longer marked.
        with Wire(("127.0.0.1", port)) as holder:
            assert holder.req("n", "cli:durable", f"{granted[1]} 60").startswith("ok")
            locks = _celery(env, "dflock", "locks")
        (row,) = [line for line in locks.stdout.splitlines() if "cli:durable" in line]
        assert RESTORED_MARK not in locks.stdout, locks.stdout
    finally:
        second.kill()


def test_dflock_status_shows_a_restart_grace_with_its_reason_and_journal_off(
    tmp_path: Path,
) -> None:
    """`status` (text and --json), `ping` and the status page say until when (a UTC time of
    day, about 60 s from now) the server grants nothing, and why; `ping` exits 0 all the same
    (a readiness probe: the server answers, and queues acquires)."""
    port, metrics = free_port(), free_port()
    address = f"127.0.0.1:{port}"
    server = _state_server(
        Path("none"), port, "--restart-grace", "60", "--metrics-port", str(metrics)
    )
    try:
        status = _celery(_cli_env(address), "dflock", "status")
        assert status.returncode == 0, status.stdout + status.stderr
        (report,) = json.loads(_celery(_cli_env(address), "dflock", "status", "--json").stdout)
        reason = report["stats"]["grace_reason"]
        assert reason
        lines = status.stdout.splitlines()
        (grace,) = [line for line in lines if line.startswith(f"{address}: restart grace ")]
        assert grace.endswith(f" s left), no key granted ({reason})"), grace
        ping = _celery(_cli_env(address), "dflock", "ping")
        assert ping.returncode == 0, ping.stdout + ping.stderr
        (degraded,) = report["stats"]["degraded"]
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/status", timeout=10) as page:
            shown = page.read().decode()
        for said in (grace, ping.stdout, degraded["message"], shown):
            (until,) = re.findall(r"until (\d\d):(\d\d):(\d\d) UTC", said)
            h, m, s = map(int, until)
            ahead = (h * 3600 + m * 60 + s - time.time()) % 86400
            assert 40 <= ahead <= 62, (said, ahead)
        assert f"{address}: journal off" in lines
        assert report["stats"]["journal"] is None
    finally:
        server.kill()


def test_status_metrics_and_page_count_the_client_sessions_and_the_grants_they_keep(
    tmp_path: Path,
) -> None:
    """One client process holds two locks on its session, a plain connection a third: the
    metrics, the status page and `celery dflock status` (text and --json) count the sessions
    and the grants they keep (the CLI's connection joins no session)."""
    port, metrics = free_port(), free_port()
    address = f"127.0.0.1:{port}"
    server = _state_server(
        tmp_path / "state", port, "--metrics-port", str(metrics), "--metrics-host", "127.0.0.1"
    )
    try:
        with Client(servers=[("127.0.0.1", port)]) as client, Wire(("127.0.0.1", port)) as plain:
            held = [client.lock(f"cli:session:{n}") for n in (1, 2)]
            assert all(lock.acquire() for lock in held)
            assert plain.req("l", "cli:plain", "0 60").startswith("ok ")
            base = f"http://127.0.0.1:{metrics}"
            with urllib.request.urlopen(f"{base}/metrics", timeout=10) as response:
                text = response.read().decode()
            samples = {
                s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            }
            assert (samples["dflockd_sessions"], samples["dflockd_session_grants"]) == (1, 2)
            with urllib.request.urlopen(f"{base}/status?refresh=0", timeout=10) as response:
                page = response.read().decode()
            assert "1 client session(s) keeping 2 grant(s)" in page, page
            env = _cli_env(address)
            (report,) = json.loads(_celery(env, "dflock", "status", "--json").stdout)
            assert (report["stats"]["sessions"], report["stats"]["session_grants"]) == (1, 2)
            status = _celery(env, "dflock", "status").stdout.splitlines()
            assert status[0].split()[:4] == ["server", "reachable", "connections", "sessions"]
            row = status[2].split()  # connections: the client's own (a lock's, pooled ones), ...
            assert [row[0], *row[3:5]] == [address, "1", "3"], status  # sessions, locks
            for lock in held:
                lock.release()
    finally:
        server.kill()
