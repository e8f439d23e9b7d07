"""A setting given explicitly where it has no effect, on ``dflockd`` started as a user starts
it: the start stops naming it and the setting it needs, as ``--metrics-host`` without
``--metrics-port`` does."""

from __future__ import annotations

import pytest

from tests.support.servers import run_dflockd

FSYNC = "--journal-fsync / DFLOCKD_JOURNAL_FSYNC"
STATE_DIR = "--state-dir / DFLOCKD_STATE_DIR"
LEASE_TTL = "--cluster-lease-ttl / DFLOCKD_CLUSTER_LEASE_TTL_S"
CLUSTER = "--cluster / DFLOCKD_CLUSTER"


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (["--state-dir", "none", "--journal-fsync", "always"], {}, (FSYNC, STATE_DIR)),
        (["--journal-fsync", "no"], {"DFLOCKD_STATE_DIR": "None"}, (FSYNC, STATE_DIR)),
        ([], {"DFLOCKD_STATE_DIR": "none", "DFLOCKD_JOURNAL_FSYNC": "always"}, (FSYNC, STATE_DIR)),
        (["--cluster-lease-ttl", "10"], {}, (LEASE_TTL, CLUSTER)),
        ([], {"DFLOCKD_CLUSTER_LEASE_TTL_S": "10"}, (LEASE_TTL, CLUSTER)),
    ],
)
def test_a_setting_without_effect_stops_the_start(
    args: list[str], env: dict[str, str], named: tuple[str, str]
) -> None:
    """``--journal-fsync`` with no state directory (no journal to fsync) and
    ``--cluster-lease-ttl`` without ``--cluster`` (no etcd lease): the server started and
    ignored them without a word, so an operator who asked for ``always`` believed every grant
    reached the disk. The start stops now, naming both settings (exit 2)."""
    done = run_dflockd(["--host", "127.0.0.1", "--port", "0", *args], env, timeout=10)
    assert done.returncode == 2, done
    for name in named:
        assert name in done.stderr, done


def test_the_journals_fsync_on_port_0_without_a_state_dir_stops_the_start() -> None:
    """Port 0 keeps no state unless ``--state-dir`` names a directory: ``--journal-fsync``
    there has no journal either."""
    done = run_dflockd(
        ["--host", "127.0.0.1", "--port", "0", "--journal-fsync", "always"], {}, timeout=10
    )
    assert done.returncode == 2, done
    assert FSYNC in done.stderr and STATE_DIR in done.stderr, done
