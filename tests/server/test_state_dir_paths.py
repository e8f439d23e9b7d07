"""How ``--state-dir`` / ``DFLOCKD_STATE_DIR`` is read, on ``dflockd`` started as a user starts
it: from an environment that does not expand ``~`` (docker-compose, systemd ``Environment=``,
Kubernetes), and from another working directory."""

from __future__ import annotations

import signal
from pathlib import Path

from tests.support.ports import free_port
from tests.support.servers import DflockdProcess
from tests.support.wire import Wire


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


def test_a_start_with_another_host_on_the_port_waits_for_the_leases_of_the_one_before(
    tmp_path: Path,
) -> None:
    """The default state dir is by address, so ``dflockd`` stopped and started again with
    another ``--host`` on the same port (``0.0.0.0``, then ``127.0.0.1``, as the warning about
    a public bind without auth suggests) found a new, empty directory: a first start, granting
    at once a key whose lease the previous run had granted to a task still running, which
    reconnects to the same port. It waits out the longest lease that run recorded now, and
    says where the earlier state is."""
    port = free_port()
    env = {"XDG_STATE_HOME": str(tmp_path)}
    first = DflockdProcess(["--host", "0.0.0.0", "--port", str(port)], env)
    try:
        first.wait_listening()
        with Wire(("127.0.0.1", port)) as holder:
            holder.lock("report", lease=60)
            first.proc.send_signal(signal.SIGTERM)
            assert first.wait_exit() == 0
    finally:
        first.kill()
    second = DflockdProcess(["--host", "127.0.0.1", "--port", str(port)], env)
    try:
        second.wait_listening()
        with Wire(("127.0.0.1", port)) as other:
            assert other.req("l", "report", "0") == "timeout"
        grace = next(line for line in second.drain() if "restart grace" in line)
    finally:
        second.kill()
    assert str(tmp_path / "dflockd" / f"0.0.0.0-{port}") in grace, grace
    # the longest lease that server recorded (60 s), not --max-lease-ttl (300 s)
    assert "granting no key for 60 s" in grace, grace
