"""Shared by the test apps: settings from the environment, the run log, readiness.

A worker subprocess gets its whole Celery configuration as JSON in
``DFLOCK_TEST_SETTINGS`` (broker, backend, queue, ``dflock_*``), so one app
module serves every test. Task bodies call :func:`record`, which appends one
JSON line to the file named by ``DFLOCK_TEST_LOG`` (``O_APPEND``: lines from
concurrent processes never interleave) and sends the same line as a datagram
to the test's socket ``DFLOCK_TEST_EVENTS`` so the test can wait for it
instead of sleeping.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections.abc import Mapping
from typing import Any, cast

from celery import Celery
from celery.signals import worker_ready

from tests.support.apps import make_app

SETTINGS_ENV = "DFLOCK_TEST_SETTINGS"
LOG_ENV = "DFLOCK_TEST_LOG"
EVENTS_ENV = "DFLOCK_TEST_EVENTS"
WORKER_ENV = "DFLOCK_TEST_WORKER"
HOLD_HEADER = "dflock_hold"
"""The message header that carries a publish-time hold (``{"key", "token"}``)."""


def settings_from_env() -> dict[str, Any]:
    raw = os.environ.get(SETTINGS_ENV)
    return json.loads(raw) if raw else {}


def worker_app(name: str) -> Celery:
    """The worker's Celery app, configured from the environment."""
    return make_app(name, settings_from_env())


def hold_header(request: Any) -> dict[str, Any] | None:
    """The request's ``dflock_hold`` header (a publish-time hold), or None."""
    found = getattr(request, HOLD_HEADER, None)
    if found is None:
        headers = getattr(request, "headers", None)
        if isinstance(headers, Mapping):
            found = cast("Mapping[str, Any]", headers).get(HOLD_HEADER)
    return dict(cast("Mapping[str, Any]", found)) if isinstance(found, Mapping) else None


RELEASE_WAIT_LIMIT_S = 60.0
"""Longest a body waits for its release file (a test that forgets it still ends)."""
RELEASE_POLL_S = 0.02


def wait_for_release(release_file: str | None) -> None:
    """Until ``release_file`` exists (at once for None), at most ``RELEASE_WAIT_LIMIT_S``: a
    body the test ends when it has seen what it needs while the key is held."""
    if release_file is None:
        return
    deadline = time.monotonic() + RELEASE_WAIT_LIMIT_S
    while not os.path.exists(release_file) and time.monotonic() < deadline:
        time.sleep(RELEASE_POLL_S)


def _send_event(line: bytes) -> None:
    path = os.environ.get(EVENTS_ENV)
    if not path:
        return
    # OSError: the test stopped listening (the log file still has the line).
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock, contextlib.suppress(OSError):
        sock.sendto(line, path)


def record(event: str, **fields: Any) -> None:
    """Append ``{"event": event, "pid": ..., "t": ..., **fields}`` to the run log."""
    entry = {
        "event": event,
        "pid": os.getpid(),
        "worker": os.environ.get(WORKER_ENV, ""),
        "t": time.time(),
        **fields,
    }
    line = (json.dumps(entry, default=str) + "\n").encode()
    path = os.environ.get(LOG_ENV)
    if path:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    _send_event(line)


def record_skipped(
    sender: Any = None, task_id: str | None = None, key: str = "", **kw: Any
) -> None:
    """A ``lock_skipped`` receiver: logs ``skipped`` (task id, key, the holder, the task)."""
    record(
        "skipped",
        task_id=task_id,
        key=key,
        holder=kw.get("holder"),
        task=getattr(sender, "name", None),
    )


def record_lock_lost(
    sender: Any = None, task_id: str | None = None, key: str = "", policy: str = "", **kw: Any
) -> None:
    """A ``lock_lost`` receiver: logs ``lock_lost`` (task id, key, policy, the lost fence)."""
    record("lock_lost", task_id=task_id, key=key, policy=policy, fence=kw["lock"].fence)


@worker_ready.connect
def _announce_ready(sender: Any = None, **_: Any) -> None:
    record("worker_ready")
