"""The files a setting names (a secret, a certificate, a fence state file, etcd's TLS files
and password) given as something that is no regular file: the real ``dflockd`` and its health
check stop in one line naming the setting, at once."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.servers import clean_env, run_dflockd

ETCD = ["--cluster", "etcds://127.0.0.1:1", "--advertise", "127.0.0.1:2"]


@pytest.mark.parametrize(
    ("flag", "others"),
    [
        ("--auth-token-file", []),
        ("--tls-cert", ["--tls-key", "KEY"]),
        ("--tls-key", ["--tls-cert", "CERT"]),
        ("--fence-state-file", []),
        ("--cluster-ca-file", ETCD),
        ("--cluster-password-file", [*ETCD, "--cluster-user", "u"]),
    ],
)
def test_a_fifo_given_as_a_setting_s_file_stops_the_start_naming_it(
    tmp_path: Path, tls_files: tuple[Path, Path], flag: str, others: list[str]
) -> None:
    """A FIFO nobody writes to: the start waited for a writer without end (no log line, no
    error), as a container whose secret mount went wrong would."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    cert, key = tls_files
    others = [{"KEY": str(key), "CERT": str(cert)}.get(arg, arg) for arg in others]
    args = ["--port", "0", "--state-dir", "none", flag, str(fifo), *others]
    result = run_dflockd(args, {}, timeout=20)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert flag in lines[0] and "no regular file" in lines[0], lines[0]


def test_a_secret_file_that_is_a_directory_or_a_fifo_is_named_by_the_health_check(
    tmp_path: Path,
) -> None:
    """The health check reads the server's ``DFLOCKD_AUTH_TOKEN_FILE`` as the server does: a
    FIFO there left it waiting (past the probe's own timeout) instead of saying why."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (fifo, tmp_path):
        done = subprocess.run(
            [sys.executable, "-m", "dflockd_server.health"],
            env=clean_env({"DFLOCKD_PORT": "1", "DFLOCKD_AUTH_TOKEN_FILE": str(path)}),
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
        )
        assert done.returncode == 1, done.stderr
        assert "--auth-token-file / DFLOCKD_AUTH_TOKEN_FILE" in done.stderr, done.stderr


def test_a_state_dir_that_is_a_file_is_a_bad_value_exit_2(tmp_path: Path) -> None:
    """A ``--state-dir`` (or a part of its path) that is a file is a bad value, as the docs say
    of every bad value: one line naming the setting, exit 2. It stopped the start with exit 1,
    the code of a server that failed while running, once it had tried to make the directory."""
    file = tmp_path / "file"
    file.write_text("not a directory")
    for given, env in (
        (["--state-dir", str(file)], {}),
        ([], {"DFLOCKD_STATE_DIR": str(file / "below")}),
    ):
        result = run_dflockd(["--host", "127.0.0.1", "--port", "0", *given], env, timeout=20)
        assert result.returncode == 2, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, lines
        assert "--state-dir / DFLOCKD_STATE_DIR" in lines[0] and "is no directory" in lines[0]


def test_a_secret_that_is_no_utf8_is_named(tmp_path: Path) -> None:
    """``DFLOCKD_AUTH_TOKEN`` holding a byte that is no UTF-8 (Python keeps it as a lone
    surrogate): the start said ``'utf-8' codec can't encode character '\\udcff'``, naming no
    setting."""
    result = run_dflockd(
        ["--host", "127.0.0.1", "--port", "0", "--state-dir", "none"],
        {"DFLOCKD_AUTH_TOKEN": "s3cret\udcff"},  # the byte 0xff, as the environment holds it
        timeout=20,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, lines
    assert "--auth-token / DFLOCKD_AUTH_TOKEN" in lines[0] and "not UTF-8" in lines[0], lines[0]
