"""Fixtures for the server tests: TLS files as paths, a real ``dflockd`` subprocess, event loops."""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.certificates import key_of, make_certificate
from tests.support.servers import DflockdProcess


@pytest.fixture
def tls_files(tmp_path: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 and its key (as Path objects; tests/conftest.py
    gives the same as strings)."""
    cert = make_certificate(tmp_path)
    return cert, key_of(cert)


@pytest.fixture
def dflockd_process() -> Iterator[Callable[..., DflockdProcess]]:
    """``start(*args, env=None)`` -> a running ``dflockd`` subprocess; all killed at teardown."""
    started: list[DflockdProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> DflockdProcess:
        proc = DflockdProcess(list(args), env or {})
        started.append(proc)
        return proc

    yield start
    for proc in started:
        proc.kill()


def _event_loops() -> list[Any]:
    loops: list[Any] = [pytest.param(asyncio.new_event_loop, id="asyncio")]
    if importlib.util.find_spec("uvloop") is None:
        return loops
    uvloop: Any = importlib.import_module("uvloop")
    return [*loops, pytest.param(uvloop.new_event_loop, id="uvloop")]


@pytest.fixture(params=_event_loops())
def loop_factory(request: pytest.FixtureRequest) -> Callable[[], asyncio.AbstractEventLoop]:
    """Each event loop the server runs on here: asyncio's, and uvloop's where installed."""
    factory: Callable[[], asyncio.AbstractEventLoop] = request.param
    return factory
