"""A ``--host`` (or ``--metrics-host``) that no lookup can take: the real ``dflockd`` and its
health check refuse it in one line naming the setting, not a traceback at the bind."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.servers import clean_env, run_dflockd

TOO_LONG = "a" * 64


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (["--host", "db..internal"], {}, "--host='db..internal'"),
        ([], {"DFLOCKD_HOST": TOO_LONG}, f"DFLOCKD_HOST='{TOO_LONG}'"),
        (
            ["--host", "127.0.0.1", "--metrics-port", "0", "--metrics-host", "."],
            {},
            "--metrics-host='.'",
        ),
    ],
)
def test_a_host_no_lookup_can_take_is_refused_naming_it(
    args: list[str], env: dict[str, str], named: str
) -> None:
    """``--host db..internal`` (a typo), a label over 63 characters: the bind's lookup raised
    the ``idna`` codec's ``UnicodeError``, and the start ended in a traceback (exit 1)."""
    done = run_dflockd(["--port", "0", "--state-dir", "none", *args], env)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert named in lines[0] and "not a host name or address" in lines[0], lines[0]


@pytest.mark.parametrize(
    ("args", "env"), [(["db..internal", "6388"], {}), ([], {"DFLOCKD_HOST": "db..internal"})]
)
def test_the_health_check_names_a_host_no_lookup_can_take(
    args: list[str], env: dict[str, str]
) -> None:
    """The health check connected to it and ended in the same traceback."""
    done = subprocess.run(
        [sys.executable, "-m", "dflockd_server.health", *args],
        env=clean_env(env),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert "bad setting" in done.stderr and "not a host name or address" in done.stderr


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (
            [
                "--cluster",
                "etcd://127.0.0.1:2379,etcd..internal:2379",
                "--advertise",
                "127.0.0.1:1",
            ],
            "--cluster=",
        ),
        (["--cluster", "etcd://127.0.0.1:1", "--advertise", "lock..internal:7000"], "--advertise="),
        (
            ["--members", "lock..a:7000,127.0.0.1:7000", "--advertise", "127.0.0.1:7000"],
            "--members=",
        ),
    ],
)
def test_an_etcd_endpoint_or_a_member_no_lookup_can_take_is_refused_naming_it(
    args: list[str], named: str
) -> None:
    """An etcd endpoint in ``--cluster`` that no lookup can take ended the start in the ``idna``
    codec's traceback; a member's (``--members``, ``--advertise``) was taken, and its clients
    could never reach it by that name."""
    done = run_dflockd(["--host", "127.0.0.1", "--port", "0", "--state-dir", "none", *args], {})
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert named in lines[0] and "is not a host name or address" in lines[0], lines[0]
