"""What the real ``dflockd`` says at start-up about where it is deployed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflock_proc import DflockdProcess


def test_a_loopback_server_in_a_kubernetes_pod_warns_it_serves_that_pod_only(
    dflockd_process: Any,
) -> None:
    proc: DflockdProcess = dflockd_process(
        "--host", "127.0.0.1", "--port", "0", env={"KUBERNETES_SERVICE_HOST": "10.96.0.1"}
    )
    proc.wait_listening()
    warning = proc.wait_for("Kubernetes pod")
    assert "WARNING" in warning
    assert "only this pod can reach" in warning


def test_no_pod_warning_outside_kubernetes_or_on_a_reachable_address(
    dflockd_process: Any, tmp_path: Path
) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s3cret-for-the-test")
    outside: DflockdProcess = dflockd_process("--host", "127.0.0.1", "--port", "0")
    served: DflockdProcess = dflockd_process(
        "--host",
        "0.0.0.0",
        "--port",
        "0",
        "--auth-token-file",
        str(secret),
        env={"KUBERNETES_SERVICE_HOST": "10.96.0.1"},
    )
    for proc in (outside, served):
        proc.wait_listening()
        proc.kill()
        assert not any("Kubernetes" in line for line in proc.lines), proc.lines
