# pyright: reportMissingTypeStubs=false
"""pytest fixtures for projects that test their own locked tasks (registered as ``pytest11``):
``dflock_server``, ``dflock_celery_config``, ``dflock_configure`` and the session-scoped
``dflock_session_server`` and ``dflock_session_celery_config``; see
[Testing your tasks](../testing.md) for what each is and recipes with Celery's fixtures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any, TypeVar

import pytest

# Loaded with the plugin, not lazily: pytest rewrites a plugin package's modules as they are
# imported, and on CPython 3.11.7 that can fail inside a test that follows an asyncio test.
import celery_dflock.beat  # pyright: ignore[reportUnusedImport]
import celery_dflock.task  # noqa: F401  # pyright: ignore[reportUnusedImport]
from celery_dflock.config import reset_config

if TYPE_CHECKING:
    from dflockd_server.testing import ServerThread

_AppT = TypeVar("_AppT")


def configure_app(app: _AppT, server: ServerThread) -> _AppT:
    """Point ``app`` (a Celery app) at ``server``, its cached dflock config dropped; return it."""
    celery_app: Any = app
    celery_app.conf.dflock_servers = f"{server.host}:{server.port}"
    reset_config(celery_app)
    return app


def _serve(request: pytest.FixtureRequest) -> Iterator[ServerThread]:
    try:
        from dflockd_server import Config
        from dflockd_server.testing import ServerThread
    except ImportError:
        # Not pytest.exit: a pytest-xdist worker's exit is an INTERNALERROR that drops the text.
        request.session.shouldstop = "the lock server is not installed"
        raise pytest.fail.Exception(
            "the dflock_server fixtures start a lock server in-process, and the lock server is "
            "not installed: install celery-dflock's `server` extra in the test environment "
            "(pip install 'celery-dflock[server]')",
            pytrace=False,
        ) from None

    with ServerThread(Config(host="127.0.0.1", port=0)) as server:
        yield server


def _celery_config(server: ServerThread) -> dict[str, Any]:
    return {"dflock_servers": f"{server.host}:{server.port}"}


@pytest.fixture
def dflock_server(request: pytest.FixtureRequest) -> Iterator[ServerThread]:
    """A lock server in this process on 127.0.0.1 and a free port, for one test."""
    yield from _serve(request)


@pytest.fixture
def dflock_celery_config(dflock_server: ServerThread) -> dict[str, Any]:
    """Celery settings that point an app at ``dflock_server``."""
    return _celery_config(dflock_server)


@pytest.fixture(scope="session")
def dflock_session_server(request: pytest.FixtureRequest) -> Iterator[ServerThread]:
    """`dflock_server` for the whole session (release what you take: a lock a test leaves
    held stays held for the next)."""
    yield from _serve(request)


@pytest.fixture(scope="session")
def dflock_session_celery_config(dflock_session_server: ServerThread) -> dict[str, Any]:
    """Celery settings that point an app at ``dflock_session_server``."""
    return _celery_config(dflock_session_server)


@pytest.fixture
def dflock_configure(dflock_server: ServerThread) -> Callable[[_AppT], _AppT]:
    """``configure(app)``: point an existing Celery app at ``dflock_server``."""
    return partial(configure_app, server=dflock_server)
