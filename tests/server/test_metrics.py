"""The Prometheus endpoint: every named series, scraped over HTTP and parsed with
prometheus_client's own parser, against counts the test caused on a real server."""

from __future__ import annotations

import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dflockd_server import Config, constants as c
from dflockd_server.metrics import COMMAND_NAMES
from dflockd_server.testing import ServerThread
from tests.support.disks import fill, small_tmpfs
from tests.support.ports import free_port
from tests.support.servers import DflockdProcess
from tests.support.wire import SERVER_COMMANDS, Wire

ServerFactory = Callable[..., ServerThread]
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> Samples:
    """Every sample of the exposition as ``{(name, sorted labels): value}``."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples[(name, tuple(sorted(labels.items())))]


def wait_for_value(url: str, name: str, expected: float, **labels: str) -> Samples:
    deadline = time.monotonic() + 10
    while True:
        samples = scrape(url)
        if value(samples, name, **labels) == expected or time.monotonic() > deadline:
            return samples
        time.sleep(0.05)


@pytest.fixture
def metrics_server(dflock_server_factory: ServerFactory) -> ServerThread:
    return dflock_server_factory(
        metrics_port=0, metrics_host="127.0.0.1", lease_sweep_interval_s=0.05
    )


def test_no_endpoint_unless_asked(dflock_server: ServerThread) -> None:
    assert dflock_server.metrics_url is None
    assert dflock_server.server.request_times is None  # nothing timed on the hot path


def test_every_named_series_counts_what_happened(metrics_server: ServerThread) -> None:
    url = metrics_server.metrics_url
    assert url is not None
    address = metrics_server.address
    with Wire(address) as a, Wire(address) as b, Wire(address) as c_:
        # 3 lock grants + 3 releases on one connection.
        for _ in range(3):
            token = a.lock("k1")
            assert a.req("r", "k1", token) == "ok"
        # A try-once refusal: b holds k2, a tries it with timeout 0.
        held = b.lock("k2")
        assert a.req("l", "k2", "0") == "timeout"
        # A waiter: c waits on k2 (blocking request in flight).
        c_.send("l", "k2", "10")
        samples = wait_for_value(url, "dflockd_waiters", 1, kind="lock")
        assert value(samples, "dflockd_held", kind="lock") == 1
        assert value(samples, "dflockd_keys", kind="lock") == 2
        # c's wait must last long enough to land in a known bucket: this sleep is the
        # duration being measured, not a wait for an event.
        time.sleep(0.2)
        # b releases: c is granted after waiting (its request time includes the wait).
        assert b.req("r", "k2", held) == "ok"
        reply = c_.recv()
        assert reply.startswith("ok ")
        # A semaphore slot, then an expiry: lease 1 s, nobody renews.
        sem = a.req("sl", "s1", "0 3 1")
        assert sem.startswith("ok ")
        a.req("l", "k3", "0 1")
        # Garbage: counted under the one "invalid" label, never its own.
        assert a.req("bogus", "x", "y") == "error"
        samples = wait_for_value(url, "dflockd_expiries_total", 1, kind="lock")
        assert value(samples, "dflockd_expiries_total", kind="semaphore") == 1
    # All three connections closed: c held k2, so one lock is lost by disconnect.
    samples = wait_for_value(url, "dflockd_connections", 0)
    assert value(samples, "dflockd_lost_by_disconnect_total", kind="lock") == 1

    assert value(samples, "dflockd_grants_total", kind="lock") == 3 + 1 + 1 + 1
    assert value(samples, "dflockd_grants_total", kind="semaphore") == 1
    assert value(samples, "dflockd_releases_total", kind="lock") == 3 + 1
    assert value(samples, "dflockd_releases_total", kind="semaphore") == 0
    assert value(samples, "dflockd_acquire_timeouts_total", kind="lock") == 1
    assert value(samples, "dflockd_held", kind="lock") == 0
    assert value(samples, "dflockd_waiters", kind="lock") == 0
    assert value(samples, "dflockd_connections_accepted_total") == 3
    assert value(samples, "dflockd_connections_refused_total") == 0

    hist = "dflockd_request_duration_seconds"
    # l: 3 + k2 + the refusal + c's wait + k3 = 7; r: 4; sl: 1; invalid: 1.
    # Each command by its readable name, its wire opcode beside it (issue 50).
    acquire = {"command": "acquire", "opcode": "l"}
    assert value(samples, f"{hist}_count", **acquire) == 7
    assert value(samples, f"{hist}_count", command="release", opcode="r") == 4
    assert value(samples, f"{hist}_count", command="semaphore_acquire", opcode="sl") == 1
    assert value(samples, f"{hist}_count", command="invalid", opcode="invalid") == 1
    assert not any("bogus" in dict(labels).values() for _, labels in samples)
    # Buckets are cumulative and end at the count; c's wait (> 200 ms) lands above 100 ms.
    bounds = [f"{b:g}" for b in c.METRICS_LATENCY_BUCKETS_S]
    buckets = [value(samples, f"{hist}_bucket", **acquire, le=le) for le in bounds]
    assert buckets == sorted(buckets)
    assert value(samples, f"{hist}_bucket", **acquire, le="+Inf") == 7
    assert value(samples, f"{hist}_bucket", **acquire, le="0.1") <= 6
    assert value(samples, f"{hist}_sum", **acquire) > 0


def test_a_force_release_is_counted_apart_from_the_holders_releases(
    metrics_server: ServerThread,
) -> None:
    url = metrics_server.metrics_url
    assert url is not None
    with Wire(metrics_server.address) as holder, Wire(metrics_server.address) as operator:
        holder.lock("forced:a")
        assert holder.req("sl", "forced:s", "0 2").startswith("ok ")
        assert holder.req("sl", "forced:s", "0 2").startswith("ok ")
        assert operator.req("fr", "forced:a", "ops1@vm") == "ok 1"
        assert operator.req("fr", "forced:s", "_") == "ok 2"
        assert operator.req("fr", "forced:nothing", "_") == "ok 0"
        samples = scrape(url)
    assert value(samples, "dflockd_force_releases_total", kind="lock") == 1
    assert value(samples, "dflockd_force_releases_total", kind="semaphore") == 2
    assert value(samples, "dflockd_releases_total", kind="lock") == 0


def test_every_command_has_a_readable_name() -> None:
    assert set(COMMAND_NAMES) == {*SERVER_COMMANDS, "invalid"}
    names = list(COMMAND_NAMES.values())
    assert len(set(names)) == len(names)
    assert all(re.fullmatch(r"[a-z_]+", name) for name in names)


def test_keys_in_use_and_the_cap_are_exposed(dflock_server_factory: ServerFactory) -> None:
    """Queue-once at scale fills ``--max-locks`` (issue 50): the keys held or waited on (holds
    included) and the cap are series, so an alert can fire before a send is refused."""
    server = dflock_server_factory(metrics_port=0, metrics_host="127.0.0.1", max_locks=5)
    url = server.metrics_url
    assert url is not None
    with Wire(server.address) as a, Wire(server.address) as b:
        token = a.lock("k1")
        assert a.req("hl", "q1", "0 60 d celery:task-1").startswith("ok ")
        assert a.req("sl", "s1", "0 3").startswith("ok ")
        b.send("l", "k1", "10")  # a waiter on a held key: still one key
        samples = wait_for_value(url, "dflockd_waiters", 1, kind="lock")
        assert value(samples, "dflockd_keys_busy") == 3
        assert value(samples, "dflockd_keys_max") == 5
        assert a.req("r", "k1", token) == "ok"
        assert b.recv().startswith("ok ")
    # Both connections closed: their grants went with them (k1, s1 idle, no longer counted);
    # the detached hold (a queue-once hold) stays until its release or its lease.
    samples = wait_for_value(url, "dflockd_keys_busy", 1)
    assert value(samples, "dflockd_keys_busy") == 1
    assert value(samples, "dflockd_keys", kind="lock") == 2


def test_refused_connections_are_counted(dflock_server_factory: ServerFactory) -> None:
    server = dflock_server_factory(metrics_port=0, metrics_host="127.0.0.1", max_connections=1)
    url = server.metrics_url
    assert url is not None
    with Wire(server.address) as first:
        assert first.req("ping") == "ok"
        with Wire(server.address) as second:
            assert second.closed_by_server()
        samples = wait_for_value(url, "dflockd_connections_refused_total", 1)
        assert value(samples, "dflockd_connections_accepted_total") == 1
        assert value(samples, "dflockd_connections") == 1


def test_stop_with_metrics_on_frees_the_metrics_port() -> None:
    # A port below the ephemeral range (not port 0's): one the kernel handed out could be given
    # to another process's connection between the two servers, and CI once saw that.
    port = free_port()
    first = ServerThread(
        Config(host="127.0.0.1", port=0, metrics_port=port, metrics_host="127.0.0.1")
    )
    with first:
        url = first.metrics_url
        assert url is not None
    again = ServerThread(
        Config(host="127.0.0.1", port=0, metrics_port=port, metrics_host="127.0.0.1")
    )
    with again:
        assert again.metrics_url == url
        assert value(scrape(url), "dflockd_connections") == 0


def test_dflockd_serves_metrics_from_the_environment(
    dflockd_process: Callable[..., DflockdProcess],
) -> None:
    proc = dflockd_process(
        "--host", "127.0.0.1", "--port", "0",
        env={"DFLOCKD_METRICS_PORT": "0", "DFLOCKD_METRICS_HOST": "127.0.0.1"},
    )  # fmt: skip
    host, port = proc.wait_listening()
    line = proc.wait_for("metrics on")
    match = re.search(r"(http://\S+/metrics)", line)
    assert match, line
    with Wire((host, port)) as w:
        w.lock("k")
        samples = scrape(match.group(1))
        assert value(samples, "dflockd_held", kind="lock") == 1
        assert value(samples, "dflockd_connections") == 1


def test_dflockd_names_a_taken_metrics_port(
    dflockd_process: Callable[..., DflockdProcess], metrics_server: ServerThread
) -> None:
    url = metrics_server.metrics_url
    assert url is not None
    taken = url.rsplit(":", 1)[1].split("/")[0]
    proc = dflockd_process("--host", "127.0.0.1", "--port", "0", "--metrics-port", taken)
    assert proc.wait_exit() == 1
    assert any(
        f"cannot serve metrics on 127.0.0.1:{taken}" in line and "--metrics-port" in line
        for line in proc.lines
    ), proc.lines


def test_dflockd_without_the_extra_says_what_to_install() -> None:
    code = (
        "import sys; sys.modules['prometheus_client'] = None\n"
        "from dflockd_server.cli import main\n"
        "main(['--host', '127.0.0.1', '--port', '0', '--metrics-port', '0'])\n"
    )
    done: subprocess.CompletedProcess[Any] = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 2
    assert "--metrics-port / DFLOCKD_METRICS_PORT needs prometheus_client" in done.stderr
    assert "pip install 'dflockd-server[metrics]'" in done.stderr


def test_the_restart_grace_is_a_gauge(dflock_server_factory: ServerFactory) -> None:
    url = dflock_server_factory(metrics_port=0, metrics_host="127.0.0.1").metrics_url
    assert url is not None
    assert value(scrape(url), "dflockd_restart_grace_remaining_seconds") == 0
    graced = dflock_server_factory(
        metrics_port=0, metrics_host="127.0.0.1", restart_grace_s=600.0
    ).metrics_url
    assert graced is not None
    assert 0 < value(scrape(graced), "dflockd_restart_grace_remaining_seconds") <= 600


def test_no_cluster_series_outside_cluster_mode(
    metrics_server: ServerThread, dflock_server_factory: ServerFactory
) -> None:
    static = dflock_server_factory(
        metrics_port=0,
        metrics_host="127.0.0.1",
        members=("127.0.0.1:1", "127.0.0.1:2"),
        advertise="127.0.0.1:1",
    )
    for server in (metrics_server, static):
        url = server.metrics_url
        assert url is not None
        names = {name for name, _ in scrape(url)}
        assert "dflockd_connections" in names
        assert not any(name.startswith("dflockd_cluster_") for name in names)


def test_the_journal_counts_restored_leases_writes_and_fsyncs(
    dflock_server_factory: ServerFactory, tmp_path: Path
) -> None:
    first = dflock_server_factory(state_dir=str(tmp_path), journal_fsync="always")
    with Wire(first.address) as a:
        a.lock("k", lease=60)
        first.stop()
    url = dflock_server_factory(
        port=first.port,
        state_dir=str(tmp_path),
        journal_fsync="always",
        metrics_port=0,
        metrics_host="127.0.0.1",
    ).metrics_url
    assert url is not None
    assert value(scrape(url), "dflockd_journal_restored_leases_total") == 1
    assert value(scrape(url), "dflockd_journal_dropped_records_total") == 0
    with Wire(first.address) as b:
        b.lock("other", lease=60)
    samples = scrape(url)
    assert value(samples, "dflockd_journal_writes_total") >= 1
    assert value(samples, "dflockd_journal_fsyncs_total") >= 1  # always: one per write
    plain = dflock_server_factory(metrics_port=0, metrics_host="127.0.0.1").metrics_url
    assert plain is not None
    assert not [name for name, _ in scrape(plain) if name.startswith("dflockd_journal_")]


def test_journal_writable_follows_the_journal_through_a_full_disk(tmp_path: Path) -> None:
    """``dflockd_journal_writable`` is the journal's own flag: 0 from the first write the full
    state dir refuses, 1 again once a sweep wrote the journal anew."""
    with small_tmpfs(tmp_path / "disk", "1m") as disk:
        config = Config(
            host="127.0.0.1",
            port=0,
            state_dir=str(disk / "state"),
            metrics_port=0,
            metrics_host="127.0.0.1",
            lease_sweep_interval_s=0.05,
        )
        with ServerThread(config) as server, Wire(server.address) as wire:
            url = server.metrics_url
            assert url is not None
            assert value(scrape(url), "dflockd_journal_writable") == 1
            token = wire.lock("first")  # its lease's bound recorded while there is room
            assert wire.req("r", "first", token) == "ok"
            filler = fill(disk)
            # Writes go on into the journal's last page, then fail.
            reply = ""
            for i in range(10_000):
                reply = wire.req("l", f"k{i}", "0")
                if reply == "error_read_only":
                    break
                assert wire.req("r", f"k{i}", reply.split()[1]) == "ok"
            assert reply == "error_read_only"
            assert value(scrape(url), "dflockd_journal_writable") == 0
            assert value(scrape(url), "dflockd_journal_write_failures_total") == 1
            filler.unlink()
            samples = wait_for_value(url, "dflockd_journal_writable", 1)
            assert value(samples, "dflockd_journal_writable") == 1
