"""A ``dflockd`` that cannot listen where it is told stops in a line naming the setting to
change, in the user's terms (``--port / DFLOCKD_PORT``, ``--host / DFLOCKD_HOST``)."""

from __future__ import annotations

import socket

from tests.support.servers import run_dflockd


def _error_line(stderr: str) -> str:
    errors = [line for line in stderr.splitlines() if line.startswith("dflockd: error:")]
    assert len(errors) == 1, stderr
    return errors[0]


def test_a_port_in_use_names_the_port_setting() -> None:
    """It said ``cannot serve on 127.0.0.1:N: [Errno 98] ... address already in use``, naming
    neither the flag nor the variable to change (the image sets ``DFLOCKD_PORT``)."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for flags, env in (
            (["--port", str(port)], {}),
            ([], {"DFLOCKD_PORT": str(port)}),
        ):
            done = run_dflockd(["--host", "127.0.0.1", "--state-dir", "none", *flags], env)
            assert done.returncode == 1, done.stderr
            line = _error_line(done.stderr)
            assert "choose another --port / DFLOCKD_PORT" in line, line


def test_a_host_that_is_no_address_here_names_the_host_setting() -> None:
    """An address of no interface here (TEST-NET-1), and an IPv6 address in brackets as
    ``--members`` and ``--advertise`` write it: neither named ``--host``, and the brackets
    were not said to be the fault."""
    done = run_dflockd(["--host", "192.0.2.1", "--port", "0", "--state-dir", "none"], {})
    assert done.returncode == 1, done.stderr
    line = _error_line(done.stderr)
    assert "--host / DFLOCKD_HOST is no address of this machine" in line, line
    done = run_dflockd(["--port", "0", "--state-dir", "none"], {"DFLOCKD_HOST": "[::1]"})
    assert done.returncode == 1, done.stderr
    line = _error_line(done.stderr)
    assert "--host / DFLOCKD_HOST" in line and "without brackets: --host ::1" in line, line


def test_a_metrics_host_that_is_no_address_here_names_the_metrics_host_setting() -> None:
    """A ``--metrics-host`` of no interface here, or that no lookup finds: the error told to
    choose another ``--metrics-port``, which was not at fault."""
    for host in ("192.0.2.1", "nonexistent.invalid"):
        flags = ["--port", "0", "--state-dir", "none", "--metrics-port", "0"]
        done = run_dflockd([*flags, "--metrics-host", host], {})
        assert done.returncode == 1, done.stderr
        line = _error_line(done.stderr)
        assert f"cannot serve metrics on {host}:0" in line, line
        assert "choose another --metrics-host / DFLOCKD_METRICS_HOST" in line, line
