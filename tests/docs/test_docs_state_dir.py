"""The state dir as docs/server.md and docs/getting-started.md describe it, run with the command
docs/server.md shows (on a free port, its directory in a scratch folder): where it is by
default, what it holds, that a second server on it refuses to start, and what ``stats`` says of
the journal and the restart grace; and the journal's metrics it lists."""

from __future__ import annotations

import json
import re
import stat
import urllib.request
from pathlib import Path
from typing import Any, cast

from prometheus_client.parser import text_string_to_metric_families

from dflockd_server import Config
from dflockd_server.testing import ServerThread
from tests.docs.docs_blocks import DOCS
from tests.support.ports import free_port, free_ports
from tests.support.servers import DflockdProcess, run_dflockd
from tests.support.wire import Wire


def _stats(port: int) -> dict[str, Any]:
    with Wire(("127.0.0.1", port)) as wire:
        reply = wire.req("stats")
    assert reply.startswith("ok "), reply[:200]
    return cast(dict[str, Any], json.loads(reply[3:]))


def test_the_documented_command_keeps_its_state_where_the_docs_say(tmp_path: Path) -> None:
    state = tmp_path / "var-lib-dflockd"
    port = free_port()
    command = ["--host", "127.0.0.1", "--state-dir", str(state), "--journal-fsync", "always"]
    server = DflockdProcess([*command, "--port", str(port)], {})
    try:
        server.wait_listening()
        assert any("restart grace: none (first start" in line for line in server.lines)
        with Wire(("127.0.0.1", port)) as wire:
            assert wire.req("l", "docs:state", "0 30").startswith("ok "), "not granted at once"
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        assert {"journal", "fence", "grace", "lock"} <= {p.name for p in state.iterdir()}
        stats = _stats(port)
        assert stats["journal"]["state_dir"] == str(state)
        assert stats["journal"]["fsync"] == "always"
        assert (stats["grace_remaining_s"], stats["grace_reason"]) == (0.0, "")

        # A second server on the same state dir (another port) refuses, naming the first.
        second = run_dflockd(
            ["--host", "127.0.0.1", "--port", str(free_port()), "--state-dir", str(state)], {}
        )
        assert second.returncode != 0, second.stderr
        assert str(server.proc.pid) in second.stderr, second.stderr
    finally:
        server.kill()


def test_by_default_each_host_and_port_has_a_state_dir_of_its_own(tmp_path: Path) -> None:
    xdg = tmp_path / "xdg-state"
    ports = free_ports(2)
    servers = [
        DflockdProcess(["--host", "127.0.0.1", "--port", str(port)], {"XDG_STATE_HOME": str(xdg)})
        for port in ports
    ]
    try:
        for server in servers:
            server.wait_listening()
        for port in ports:
            state = xdg / "dflockd" / f"127.0.0.1-{port}"
            assert _stats(port)["journal"]["state_dir"] == str(state)
            assert (state / "lock").exists()
    finally:
        for server in servers:
            server.kill()


def test_port_0_keeps_no_state_and_state_dir_none_turns_the_journal_off(tmp_path: Path) -> None:
    ephemeral = DflockdProcess(["--host", "127.0.0.1", "--port", "0"], {})
    try:
        _, port = ephemeral.wait_listening()
        stats = _stats(port)
        assert stats["journal"] is None and stats["grace_reason"] == ""
    finally:
        ephemeral.kill()
    port = free_port()
    off = DflockdProcess(["--host", "127.0.0.1", "--port", str(port), "--state-dir", "none"], {})
    try:
        off.wait_listening()
        stats = _stats(port)
        assert stats["journal"] is None
        # On a fixed port with no journal, the start waits the longest lease out.
        assert stats["grace_remaining_s"] > 0 and stats["grace_reason"], stats
    finally:
        off.kill()


def test_the_journal_series_docs_server_md_lists_are_the_servers(tmp_path: Path) -> None:
    listed = set(re.findall(r"`(dflockd_journal_[a-z_]+)`", (DOCS / "server.md").read_text()))
    assert listed, "docs/server.md lists no dflockd_journal_* series"
    server = ServerThread(
        Config(host="127.0.0.1", port=0, metrics_port=0, state_dir=str(tmp_path / "state"))
    ).start()
    try:
        assert server.metrics_url is not None
        with urllib.request.urlopen(server.metrics_url, timeout=10) as reply:
            text = reply.read().decode()
    finally:
        server.stop()
    exposed = {
        sample.name
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name.startswith("dflockd_journal_")
    }
    assert listed == exposed
