"""docker-compose.yml rehearsed as plain processes (no Docker engine on these machines).

Each service's command and environment are read from the compose file; only what a container
network provides is mapped to this machine: the host names ``redis`` and ``dflockd`` become
127.0.0.1 (Redis on its usual port, database 15; the lock server on a free port), paths inside
the containers move to a scratch folder, and ``celery``/``dflockd`` are this venv's.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from prometheus_client.parser import text_string_to_metric_families
from ruamel.yaml import YAML

from tests.support.etcd import EtcdServer
from tests.support.ports import free_port
from tests.support.processes import kill_group
from tests.support.servers import run_dflockd
from tests.support.services import redis_url

ROOT = Path(__file__).resolve().parents[1]
REDIS_URL = redis_url("compose")

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def _compose(name: str = "docker-compose.yml") -> dict[str, Any]:
    with (ROOT / name).open(encoding="utf-8") as fh:
        return YAML(typ="safe").load(fh)


Hosts = dict[str, str]
"""A compose network's ``host:port`` -> where that service listens here."""


Mounts = dict[str, Path]
"""A container's named-volume mount point -> the folder every service mounting it shares."""


def _localize(value: str, hosts: Hosts, tmp: Path, mounts: Mounts | None = None) -> str:
    value = value.replace("redis://redis:6379/0", REDIS_URL)
    for name in sorted(hosts, key=len, reverse=True):  # dflockd-1:6388 before dflockd:6388
        value = value.replace(name, hosts[name])
    for mount, folder in (mounts or {}).items():
        if value == mount or value.startswith(f"{mount}/"):
            return f"{folder}{value[len(mount) :]}"
    return re.sub(r"^/(tmp|var/lib/dflockd)/", f"{tmp}/", value)


def _mounts(service: dict[str, Any], tmp: Path) -> Mounts:
    """The service's named volumes (``name:/path``), each a folder of ``tmp`` (made here)."""
    mounts: Mounts = {}
    for volume in service.get("volumes", []):
        name, _, mount = str(volume).partition(":")
        (tmp / name).mkdir(exist_ok=True)
        mounts[mount] = tmp / name
    return mounts


def _env(
    service: dict[str, Any], hosts: Hosts, tmp: Path, mounts: Mounts | None = None
) -> dict[str, str]:
    env = {
        k: _localize(str(v), hosts, tmp, mounts) for k, v in service.get("environment", {}).items()
    }
    return {**os.environ, **env, "PYTHONPATH": str(ROOT)}


def _argv(command: list[str], hosts: Hosts, tmp: Path, mounts: Mounts | None = None) -> list[str]:
    local = [_localize(str(part), hosts, tmp, mounts) for part in command]
    if local[0] == "celery":
        return [sys.executable, "-m", "celery", *local[1:]]
    if local[0] == "python":
        return [sys.executable, *local[1:]]
    raise AssertionError(f"unexpected command in a compose file: {command}")


STATE_DIR = "/var/lib/dflockd"
"""The image's state dir (DFLOCKD_STATE_DIR in server/Dockerfile)."""


@pytest.mark.parametrize("name", ["docker-compose.yml", "docker-compose.cluster.yml"])
def test_every_dflockd_service_keeps_its_state_dir_on_a_named_volume_of_its_own(
    name: str,
) -> None:
    compose = _compose(name)
    servers = {
        service_name: service
        for service_name, service in compose["services"].items()
        if service.get("build", {}).get("context") == "server"
    }
    assert servers, f"{name}: no dflockd service"
    volumes: list[str] = []
    for service_name, service in servers.items():
        assert service["environment"]["DFLOCKD_STATE_DIR"] == STATE_DIR, service_name
        mounted = [
            str(v).split(":")[0] for v in service.get("volumes", []) if f":{STATE_DIR}" in str(v)
        ]
        assert len(mounted) == 1, f"{name}: {service_name} mounts nothing at {STATE_DIR}"
        assert mounted[0] in compose["volumes"], f"{name}: {mounted[0]} is not a named volume"
        volumes += mounted
    # Two servers on one state dir: the second refuses to start.
    assert len(volumes) == len(set(volumes)), f"{name}: dflockd services share a volume"


def test_the_image_declares_its_state_dir_a_volume_its_user_owns() -> None:
    dockerfile = (ROOT / "server" / "Dockerfile").read_text()
    assert f"DFLOCKD_STATE_DIR={STATE_DIR}" in dockerfile
    assert f'VOLUME ["{STATE_DIR}"]' in dockerfile
    assert f"chown dflockd {STATE_DIR}" in dockerfile
    assert "USER dflockd" in dockerfile


