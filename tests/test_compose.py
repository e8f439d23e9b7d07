"""docker-compose.yml rehearsed as plain processes (no Docker engine on these machines).

Each service's command and environment are read from the compose file; only what a container
network provides is mapped to this machine: the host names ``redis`` and ``dflockd`` become
127.0.0.1 (Redis on its usual port, database 15; the lock server on a free port), paths inside
the containers move to a scratch folder, and ``celery``/``dflockd`` are this venv's.
"""

from __future__ import annotations

import os
import re
import signal
import socket
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

ROOT = Path(__file__).resolve().parents[1]
REDIS_URL = "redis://127.0.0.1:6379/15"

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def _compose() -> dict[str, Any]:
    with (ROOT / "docker-compose.yml").open(encoding="utf-8") as fh:
        return YAML(typ="safe").load(fh)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _localize(value: str, port: int, tmp: Path) -> str:
    value = value.replace("redis://redis:6379/0", REDIS_URL)
    value = value.replace("dflockd:6388", f"127.0.0.1:{port}")
    return re.sub(r"^/(tmp|var/lib/dflockd)/", f"{tmp}/", value)


def _env(service: dict[str, Any], port: int, tmp: Path) -> dict[str, str]:
    env = {k: _localize(str(v), port, tmp) for k, v in service.get("environment", {}).items()}
    return {**os.environ, **env, "PYTHONPATH": str(ROOT)}


def _argv(command: list[str], port: int, tmp: Path) -> list[str]:
    local = [_localize(str(part), port, tmp) for part in command]
    if local[0] == "celery":
        return [sys.executable, "-m", "celery", *local[1:]]
    if local[0] == "python":
        return [sys.executable, *local[1:]]
    raise AssertionError(f"unexpected command in docker-compose.yml: {command}")


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
                os.killpg(proc.pid, signal.SIGKILL)
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
    port = _free_port()

    # The sidecar: the image's ENTRYPOINT is `dflockd`, configured by the service's environment.
    dflockd = services["dflockd"]
    assert 'ENTRYPOINT ["dflockd"]' in (ROOT / "server" / "Dockerfile").read_text()
    server_env = {**_env(dflockd, port, tmp_path), "DFLOCKD_PORT": str(port)}
    server_env["DFLOCKD_HOST"] = "127.0.0.1"  # a container binds 0.0.0.0; here only loopback
    assert dflockd["environment"]["DFLOCKD_METRICS_PORT"] == "9388"
    metrics_port = _free_port()
    server_env["DFLOCKD_METRICS_PORT"] = str(metrics_port)
    topology.start("dflockd", [str(Path(sys.executable).parent / "dflockd")], server_env)

    # Its healthcheck, exactly as the compose file states it, turns healthy.
    health = _argv(dflockd["healthcheck"]["test"][1:], port, tmp_path)
    deadline = time.monotonic() + 20
    while subprocess.run(health, env=server_env, capture_output=True, check=False).returncode:
        assert time.monotonic() < deadline, topology.log("dflockd")
        time.sleep(0.2)

    for name in ("worker-1", "worker-2", "beat-1", "beat-2"):
        service = services[name]
        assert service["depends_on"]["dflockd"]["condition"] == "service_healthy"
        env = {**_env(service, port, tmp_path), "CELERY_RESULT_BACKEND": REDIS_URL}
        topology.start(name, _argv(service["command"], port, tmp_path), env)
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
    finally:
        client.close()
    assert (tmp_path / "example-ledger.sqlite3").exists()  # the container path, mapped
    # A worker logs "succeeded" after it stored the result: give the last line time to land.
    deadline = time.monotonic() + 10
    while (ran := topology.log("worker-1") + topology.log("worker-2")).count(
        "succeeded in"
    ) < 5 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert ran.count("succeeded in") >= 5, ran[-3000:]

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
