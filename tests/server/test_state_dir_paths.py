"""How ``--state-dir`` / ``DFLOCKD_STATE_DIR`` is read, on ``dflockd`` started as a user starts
it: from an environment that does not expand ``~`` (docker-compose, systemd ``Environment=``,
Kubernetes), and from another working directory."""

from __future__ import annotations

from pathlib import Path

from tests.support.ports import free_port
from tests.support.servers import DflockdProcess


def test_a_tilde_state_dir_is_the_home_directory(tmp_path: Path) -> None:
    """``DFLOCKD_STATE_DIR=~/dflockd`` made a directory named ``~`` in the working directory,
    so a start from another directory (or as another service unit) found no journal and lost
    every lock held. It is the user's home now, as in a shell, and the log names it in full."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    proc = DflockdProcess(
        ["--host", "127.0.0.1", "--port", str(free_port())],
        {"DFLOCKD_STATE_DIR": "~/dflockd", "HOME": str(home)},
        cwd=work,
    )
    try:
        line = proc.wait_for("listening on")
    finally:
        proc.kill()
    assert f"state_dir={home / 'dflockd'} " in line, line
    assert not (work / "~").exists()
    assert (home / "dflockd" / "journal").exists()


def test_a_relative_state_dir_is_logged_in_full(tmp_path: Path) -> None:
    """``--state-dir state`` is under the directory dflockd starts in; the log names the full
    path, so a restart from elsewhere (which would use another directory) can be spotted."""
    proc = DflockdProcess(
        ["--host", "127.0.0.1", "--port", str(free_port()), "--state-dir", "state"],
        {},
        cwd=tmp_path,
    )
    try:
        line = proc.wait_for("listening on")
    finally:
        proc.kill()
    assert f"state_dir={tmp_path / 'state'} " in line, line
