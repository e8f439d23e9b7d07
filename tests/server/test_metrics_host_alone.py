"""``--metrics-host`` without ``--metrics-port``, on ``dflockd`` started as a user starts it."""

from __future__ import annotations

import pytest

from tests.support.servers import run_dflockd


@pytest.mark.parametrize(
    ("args", "env"),
    [
        (["--metrics-host", "0.0.0.0"], {}),
        ([], {"DFLOCKD_METRICS_HOST": "0.0.0.0"}),
    ],
)
def test_a_metrics_host_without_a_metrics_port_stops_the_start(
    args: list[str], env: dict[str, str]
) -> None:
    """The operator binds the metrics endpoint (``DFLOCKD_METRICS_HOST=0.0.0.0`` for the
    Prometheus of another host) but forgets the port: the server started without metrics and
    said nothing, as ``--advertise`` without ``--members`` is refused. The start stops now,
    naming both settings (exit 2)."""
    done = run_dflockd(["--host", "127.0.0.1", "--port", "0", *args], env, timeout=10)
    assert done.returncode == 2, done
    assert "--metrics-host / DFLOCKD_METRICS_HOST" in done.stderr, done
    assert "--metrics-port / DFLOCKD_METRICS_PORT" in done.stderr, done
