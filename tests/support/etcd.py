"""A private etcd server (a real one: Debian's ``etcd-server``) on free 127.0.0.1 ports, its data
under a directory of the caller's; for the lock cluster's tests (tests/cluster, tests/faults).

Without an etcd binary (``ETCD_BIN`` or ``etcd`` on PATH) the tests that need one skip, except
when CELERY_DFLOCK_REQUIRE_REDIS=1 (CI), where they fail: CI installs etcd, so a missing one is
a broken setup, not a reason to stop testing. `EtcdServer.stop` then `start` restarts it in
place (same ports, same data).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflockd_server.cluster.etcd import EtcdClient
from tests.support.ports import free_port

REQUIRE_ENV = "CELERY_DFLOCK_REQUIRE_REDIS"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


def find_etcd() -> str | None:
    return os.environ.get("ETCD_BIN") or shutil.which("etcd")


class EtcdServer:
    """One single-member etcd process on 127.0.0.1."""

    def __init__(self, binary: str, directory: Path) -> None:
        self.binary = binary
        self.directory = directory
        self.client_port = free_port()
        self.peer_port = free_port()
        self.url = f"http://127.0.0.1:{self.client_port}"
        self.peer_url = f"http://127.0.0.1:{self.peer_port}"
        self.log_path = directory / "etcd.log"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> EtcdServer:
        command = [
            self.binary,
            "--name=test",
            f"--data-dir={self.directory / 'data'}",
            f"--listen-client-urls={self.url}",
            f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls={self.peer_url}",
            f"--initial-advertise-peer-urls={self.peer_url}",
            f"--initial-cluster=test={self.peer_url}",
            "--initial-cluster-state=new",
            "--logger=zap",
            "--log-outputs=stderr",
            "--log-level=warn",
        ]
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        client = EtcdClient(self.url, timeout=1.0)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                break
            if client.healthy():
                return self
            time.sleep(0.1)
        self.stop()
        log_tail = self.log_path.read_text(errors="replace")[-3000:]
        pytest.fail(f"etcd at {self.url} did not become healthy; its log:\n{log_tail}")

    def stop(self) -> None:
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(STOP_TIMEOUT_S)

    def client(self, timeout: float = 5.0) -> EtcdClient:
        return EtcdClient(self.url, timeout=timeout)


def etcd_or_skip(directory: Path) -> Iterator[EtcdServer]:
    """A started `EtcdServer` under ``directory`` for a fixture to yield; stopped after."""
    binary = find_etcd()
    if binary is None:
        message = "no etcd binary (install Debian's etcd-server, or set ETCD_BIN)"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{message}, and {REQUIRE_ENV}=1 requires it")
        pytest.skip(message)
    server = EtcdServer(binary, directory).start()
    try:
        yield server
    finally:
        server.stop()
