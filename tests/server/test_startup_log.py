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


def test_a_secret_on_the_command_line_and_fence_state_are_warned_about(
    dflockd_process: Any, tmp_path: Path
) -> None:
    state = tmp_path / "fence-state"
    proc: DflockdProcess = dflockd_process(
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--auth-token",
        "visible-in-ps",
        "--fence-state-file",
        str(state),
    )
    proc.wait_listening()
    secret_warning = proc.wait_for("process list")
    assert "WARNING" in secret_warning
    assert "--auth-token-file or DFLOCKD_AUTH_TOKEN" in secret_warning
    assert "does not exist yet" in proc.wait_for("fence state file")
    proc.kill()
    bare: DflockdProcess = dflockd_process("--host", "127.0.0.1", "--port", "0")
    bare.wait_listening()
    assert "a clock set back" in bare.wait_for("no --fence-state-file")
    bare.kill()


def test_no_secret_or_fence_warning_when_both_are_kept_well(
    dflockd_process: Any, tmp_path: Path
) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s3cret-for-the-test")
    state = tmp_path / "fence-state"
    first: DflockdProcess = dflockd_process(
        "--host", "127.0.0.1", "--port", "0", "--fence-state-file", str(state)
    )
    first.wait_listening()
    first.kill()
    assert state.exists()
    again: DflockdProcess = dflockd_process(
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--auth-token-file",
        str(secret),
        "--fence-state-file",
        str(state),
    )
    again.wait_listening()
    again.kill()
    assert not any("WARNING" in line for line in again.lines), again.lines
