"""A private etcd server (a real one: Debian's ``etcd-server``) on free 127.0.0.1 ports, its log
in a directory of the caller's and its data in memory (`data_directory`); for the lock
cluster's tests (tests/cluster, tests/faults).

Without an etcd binary (``ETCD_BIN`` or ``etcd`` on PATH) the tests that need one skip, except
when CELERY_DFLOCK_REQUIRE_REDIS=1 (CI), where they fail: CI installs etcd, so a missing one is
a broken setup, not a reason to stop testing. `EtcdServer.stop` then `start` restarts it in
place (same ports, same data).
"""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dflockd_server.cluster.etcd import EtcdClient, EtcdTransport, Put, tls_context
from dflockd_server.cluster.etcd.messages import key_range
from tests.support.ports import free_ports
from tests.support.processes import stop_process

REQUIRE_ENV = "CELERY_DFLOCK_REQUIRE_REDIS"
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


MEMORY_FILESYSTEM = Path("/dev/shm")


def data_directory(owner: object) -> Path:
    """A new directory for etcd's data, in memory (``/dev/shm``) where the machine has it,
    removed once ``owner`` is gone. etcd syncs its write-ahead log to disk at every write; on a
    disk shared with the suite's lease journals, a loaded CI machine made that take seconds
    (etcd logged "slow fdatasync" of 1.2 s and requests of 3.6 s here beside a CPU hog), and
    then reads timed out in the members and the tests. What etcd keeps on a disk is etcd's
    business, not what these tests are about: its stalls are the nemeses' (a paused etcd)."""
    parent = MEMORY_FILESYSTEM if os.access(MEMORY_FILESYSTEM, os.W_OK) else None
    path = Path(tempfile.mkdtemp(prefix="dflock-test-etcd-", dir=parent))
    weakref.finalize(owner, shutil.rmtree, path, ignore_errors=True)
    return path


PORT_ATTEMPTS = 3
"""Starts at most, each on fresh ports after etcd found one of its ports taken."""


def _port_taken(log_path: Path) -> bool:
    """Whether etcd's log says it could not bind one of its ports."""
    return log_path.exists() and "address already in use" in log_path.read_text(errors="replace")


def _start_on_free_ports(
    start_once: Callable[[], bool],
    stop: Callable[[], None],
    port_taken: Callable[[], bool],
    fresh_ports: Callable[[int], None],
) -> bool:
    """``start_once`` until it succeeds; after a failure, ``stop``, and only when etcd said a
    port was taken, ``fresh_ports(attempt)`` and again (up to ``PORT_ATTEMPTS`` starts).
    A port that ``free_port`` found free may still be taken before etcd binds it, by a
    process that binds ports of its own (not an outgoing connection's end: those ports come
    from below the ephemeral range)."""
    for attempt in range(1, PORT_ATTEMPTS + 1):
        if start_once():
            return True
        stop()
        if attempt == PORT_ATTEMPTS or not port_taken():
            return False
        fresh_ports(attempt)
    return False


def healthy(transport: EtcdTransport, index: int = 0) -> bool:
    """etcd's ``/health`` on endpoint ``index`` says it is."""
    try:
        conn = transport.connect(index, transport.attempt_timeout)
    except (OSError, http.client.HTTPException):
        return False
    try:
        conn.request("GET", "/health")
        response = conn.getresponse()
        body = json.loads(response.read())
        return response.status == 200 and isinstance(body, dict) and body.get("health") == "true"
    except (OSError, http.client.HTTPException, ValueError):
        return False
    finally:
        conn.close()


def find_etcd() -> str | None:
    return os.environ.get("ETCD_BIN") or shutil.which("etcd")


OBSERVER_TIMEOUT_S = 30.0
"""A test's own reads of etcd (the map it checks against) beside members that load it: etcd
answered the suite's 5 s client too late once, under a heavy load, mid-rebalance."""


