"""The container's health check (``python -m dflockd_server.health``, the image's HEALTHCHECK
and the manifests' probes) run beside a real ``dflockd`` with the same environment, as the
container runs both."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.ports import free_port
from tests.support.servers import DflockdProcess, clean_env


def _health(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "dflockd_server.health"],
        env=clean_env(env),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_the_check_reads_the_environment_as_the_server_does(dflockd_process: Any) -> None:
    # A secret made from a file ends in a newline, an unused variable may be set empty, and a
    # server may listen on one address only: the server takes each, so the check must too.
    env = {
        "DFLOCKD_HOST": "127.0.0.2",
        "DFLOCKD_PORT": str(free_port()),
        "DFLOCKD_AUTH_TOKEN": "s3cret\n",
        "DFLOCKD_AUTH_TOKEN_FILE": "",
        "DFLOCKD_TLS_CERT": "",
    }
    proc: DflockdProcess = dflockd_process(env=env)
    proc.wait_listening()
    healthy = _health(env)
    assert healthy.returncode == 0, healthy.stderr
    refused = _health({**env, "DFLOCKD_AUTH_TOKEN": "wrong"})
    assert refused.returncode == 1
    assert "auth refused" in refused.stderr


def test_a_port_the_server_would_refuse_is_a_bad_setting_not_another_port(
    dflockd_process: Any,
) -> None:
    """The check took ``DFLOCKD_PORT`` (or its port argument) unchecked: 65536 past the
    server's port reached the server (the resolver keeps 16 bits) and said healthy, while
    ``dflockd`` refuses that value."""
    port = free_port()
    proc: DflockdProcess = dflockd_process(
        env={"DFLOCKD_HOST": "127.0.0.1", "DFLOCKD_PORT": str(port)}
    )
    proc.wait_listening()
    wrapped = str(port + 65536)
    for name, said in (
        ("DFLOCKD_PORT", _health({"DFLOCKD_PORT": wrapped})),
        (
            "port",
            subprocess.run(
                [sys.executable, "-m", "dflockd_server.health", "127.0.0.1", wrapped],
                env=clean_env({}),
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            ),
        ),
    ):
        assert said.returncode == 1
        assert f"bad setting: {name}='{wrapped}'" in said.stderr, said.stderr


def test_a_server_on_every_ipv6_address_is_checked_where_it_listens(
    dflockd_process: Any, tmp_path: Path
) -> None:
    """``DFLOCKD_HOST=::`` binds IPv6 only (the loop sets ``IPV6_V6ONLY``), and the check
    pinged 127.0.0.1 there: a healthy server was reported unreachable, so its container was
    marked unhealthy and its pod never ready."""
    try:
        socket.create_server(("::1", 0), family=socket.AF_INET6).close()
    except OSError:
        pytest.skip("no IPv6 loopback here")
    env = {
        "DFLOCKD_HOST": "::",
        "DFLOCKD_PORT": str(free_port()),
        "DFLOCKD_STATE_DIR": str(tmp_path / "state"),
    }
    proc: DflockdProcess = dflockd_process(env=env)
    proc.wait_listening()
    healthy = _health(env)
    assert healthy.returncode == 0, healthy.stderr


def test_what_the_check_cannot_use_is_refused_not_ignored(dflockd_process: Any) -> None:
    """``python -m dflockd_server.health HOST PORT EXTRA`` (a probe written with a third
    argument, say the auth token) checked HOST:PORT and said healthy, the rest ignored; a flag
    (``--port 7000``, ``--help``) was taken for the host. Each is refused with the usage."""
    proc: DflockdProcess = dflockd_process(
        "--host", "127.0.0.1", "--port", "0", "--state-dir", "none"
    )
    _, port = proc.wait_listening()
    for args in (["127.0.0.1", str(port), "s3cret"], ["--port", str(port)], ["--help"]):
        done = subprocess.run(
            [sys.executable, "-m", "dflockd_server.health", *args],
            env=clean_env({}),
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert done.returncode == 1, (args, done.stderr)
        assert "usage: python -m dflockd_server.health [HOST [PORT]]" in done.stderr, done.stderr
    assert _health({"DFLOCKD_HOST": "127.0.0.1", "DFLOCKD_PORT": str(port)}).returncode == 0
