"""What the real ``dflockd`` says at start-up about where it is deployed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

from dflockd_server import constants
from tests.support.ports import free_port
from tests.support.servers import DflockdProcess


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
    # The environment's token wins, and the flag's is still on show (it was not warned about).
    both: DflockdProcess = dflockd_process(
        "--host", "127.0.0.1", "--port", "0", "--auth-token", "visible-in-ps",
        env={"DFLOCKD_AUTH_TOKEN": "kept-well"},
    )  # fmt: skip
    both.wait_listening()
    assert "WARNING" in both.wait_for("process list")
    both.kill()
    bare: DflockdProcess = dflockd_process(
        "--host", "127.0.0.1", "--port", str(free_port()), "--state-dir", "none"
    )
    bare.wait_listening()
    warning = bare.wait_for("no state directory")
    assert "a restart forgets every lock" in warning
    assert "a clock set back" in warning
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


def _room_in_a_child(soft: int, hard: int, max_connections: int) -> tuple[str, int]:
    """``make_room_for_connections`` run in a child process started with these open-file
    limits: (its warning or "", the soft limit after)."""
    code = (
        "import resource, sys\n"
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({soft}, {hard}))\n"
        "from dflockd_server.cli import make_room_for_connections\n"
        f"print(make_room_for_connections({max_connections}) or '')\n"
        "print(resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=30
    ).stdout.splitlines()
    return out[0], int(out[1])


def test_the_open_file_limit_is_raised_to_what_max_connections_needs() -> None:
    needed = 4096 + constants.FD_HEADROOM
    assert _room_in_a_child(256, 8192, 4096) == ("", needed)
    warning, soft = _room_in_a_child(256, 1024, 4096)
    assert soft == 1024
    assert "--max-connections / DFLOCKD_MAX_CONNECTIONS=4096" in warning
    assert "open-file limit (1024)" in warning
    assert _room_in_a_child(256, 1024, 0) == ("", 256)  # no cap: nothing to make room for


def test_a_flag_an_environment_variable_overrides_is_warned_about(
    dflockd_process: Any, tmp_path: Path
) -> None:
    """The environment variable wins over the flag (as the seed documents), and the image sets
    ``DFLOCKD_HOST``, ``DFLOCKD_PORT`` and ``DFLOCKD_STATE_DIR``: ``docker run IMAGE
    --state-dir /data`` kept the journal in the image's volume without a word. The start now
    names the flag that is not used and the variable that is."""
    used, ignored = tmp_path / "used", tmp_path / "ignored"
    proc: DflockdProcess = dflockd_process(
        "--host", "127.0.0.1", "--port", "0", "--state-dir", str(ignored),
        env={"DFLOCKD_STATE_DIR": str(used), "DFLOCKD_HOST": "127.0.0.1"},
    )  # fmt: skip
    proc.wait_listening()
    warning = proc.wait_for("is not used")
    assert "WARNING" in warning, warning
    assert f"--state-dir {str(ignored)!r}" in warning, warning
    assert f"DFLOCKD_STATE_DIR={str(used)!r}" in warning, warning
    proc.kill()
    # the same value both ways (the host) is no conflict: one warning only
    assert sum("is not used" in line for line in proc.lines) == 1, proc.lines


def test_a_flag_whose_value_is_refused_and_overridden_is_warned_about_not_a_traceback(
    dflockd_process: Any,
) -> None:
    """A flag whose value is refused (``--port abc``) while its environment variable is set:
    the variable wins, and the start warns that the flag is not used. The warning's check
    parsed the flag's value again and ended the start in a ``ValueError`` traceback."""
    proc: DflockdProcess = dflockd_process(
        "--host", "127.0.0.1", "--port", "abc", "--state-dir", "none", env={"DFLOCKD_PORT": "0"}
    )  # fmt: skip
    proc.wait_listening()
    warning = proc.wait_for("is not used")
    assert "--port 'abc' is not used" in warning and "DFLOCKD_PORT='0'" in warning, warning
    proc.kill()
    assert not any("Traceback" in line for line in proc.lines), proc.lines


def test_a_switch_its_environment_variable_overrides_is_warned_about(
    dflockd_process: Any,
) -> None:
    """A switch (``--auto-release-on-disconnect``, ``--no-...``) that its environment variable
    overrides with the other value is named in the warning, as a flag with a value is; it was
    left out, so ``DFLOCKD_AUTO_RELEASE_ON_DISCONNECT=0 dflockd --auto-release-on-disconnect``
    started with grants kept past a close, and said nothing of the switch it ignored."""
    proc: DflockdProcess = dflockd_process(
        "--host", "127.0.0.1", "--port", "0", "--state-dir", "none",
        "--auto-release-on-disconnect",
        env={"DFLOCKD_AUTO_RELEASE_ON_DISCONNECT": "0"},
    )  # fmt: skip
    proc.wait_listening()
    warning = proc.wait_for("is not used")
    assert "--auto-release-on-disconnect is not used" in warning, warning
    assert "DFLOCKD_AUTO_RELEASE_ON_DISCONNECT='0'" in warning, warning
    proc.kill()
    same: DflockdProcess = dflockd_process(
        "--host", "127.0.0.1", "--port", "0", "--state-dir", "none",
        "--no-auto-release-on-disconnect", "--session-ttl", "3",
        env={"DFLOCKD_AUTO_RELEASE_ON_DISCONNECT": "no", "DFLOCKD_SESSION_TTL_S": "4"},
    )  # fmt: skip
    same.wait_listening()
    same.wait_for("--session-ttl '3' is not used")  # warned after the switch's would be
    same.kill()
    assert sum("is not used" in line for line in same.lines) == 1, same.lines
    negated: DflockdProcess = dflockd_process(
        "--host", "127.0.0.1", "--port", "0", "--state-dir", "none",
        "--no-auto-release-on-disconnect",
        env={"DFLOCKD_AUTO_RELEASE_ON_DISCONNECT": "yes"},
    )  # fmt: skip
    negated.wait_listening()
    warning = negated.wait_for("is not used")
    assert "--no-auto-release-on-disconnect is not used" in warning, warning
    negated.kill()