class EtcdServer:
    """One single-member etcd process on 127.0.0.1."""

    def __init__(self, binary: str, directory: Path) -> None:
        self.binary = binary
        self.directory = directory
        self.log_path = directory / "etcd.log"
        self.data_path = data_directory(self) / "data"
        self._process: subprocess.Popen[bytes] | None = None
        self._choose_ports()

    def _choose_ports(self) -> None:
        self.client_port, self.peer_port = free_ports(2)
        self.url = f"http://127.0.0.1:{self.client_port}"
        self.peer_url = f"http://127.0.0.1:{self.peer_port}"

    def start(self) -> EtcdServer:
        """Start etcd and wait until it is healthy (on fresh ports if one was taken)."""
        if _start_on_free_ports(
            self._start_once, self.stop, lambda: _port_taken(self.log_path), self._fresh_ports
        ):
            return self
        log_tail = self.log_path.read_text(errors="replace")[-3000:]
        pytest.fail(f"etcd at {self.url} did not become healthy; its log:\n{log_tail}")

    def _fresh_ports(self, attempt: int) -> None:
        self.log_path.rename(self.log_path.with_suffix(f".attempt{attempt}.log"))
        shutil.rmtree(self.data_path, ignore_errors=True)
        self._choose_ports()

    def _start_once(self) -> bool:
        command = [
            self.binary,
            "--name=test",
            f"--data-dir={self.data_path}",
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
        health = EtcdTransport(self.url, timeout=1.0)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                return False
            if healthy(health):
                return True
            time.sleep(0.1)
        return False

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
        return EtcdClient(EtcdTransport(self.url, timeout=timeout))

    @property
    def pid(self) -> int:
        """The running etcd's process id (to pause it)."""
        assert self._process is not None
        return self._process.pid


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


class EtcdNode:
    """One member of an `EtcdCluster` (its own process, ports and data directory)."""

    def __init__(self, binary: str, directory: Path, name: str, scheme: str) -> None:
        self.binary = binary
        self.directory = directory
        self.name = name
        self.client_port, self.peer_port = free_ports(2)
        self.address = f"127.0.0.1:{self.client_port}"
        self.url = f"{scheme}://{self.address}"
        self.peer_url = f"http://127.0.0.1:{self.peer_port}"
        self.log_path = directory / f"{name}.log"
        self.data_path = data_directory(self) / name
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, initial_cluster: str, tls_args: list[str]) -> None:
        command = [
            self.binary,
            f"--name={self.name}",
            f"--data-dir={self.data_path}",
            f"--listen-client-urls={self.url}",
            f"--advertise-client-urls={self.url}",
            f"--listen-peer-urls={self.peer_url}",
            f"--initial-advertise-peer-urls={self.peer_url}",
            f"--initial-cluster={initial_cluster}",
            "--initial-cluster-state=new",
            "--initial-cluster-token=dflockd-test",
            "--logger=zap",
            "--log-outputs=stderr",
            "--log-level=warn",
            *tls_args,
        ]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    def kill(self) -> None:
        """SIGKILL (and reap)."""
        process = self.process
        if process is not None and process.poll() is None:
            os.kill(process.pid, signal.SIGCONT)
            process.kill()
            process.wait(STOP_TIMEOUT_S)

    def pause(self) -> None:
        assert self.process is not None
        stop_process(self.process.pid)

    def resume(self) -> None:
        assert self.process is not None
        os.kill(self.process.pid, signal.SIGCONT)


