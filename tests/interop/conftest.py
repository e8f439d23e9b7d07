"""The real third-party dflockd peers from the package index, for the interop tests.

One venv per session (``dflockd`` 0.5.0, its server and clients, and ``dflockd-client`` 2.1.1),
on the interpreter they need: dflockd 0.5.0 requires Python >= 3.13. Without such an
interpreter or the package index the tests skip and say why; in CI (``CI=true``, or
``CELERY_DFLOCK_REQUIRE_REDIS=1`` as ``.ci/run`` sets) they fail.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import pytest

from tests.interop.interop_helpers import ForeignServer
from tests.support.services import services_required, unavailable
from tests.support.venvs import find_python, make_venv

PEER_REQUIREMENTS = ("dflockd==0.5.0", "dflockd-client==2.1.1")
PEER_PYTHON = "3.13"
"""dflockd 0.5.0 declares Requires-Python >= 3.13 (dflockd-client 2.1.1 runs there too)."""
START_TIMEOUT_S = 30.0
_LISTENING = re.compile(r"listening on \('127\.0\.0\.\d+', (\d+)\)")


def _unavailable(reason: str) -> NoReturn:
    required = os.environ.get("CI") == "true" or services_required()
    unavailable(reason, required=required, because="the interop tests must run in CI (.ci/run)")


@pytest.fixture(scope="session")
def peer_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The python of a fresh venv holding the dflockd peers."""
    python = find_python(PEER_PYTHON)
    if python is None:
        _unavailable(f"no CPython {PEER_PYTHON} found (dflockd 0.5.0 needs Python >= 3.13)")
    base = tmp_path_factory.mktemp("peers")
    links = base / "no-local-dists"
    links.mkdir()
    try:
        return make_venv(base / "venv", python, *PEER_REQUIREMENTS, find_links=links)
    except AssertionError as exc:
        _unavailable(f"cannot install {' '.join(PEER_REQUIREMENTS)} from the index: {exc}")


@pytest.fixture
def dflockd_050(
    request: pytest.FixtureRequest, peer_python: Path, tmp_path: Path
) -> Iterator[ForeignServer]:
    """A fresh dflockd 0.5.0 server on a loopback address of its own and an ephemeral port
    (extra command-line arguments from ``@pytest.mark.dflockd_args(...)``).

    Its own address (127.0.0.2-254), not 127.0.0.1: the tests count the connections it
    accepts, and a client of another test still calling a stopped server of its own on
    127.0.0.1 must not reach this one when the port is handed out again (seen with the suite
    in two processes: 4 connections counted instead of 2)."""
    marker = request.node.get_closest_marker("dflockd_args")
    extra = [str(arg) for arg in marker.args] if marker is not None else []
    log = tmp_path / "dflockd-0.5.0.log"
    host = f"127.0.0.{random.randint(2, 254)}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLOCKD_")}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [str(peer_python.parent / "dflockd"), "--host", host, "--port", "0", *extra],
            stdout=out, stderr=subprocess.STDOUT, env=env,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while (found := _LISTENING.search(log.read_text())) is None:
            assert proc.poll() is None, f"dflockd 0.5.0 exited: {log.read_text()}"
            assert time.monotonic() < deadline, f"dflockd 0.5.0 not listening: {log.read_text()}"
            time.sleep(0.05)
        yield ForeignServer(host, int(found[1]), log)
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "dflockd_args(*args): extra command-line arguments of the dflockd_050 server"
    )