class Topology:
    """The compose services started as processes, each with its log file."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        with (self.tmp / f"{name}.log").open("wb") as log:
            self.procs[name] = subprocess.Popen(
                argv, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, process_group=0
            )

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text(encoding="utf-8", errors="replace")

    def wait_log(self, name: str, pattern: str, timeout: float = 40.0) -> None:
        deadline = time.monotonic() + timeout
        while pattern not in self.log(name):
            assert self.procs[name].poll() is None, f"{name} exited:\n{self.log(name)}"
            assert time.monotonic() < deadline, f"{name}: no {pattern!r}:\n{self.log(name)}"
            time.sleep(0.2)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                kill_group(proc, timeout=None)
            proc.wait()


@pytest.fixture
def topology(redis_required: None, tmp_path: Path) -> Iterator[Topology]:
    with redis.Redis.from_url(REDIS_URL) as client:
        client.flushdb()
    topo = Topology(tmp_path)
    yield topo
    topo.stop()
    with redis.Redis.from_url(REDIS_URL) as client:
        client.flushdb()


def test_the_compose_topology_works_as_processes(topology: Topology, tmp_path: Path) -> None:
    services = _compose()["services"]
    assert set(services) == {"redis", "dflockd", "worker-1", "worker-2", "beat-1", "beat-2"}
    port = free_port()
    hosts = {"dflockd:6388": f"127.0.0.1:{port}"}

    # The sidecar: the image's ENTRYPOINT is `dflockd`, configured by the service's environment.
    dflockd = services["dflockd"]
    assert 'ENTRYPOINT ["dflockd"]' in (ROOT / "server" / "Dockerfile").read_text()
    server_env = {**_env(dflockd, hosts, tmp_path), "DFLOCKD_PORT": str(port)}
    server_env["DFLOCKD_HOST"] = "127.0.0.1"  # a container binds 0.0.0.0; here only loopback
    assert server_env["DFLOCKD_STATE_DIR"] == STATE_DIR
    server_env["DFLOCKD_STATE_DIR"] = str(tmp_path / "dflockd-state")  # its named volume
    assert dflockd["environment"]["DFLOCKD_METRICS_PORT"] == "9388"
    metrics_port = free_port()
    server_env["DFLOCKD_METRICS_PORT"] = str(metrics_port)
    topology.start("dflockd", [str(Path(sys.executable).parent / "dflockd")], server_env)

    # Its healthcheck, exactly as the compose file states it, turns healthy.
    health = _argv(dflockd["healthcheck"]["test"][1:], hosts, tmp_path)
    deadline = time.monotonic() + 20
    while subprocess.run(health, env=server_env, capture_output=True, check=False).returncode:
        assert time.monotonic() < deadline, topology.log("dflockd")
        time.sleep(0.2)

    for name in ("worker-1", "worker-2", "beat-1", "beat-2"):
        service = services[name]
        assert service["depends_on"]["dflockd"]["condition"] == "service_healthy"
        own = tmp_path / name  # the container's own files (/tmp): no other container sees them
        own.mkdir()
        mounts = _mounts(service, tmp_path)
        env = {**_env(service, hosts, own, mounts), "CELERY_RESULT_BACKEND": REDIS_URL}
        topology.start(name, _argv(service["command"], hosts, own, mounts), env)
    for name in ("worker-1", "worker-2"):
        topology.wait_log(name, "ready.")
    for name in ("beat-1", "beat-2"):
        topology.wait_log(name, "beat: ")

    # Exactly one beat becomes active; the other stands by.
    deadline = time.monotonic() + 30
    while not any("beat: active" in topology.log(b) for b in ("beat-1", "beat-2")):
        assert time.monotonic() < deadline, topology.log("beat-1") + topology.log("beat-2")
        time.sleep(0.2)
    active = [b for b in ("beat-1", "beat-2") if "beat: active" in topology.log(b)]
    assert len(active) == 1, active
    standby = "beat-2" if active == ["beat-1"] else "beat-1"
    assert "beat: standby" in topology.log(standby)

    # The workers run locked tasks through the sidecar (with its shared secret).
    client = Celery("compose-client", broker=REDIS_URL, backend=REDIS_URL)
    try:
        results = [
            client.send_task("examples.proj.app.sync_account", kwargs={"account_id": 1})
            for _ in range(4)
        ]
        assert [r.get(timeout=60) for r in results] == ["account 1 synced"] * 4
        balance = client.send_task(
            "examples.proj.app.add_to_balance", kwargs={"account": "acme", "amount": 3}
        )
        assert balance.get(timeout=30) == 3
        # Both workers write to one fenced ledger: each add sees every add before it.
        total = 3
        deadline = time.monotonic() + 60
        while not all(
            re.search(r"add_to_balance\[\S+\] succeeded", topology.log(w))
            for w in ("worker-1", "worker-2")
        ):
            assert time.monotonic() < deadline, "one worker ran every add_to_balance"
            adds = [
                client.send_task(
                    "examples.proj.app.add_to_balance", kwargs={"account": "acme", "amount": 1}
                )
                for _ in range(8)
            ]
            total += len(adds)
            assert max(r.get(timeout=30) for r in adds) == total
    finally:
        client.close()
    # A worker logs "succeeded" after it stored the result: give the last line time to land.
    deadline = time.monotonic() + 10
    while (ran := topology.log("worker-1") + topology.log("worker-2")).count(
        "succeeded in"
    ) < 13 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ran.count("succeeded in") >= 13, ran[-3000:]

    # The sidecar's metrics endpoint saw those grants (plus the active beat's lock).
    url = f"http://127.0.0.1:{metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    grants = {
        sample.labels["kind"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "dflockd_grants_total"
    }
    assert grants["lock"] >= 6, text


def test_the_cluster_compose_topology_works_as_processes(
    topology: Topology, tmp_path: Path, private_etcd: EtcdServer
) -> None:
    """docker-compose.cluster.yml: etcd, three dflockd members, workers and beats pointing at
    the members as seeds with the cluster strategy."""
    services = _compose("docker-compose.cluster.yml")["services"]
    members = ["dflockd-1", "dflockd-2", "dflockd-3"]
    assert set(services) == {"redis", "etcd", *members, "worker-1", "worker-2", "beat-1", "beat-2"}
    assert "--listen-client-urls=http://0.0.0.0:2379" in services["etcd"]["command"]
    etcd = private_etcd  # Debian's etcd, not the image
    hosts = {"etcd:2379": f"127.0.0.1:{etcd.client_port}"}
    hosts |= {f"{name}:6388": f"127.0.0.1:{free_port()}" for name in members}
    # Compose starts the members together (each depends only on etcd); so does this, and only
    # then waits for each one's health check. Started one after another, each after the last
    # was healthy, they can come more than the map's settle time apart on a loaded machine,
    # and the first member's initial map then holds only itself.
    checks: list[tuple[str, list[str], dict[str, str]]] = []
    for name in members:
        service = services[name]
        assert service["depends_on"]["etcd"]["condition"] == "service_healthy"
        state = tmp_path / name
        state.mkdir()
        env = {
            **_env(service, hosts, tmp_path),
            "DFLOCKD_HOST": "127.0.0.1",  # a container binds 0.0.0.0; here only loopback
            "DFLOCKD_PORT": hosts[f"{name}:6388"].rsplit(":", 1)[1],
            "DFLOCKD_METRICS_PORT": str(free_port()),
        }
        assert env["DFLOCKD_STATE_DIR"] == STATE_DIR
        env["DFLOCKD_STATE_DIR"] = str(state)  # a volume per member
        assert env["DFLOCKD_ADVERTISE"] == hosts[f"{name}:6388"]
        topology.start(name, [str(Path(sys.executable).parent / "dflockd")], env)
        checks.append((name, _argv(service["healthcheck"]["test"][1:], hosts, tmp_path), env))
    for name, health, env in checks:
        deadline = time.monotonic() + 30
        while subprocess.run(health, env=env, capture_output=True, check=False).returncode:
            assert time.monotonic() < deadline, topology.log(name)
            time.sleep(0.2)

    # The command the compose file's header shows, against the members' map in etcd.
    url = services["dflockd-1"]["environment"]["DFLOCKD_CLUSTER"]
    shards_args = ["shards", "--cluster", _localize(url, hosts, tmp_path)]
    deadline = time.monotonic() + 30
    while True:
        shown = run_dflockd(shards_args, {})
        served = [line for line in shown.stdout.splitlines() if ", serving " in line]
        if shown.returncode == 0 and len(served) == 3:
            break
        assert time.monotonic() < deadline, shown.stdout + shown.stderr
        time.sleep(0.5)

    for name in ("worker-1", "worker-2", "beat-1", "beat-2"):
        service = services[name]
        for member in members:
            assert service["depends_on"][member]["condition"] == "service_healthy"
        own = tmp_path / name
        own.mkdir()
        mounts = _mounts(service, tmp_path)
        env = {**_env(service, hosts, own, mounts), "CELERY_RESULT_BACKEND": REDIS_URL}
        assert env["DFLOCK_SHARDING_STRATEGY"] == "cluster"
        topology.start(name, _argv(service["command"], hosts, own, mounts), env)
    for name in ("worker-1", "worker-2"):
        topology.wait_log(name, "ready.")
    deadline = time.monotonic() + 30
    while not any("beat: active" in topology.log(b) for b in ("beat-1", "beat-2")):
        assert time.monotonic() < deadline, topology.log("beat-1") + topology.log("beat-2")
        time.sleep(0.2)

    client = Celery("compose-cluster-client", broker=REDIS_URL, backend=REDIS_URL)
    try:
        results = [
            client.send_task("examples.proj.app.sync_account", kwargs={"account_id": n})
            for n in range(6)
        ]
        assert [r.get(timeout=60) for r in results] == [f"account {n} synced" for n in range(6)]
    finally:
        client.close()