class EtcdCluster:
    """Three (or ``size``) etcd processes forming one cluster on 127.0.0.1, over plain HTTP or,
    with ``tls`` = (CA, certificate, key) PEM paths, over TLS to the clients, which must show a
    certificate the CA signed (etcd's ``--trusted-ca-file``)."""

    def __init__(
        self,
        binary: str,
        directory: Path,
        size: int = 3,
        tls: tuple[Path, Path, Path] | None = None,
    ) -> None:
        self.tls = tls
        self._binary = binary
        self._directory = directory
        self._size = size
        self.nodes = self._new_nodes(directory)

    def _fresh_nodes(self, attempt: int) -> None:
        self.nodes = self._new_nodes(self._directory / f"attempt{attempt + 1}")

    def _new_nodes(self, directory: Path) -> list[EtcdNode]:
        directory.mkdir(parents=True, exist_ok=True)
        scheme = "https" if self.tls is not None else "http"
        return [EtcdNode(self._binary, directory, f"n{i}", scheme) for i in range(self._size)]

    @property
    def endpoints(self) -> str:
        """``h1:p1,h2:p2,...`` in the nodes' order."""
        return ",".join(node.address for node in self.nodes)

    def client(self, timeout: float = 5.0, **kwargs: Any) -> EtcdClient:
        scheme = "https" if self.tls is not None else "http"
        if self.tls is not None and "ssl_context" not in kwargs:
            ca, cert, key = self.tls
            kwargs["ssl_context"] = tls_context(str(ca), str(cert), str(key))
        return EtcdClient(EtcdTransport(f"{scheme}://{self.endpoints}", timeout=timeout, **kwargs))

    def start(self) -> EtcdCluster:
        """Start every node and wait until each is healthy; when a node's port was taken, the
        whole cluster again on new ports."""
        if _start_on_free_ports(
            self._start_once,
            self.stop,
            lambda: any(_port_taken(n.log_path) for n in self.nodes),
            self._fresh_nodes,
        ):
            return self
        tails = "\n".join(
            f"{n.name}: {n.log_path.read_text(errors='replace')[-1500:]}" for n in self.nodes
        )
        pytest.fail(f"the etcd cluster did not become healthy; its logs:\n{tails}")

    def _start_once(self) -> bool:
        initial = ",".join(f"{n.name}={n.peer_url}" for n in self.nodes)
        tls_args: list[str] = []
        if self.tls is not None:
            ca, cert, key = self.tls
            tls_args = [f"--cert-file={cert}", f"--key-file={key}", f"--trusted-ca-file={ca}"]
        for node in self.nodes:
            node.start(initial, tls_args)
        client = self.client(timeout=1.0)
        deadline = time.monotonic() + START_TIMEOUT_S * 2
        while time.monotonic() < deadline:
            if any(n.process is not None and n.process.poll() is not None for n in self.nodes):
                return False  # a node exited: it will not become healthy
            if all(healthy(client.transport, i) for i in range(len(self.nodes))):
                return True
            time.sleep(0.2)
        return False

    def leader(self, client: EtcdClient) -> EtcdNode:
        """The node raft elected (asked of the nodes that answer)."""
        for index, node in enumerate(self.nodes):
            reply = self._ask(client, index, "/v3/maintenance/status", {})
            if reply is not None and str(reply.get("leader")) == _member_id(reply):
                return node
        raise AssertionError("no etcd node says it is the leader")

    def make_leader(self, client: EtcdClient, node: EtcdNode) -> None:
        """Raft's leadership moved to ``node`` (etcd's own leadership transfer, asked of the
        leader), once ``node`` says it leads."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            leader = self.leader(client)
            if leader is node:
                return
            status = self._ask(client, self.nodes.index(node), "/v3/maintenance/status", {})
            if status is not None:
                body = {"targetID": _member_id(status)}
                self._ask(
                    client, self.nodes.index(leader), "/v3/maintenance/transfer-leadership", body
                )
            time.sleep(0.2)
        raise AssertionError(f"etcd node {node.name} did not become the leader")

    def _ask(
        self, client: EtcdClient, index: int, path: str, body: dict[str, Any]
    ) -> dict[str, Any] | None:
        """Node ``index``'s own answer (None when it is down or does not answer)."""
        process = self.nodes[index].process
        if process is None or process.poll() is not None:
            return None
        try:
            conn = client.transport.connect(index, 2.0)
        except OSError:
            return None
        try:
            conn.request("POST", path, json.dumps(body).encode())
            reply: dict[str, Any] = json.loads(conn.getresponse().read())
        except (OSError, ValueError):
            return None
        finally:
            conn.close()
        return reply

    def stop(self) -> None:
        for node in self.nodes:
            node.kill()


def etcd_cluster_or_skip(
    directory: Path, tls: tuple[Path, Path, Path] | None = None
) -> Iterator[EtcdCluster]:
    """A started three-node `EtcdCluster` for a fixture to yield; stopped after."""
    binary = find_etcd()
    if binary is None:
        message = "no etcd binary (install Debian's etcd-server, or set ETCD_BIN)"
        if os.environ.get(REQUIRE_ENV) == "1":
            pytest.fail(f"{message}, and {REQUIRE_ENV}=1 requires it")
        pytest.skip(message)
    cluster = EtcdCluster(binary, directory, tls=tls).start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _member_id(status: dict[str, Any]) -> str:
    """The answering node's raft member id, from its ``/v3/maintenance/status``."""
    header: dict[str, Any] = status.get("header", {})
    return str(header.get("member_id"))


def put(client: EtcdClient, key: str, value: str, *, lease: int = 0) -> int:
    """Set ``key`` as an operator would (a plain put, sent again, as every call, after an
    attempt that got no answer); returns the new revision."""
    body = Put(key, value, lease).to_json()["request_put"]
    reply = client.transport.call("/v3/kv/put", body, f"put of {key!r}")
    return int(reply.get("header", {}).get("revision", 0))


def delete(client: EtcdClient, key: str, *, prefix: bool = False) -> int:
    """Delete the key (or every key under the prefix); how many were deleted."""
    reply = client.transport.call(
        "/v3/kv/deleterange", key_range(key, prefix), f"delete of {key!r}"
    )
    return int(reply.get("deleted", 0))


def lease_time_to_live(client: EtcdClient, lease_id: int) -> int:
    """Seconds left on the lease, -1 if it no longer exists."""
    reply = client.transport.call(
        "/v3/lease/timetolive", {"ID": str(lease_id)}, f"time to live of lease {lease_id:x}"
    )
    return int(reply.get("TTL", 0))
