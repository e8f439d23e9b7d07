"""A dflockd 0.5.0 client keeps its lock across a kill -9 and restart of our server (issue 26):
the restarted server restores the lease from its journal, and the old client's renewal by
token on a new connection is accepted, as is its release."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any, cast

import pytest

from tests.support.ports import free_port
from tests.support.servers import DflockdProcess
from tests.support.wire import Wire, fence, stats

SCRIPT = Path(__file__).with_name("peer_reattach.py")
LEASE_S = 20
STEP_TIMEOUT_S = 30.0


class Peer:
    """The peer script in the peers' interpreter, one line each way per step."""

    def __init__(self, python: Path, address: tuple[str, int], key: str, face: str) -> None:
        self.proc = subprocess.Popen(
            [str(python), str(SCRIPT), address[0], str(address[1]), key, face],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def said(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            assert self.proc.stderr is not None
            self.proc.wait(STEP_TIMEOUT_S)
            raise AssertionError(f"the 0.5.0 client failed: {self.proc.stderr.read()}")
        return line.strip()

    def go_on(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(STEP_TIMEOUT_S)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


def _lock_entry(address: tuple[str, int], key: str) -> dict[str, Any] | None:
    locks = cast(list[dict[str, Any]], stats(address)["locks"])
    return next((entry for entry in locks if entry["key"] == key), None)


@pytest.mark.parametrize("face", ["sync", "async"])
def test_a_dflockd_050_client_keeps_its_lock_across_a_kill_9_restart_of_our_server(
    peer_python: Path, tmp_path: Path, face: str
) -> None:
    port = free_port()
    address = ("127.0.0.1", port)
    args = ["--host", "127.0.0.1", "--port", str(port), "--state-dir", str(tmp_path / "state")]
    key = f"peer:durable-{face}"
    servers: list[DflockdProcess] = []
    peer: Peer | None = None
    try:
        servers.append(DflockdProcess(args, {}))
        servers[-1].wait_listening()
        peer = Peer(peer_python, address, key, face)
        said = peer.said()
        assert said.startswith("held "), said
        held_fence = int(said.split()[1], 16)

        servers[-1].kill()  # kill -9: the 0.5.0 client's connection dies with it
        servers.append(DflockdProcess(args, {}))
        servers[-1].wait_listening()
        assert any("journal: restored 1 lease" in line for line in servers[-1].lines), servers[
            -1
        ].lines
        entry = _lock_entry(address, key)
        assert entry is not None and entry.get("restored") is True, entry
        with Wire(address) as rival:
            assert rival.req("l", key, f"0 {LEASE_S}") == "timeout"

        peer.go_on()
        said = peer.said()
        assert said.startswith("renewed "), said
        assert 0 < int(said.split()[1]) <= LEASE_S, said
        entry = _lock_entry(address, key)
        assert entry is not None and entry.get("restored") is False, entry
        with Wire(address) as rival:
            assert rival.req("l", key, f"0 {LEASE_S}") == "timeout"

        peer.go_on()
        assert peer.said() == "released"
        assert peer.proc.wait(STEP_TIMEOUT_S) == 0
        assert _lock_entry(address, key) is None
        with Wire(address) as rival:
            token = rival.lock(key, 0, LEASE_S)
            assert fence(token) > held_fence
            assert rival.req("r", key, token) == "ok"
    finally:
        if peer is not None:
            peer.close()
        for server in servers:
            server.kill()
